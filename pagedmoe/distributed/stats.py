"""What a multi-rank engine reports: ranks, rank 0's time in each kind of collective and steps run, and the
expert tokens each rank computed (a token routed to an expert with replicas counts a share on each) with
their max / mean."""
import time
from dataclasses import dataclass, field

import torch

from pagedmoe.distributed import parallel_state as ps
from pagedmoe.distributed.eplb import rank_loads


class RankStatsRequest:
    """Broadcast by the driver: every rank answers with its seconds by kind (gather_to_driver)."""


@dataclass
class RankSeconds:
    """Each rank's seconds in its forwards and in each collective, fetched at most every refresh_s."""
    refresh_s: float = 1.0
    by_rank: list[dict[str, float]] = field(default_factory=list)
    fetched: float = 0.0

    def get(self, executor) -> list[dict[str, float]]:
        if time.monotonic() - self.fetched >= self.refresh_s:
            executor.broadcast(RankStatsRequest())
            self.by_rank, self.fetched = ps.gather_to_driver(dict(ps.COMM_SECONDS)), time.monotonic()
        return self.by_rank


@dataclass
class ParallelStats:
    world_size: int
    num_steps: int
    comm_seconds: dict[str, float]  # rank 0's, by collective
    rank_expert_tokens: list[float]  # empty for a dense model
    rank_seconds: list[dict[str, float]] = field(default_factory=list)  # each rank's forward and collective time

    @property
    def expert_imbalance(self) -> float | None:
        tokens = self.rank_expert_tokens
        return max(tokens) / (sum(tokens) / len(tokens)) if tokens and sum(tokens) else None


def parallel_stats(moe_layers, expert_load: torch.Tensor | None, world_size: int, num_steps: int,
                   rank_seconds: list[dict[str, float]]) -> ParallelStats:
    comm = {kind: s for kind, s in ps.COMM_SECONDS.items() if kind != "forward"}
    return ParallelStats(world_size, num_steps, comm, rank_expert_tokens(moe_layers, expert_load, world_size),
                         rank_seconds)


def rank_expert_tokens(moe_layers, expert_load: torch.Tensor | None, world_size: int) -> list[float]:
    if expert_load is None or not moe_layers:
        return []
    if moe_layers[0].expert_map is None:  # experts split like the MLP: every rank computes every pair's slice
        return [float(expert_load.sum())] * world_size
    total = torch.zeros(world_size, dtype=torch.float64)
    for moe, load in zip(moe_layers, expert_load):
        total += rank_loads(moe.expert_map.placement, load)
    return total.tolist()
