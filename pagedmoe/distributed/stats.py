"""What a multi-rank engine reports: ranks, rank 0's time in each kind of collective and steps run, and the
expert tokens each rank computed (a token routed to an expert with replicas counts a share on each) with
their max / mean."""
from dataclasses import dataclass

import torch

from pagedmoe.distributed import parallel_state as ps
from pagedmoe.distributed.eplb import rank_loads


@dataclass
class ParallelStats:
    world_size: int
    num_steps: int
    comm_seconds: dict[str, float]
    rank_expert_tokens: list[float]  # empty for a dense model

    @property
    def expert_imbalance(self) -> float | None:
        tokens = self.rank_expert_tokens
        return max(tokens) / (sum(tokens) / len(tokens)) if tokens and sum(tokens) else None


def parallel_stats(moe_layers, expert_load: torch.Tensor | None, world_size: int, num_steps: int) -> ParallelStats:
    return ParallelStats(world_size, num_steps, dict(ps.COMM_SECONDS),
                         rank_expert_tokens(moe_layers, expert_load, world_size))


def rank_expert_tokens(moe_layers, expert_load: torch.Tensor | None, world_size: int) -> list[float]:
    if expert_load is None or not moe_layers:
        return []
    if moe_layers[0].expert_map is None:  # experts split like the MLP: every rank computes every pair's slice
        return [float(expert_load.sum())] * world_size
    total = torch.zeros(world_size, dtype=torch.float64)
    for moe, load in zip(moe_layers, expert_load):
        total += rank_loads(moe.expert_map.placement, load)
    return total.tolist()
