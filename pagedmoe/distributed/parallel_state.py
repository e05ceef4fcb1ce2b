"""The process group every rank of one engine joins, and the collectives the sharded layers call. One group
for now: tensor parallelism over all ranks (expert parallelism reuses it)."""
import contextlib
import datetime
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


COMM_SECONDS: dict[str, float] = defaultdict(float)  # this process's time in each collective, and "forward"


@contextlib.contextmanager
def timed(kind: str):
    start = time.perf_counter()
    yield
    COMM_SECONDS[kind] += time.perf_counter() - start


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float):
    """gloo over TCP (torchrun's MASTER_ADDR / MASTER_PORT convention); a collective that waits longer than
    timeout_s for a rank raises instead of hanging."""
    if master_addr.startswith("127.") or master_addr == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (gloo reduces float32; bf16 partial sums are reduced in float32)."""
    with timed("all_reduce"):
        if x.dtype == torch.float32:
            dist.all_reduce(x)
            return x
        full = x.float()
        dist.all_reduce(full)
        return x.copy_(full)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x joined along the last dimension, in rank order."""
    parts = [torch.empty_like(x) for _ in range(world_size())]
    with timed("all_gather"):
        dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_gather_list(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's x (all the same shape), in rank order."""
    parts = [torch.empty_like(x) for _ in range(world_size())]
    with timed("all_gather"):
        dist.all_gather(parts, x.contiguous())
    return parts


def broadcast_object(obj=None):
    """Rank 0's obj on every rank (pickled; the step's plan is a few lists of ints)."""
    box = [obj]
    with timed("broadcast"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_driver(obj) -> list | None:
    """Every rank's obj in rank order on rank 0 (None elsewhere)."""
    gathered = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def destroy():
    if dist.is_initialized():
        dist.destroy_process_group()
