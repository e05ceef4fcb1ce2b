"""Tiered KV offload: blocks evicted from the device pool go to the host tier, then to disk; a later prefix
hit loads them back instead of recomputing, with identical output."""
import os

import pytest

from conftest import VOCAB, assert_all_blocks_free
from pagedmoe import LLM, SamplingParams
from pagedmoe.config import GIB

PREFIX = [(i * 5) % (VOCAB - 2) + 1 for i in range(64)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _evict_everything(llm):
    for seed in range(4):
        other = [(seed * 37 + i * 13) % (VOCAB - 2) + 1 for i in range(90)]
        llm.generate({"prompt_token_ids": other}, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def block_bytes(dense_model):
    return LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True, num_kv_blocks=1).engine.runner.block_bytes


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_prefix_served_from_lower_tier(dense_model, block_bytes, tier, tmp_path):
    prompt = {"prompt_token_ids": PREFIX + [7, 8, 9]}
    reference = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    expected = reference.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    host_blocks = 64 if tier == "host" else 8
    llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True, num_kv_blocks=12, kv_offload=True,
              swap_space=host_blocks * block_bytes / GIB, kv_offload_disk_bytes=64 * block_bytes,
              kv_offload_dir=str(tmp_path))
    first = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    _evict_everything(llm)
    engine = llm.engine
    assert not any(h in engine.kv.pool.cached for h in engine.kv.disk.hashes) or tier == "host"
    computed_before = engine.get_stats().num_prompt_tokens
    again = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    stats = engine.get_stats()
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected
    assert again.num_cached_tokens == 64
    assert stats.prefix_cache_hits_by_tier[tier] >= 64
    assert stats.num_prompt_tokens - computed_before == len(prompt["prompt_token_ids"]) - 64
    if tier == "disk":
        assert stats.num_spilled_blocks > 0 and os.listdir(engine.runner.kv_cache.disk_dir)
        assert len(os.listdir(engine.runner.kv_cache.disk_dir)) == len(engine.kv.disk.hashes)
    assert_all_blocks_free(engine)
