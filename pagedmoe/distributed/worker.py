"""A non-driver rank: loads and shards its part of the model, then runs every step the driver broadcasts
until the driver sends None. `run_node` is a whole node > 0 of a several-node engine (headless)."""
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


def run_node(config):
    """Node node_rank's ranks: the first in this process, the others spawned; returns when the driver ends."""
    from pagedmoe.distributed.executor import spawn_ranks
    first = config.node_rank * config.ranks_per_node
    procs = spawn_ranks(config, range(first + 1, first + config.ranks_per_node), config.master_port)
    run_worker(config, first, config.world_size, config.master_port)
    for proc in procs:
        proc.join()
