"""The driver's side of a multi-process engine: rank 0 runs in the engine process (the engine's own model
runner holds shard 0) and spawns one process per other rank, each running worker.py's loop. Every step the
driver broadcasts the step's plan; a rank that has exited or stops answering within the process group's
timeout raises WorkerDiedError, which the engine treats as fatal (no request explains it)."""
import logging
import multiprocessing
import socket

from pagedmoe.distributed import parallel_state as ps

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    is_fatal = True  # engine/isolation.py: the engine stops instead of blaming a request


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def spawn_ranks(config, ranks: range, port: int) -> list:
    """This node's ranks other than the one in this process, each a spawned process running worker.py."""
    from pagedmoe.distributed.worker import run_worker
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=run_worker, args=(config, rank, config.world_size, port), daemon=True,
                             name=f"pagedmoe-rank{rank}") for rank in ranks]
    for proc in procs:
        proc.start()
    return procs


class MultiprocExecutor:
    def __init__(self, config):
        port = config.master_port or free_port(config.master_addr)
        self.procs = spawn_ranks(config, range(1, config.ranks_per_node), port)
        ps.init_process_group(0, config.world_size, config.master_addr, port, config.distributed_timeout_s)
        self.is_shut_down = False

    def check_workers(self):
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise WorkerDiedError(f"{dead[0].name} exited with code {dead[0].exitcode}")

    def broadcast(self, plan):
        self.check_workers()
        try:
            return ps.broadcast_object(plan)
        except RuntimeError as error:  # gloo: a peer closed its connection or missed the timeout
            raise WorkerDiedError(f"a rank stopped answering: {error}") from error

    def shutdown(self):
        if self.is_shut_down:
            return
        self.is_shut_down = True
        try:
            self.broadcast(None)
        except WorkerDiedError as error:
            logger.warning("shutting down after a rank died: %s", error)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():  # hung, or stopped: SIGKILL is the one signal a stopped process cannot hold
                proc.kill()
                proc.join(timeout=5)
        ps.destroy()
