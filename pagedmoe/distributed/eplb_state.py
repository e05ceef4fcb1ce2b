"""EPLB at run time. The driver keeps a window of each MoE layer's expert load and, every step_interval
steps, a new placement from it; every rank then moves expert weights to match with point-to-point sends
(an expert a rank already holds is copied locally) and swaps its expert map, between two steps."""
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagedmoe.distributed.eplb import better_of, imbalance, rebalance
from pagedmoe.distributed.expert_map import ExpertMap

EXPERT_WEIGHTS = ("w13", "w2", "w13_bias", "w2_bias")


@dataclass
class ExpertPlacement:
    placement: torch.Tensor  # [moe_layers, ranks, slots_per_rank] logical expert of each slot


@dataclass
class EplbState:
    num_ranks: int
    num_redundant: int
    window_size: int
    step_interval: int
    window: deque = field(default_factory=deque)
    num_steps: int = 0
    last_rebalance: int = 0
    history: list = field(default_factory=list)  # (step, max/mean rank load before, after), averaged over layers

    def record(self, expert_load: torch.Tensor):
        self.window.append(expert_load.cpu())
        while len(self.window) > self.window_size:
            self.window.popleft()
        self.num_steps += 1

    def is_due(self) -> bool:
        return self.num_steps - self.last_rebalance >= self.step_interval

    def next_placement(self, current: torch.Tensor) -> ExpertPlacement:
        load = torch.stack(list(self.window)).sum(dim=0).double()
        placement = better_of(current, rebalance(load, self.num_ranks, self.num_redundant), load)
        self.history.append((self.num_steps, _mean_imbalance(current, load), _mean_imbalance(placement, load)))
        self.last_rebalance = self.num_steps
        return ExpertPlacement(placement)


def _mean_imbalance(placement: torch.Tensor, load: torch.Tensor) -> float:
    return sum(imbalance(p, row) for p, row in zip(placement, load)) / len(load)


def current_placement(moe_layers) -> torch.Tensor:
    return torch.stack([moe.expert_map.placement for moe in moe_layers])


def apply_placement(moe_layers, placement: ExpertPlacement, rank: int):
    for moe, new in zip(moe_layers, placement.placement):
        move_experts(moe, new, rank)


def plan_moves(old: torch.Tensor, new: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(source rank, source slot, destination rank, destination slot) for every slot of the new placement:
    from the destination rank itself where it holds the expert already, else from the first rank that does."""
    moves = []
    for dst, row in enumerate(new.tolist()):
        for dst_slot, expert in enumerate(row):
            holders = (old == expert).nonzero().tolist()
            src, src_slot = next(((r, s) for r, s in holders if r == dst), holders[0])
            moves.append((src, src_slot, dst, dst_slot))
    return moves


def move_experts(moe, new: torch.Tensor, rank: int):
    names = [name for name in EXPERT_WEIGHTS if getattr(moe, name) is not None]
    old_weights = {name: getattr(moe, name).data for name in names}
    new_weights = {name: torch.empty_like(w) for name, w in old_weights.items()}
    ops = []
    for index, (src, src_slot, dst, dst_slot) in enumerate(plan_moves(moe.expert_map.placement, new)):
        for offset, name in enumerate(names):
            tag = index * len(names) + offset
            if src == dst == rank:
                new_weights[name][dst_slot] = old_weights[name][src_slot]
            elif src == rank:
                ops.append(dist.P2POp(dist.isend, old_weights[name][src_slot].contiguous(), dst, tag=tag))
            elif dst == rank:
                ops.append(dist.P2POp(dist.irecv, new_weights[name][dst_slot], src, tag=tag))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    for name, weight in new_weights.items():
        setattr(moe, name, torch.nn.Parameter(weight, requires_grad=False))
    moe.expert_map = ExpertMap(new, rank)
    refresh_kernels(moe)


def refresh_kernels(moe):
    """The CPU kernel and oneDNN copies were packed from the old weights."""
    if moe.cpu_experts is not None:
        moe.use_cpu_kernel(0)
    elif moe.packed_experts is not None:
        moe.packed_experts = None
        moe.pack()
