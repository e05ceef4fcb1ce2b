"""A non-driver rank: loads and shards its part of the model, then runs every step the driver broadcasts
until the driver sends None."""
import logging

from pagedmoe.distributed import parallel_state as ps


def run_worker(config, rank: int, world_size: int, port: int):
    from pagedmoe.worker.model_runner import ModelRunner
    logging.basicConfig(level=logging.WARNING)
    ps.init_process_group(rank, world_size, config.master_addr, port, config.distributed_timeout_s)
    runner = ModelRunner(config, ps.RankInfo(rank, world_size))
    while (plan := ps.broadcast_object()) is not None:
        runner.run_plan(plan)
    ps.destroy()
