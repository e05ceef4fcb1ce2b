"""Which KV manager an engine gets: the plain one, the hybrid one (sliding-window layers with tables of their
own), and under data-parallel attention one of those per rank behind a facade."""
from pagedmoe.config import EngineConfig
from pagedmoe.engine.kv_cache_hybrid import HybridKVCacheManager
from pagedmoe.engine.kv_cache_manager import KVCacheManager


def make_kv_cache_manager(config: EngineConfig, runner, static, lookahead: int):
    if config.data_parallel_size == 1:
        return one_kv_cache_manager(config, runner, static, lookahead)
    from pagedmoe.engine.kv_cache_dp import DataParallelKVManager
    return DataParallelKVManager([one_kv_cache_manager(config, runner, static, lookahead)
                                  for _ in range(config.data_parallel_size)])


def one_kv_cache_manager(config: EngineConfig, runner, static, lookahead: int) -> KVCacheManager:
    args = (runner.num_blocks, runner.num_host_blocks, config.block_size, config.enable_prefix_caching,
            config.kv_offload, runner.num_disk_blocks, static, lookahead)
    if runner.sliding_window is None:
        return KVCacheManager(*args)
    return HybridKVCacheManager(*args, sliding_window=runner.sliding_window,
                                max_step_tokens=config.max_num_batched_tokens)
