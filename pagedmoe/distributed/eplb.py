"""Expert-parallel load balancing (DeepSeek's EPLB, as vLLM adapts it): from each MoE layer's token counts
per logical expert, choose which logical expert every physical slot holds. Redundant slots go, one at a time,
to the expert with the highest load per replica; slots are then packed onto ranks, heaviest first, each to the
lightest rank with room. A token routed to an expert with several replicas goes to one of them by its index,
so the replicas share its load (and the output is unchanged: replicas hold the same weights)."""
import torch


def replicate_experts(load: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[E] load -> [num_slots] logical expert of each slot: every expert once, then the redundant slots to
    argmax(load / replicas)."""
    replicas = torch.ones_like(load, dtype=torch.long)
    for _ in range(num_slots - len(load)):
        replicas[torch.argmax(load.double() / replicas)] += 1
    return torch.repeat_interleave(torch.arange(len(load)), replicas)


def balanced_packing(weights: torch.Tensor, num_packs: int) -> torch.Tensor:
    """[N] item weights -> [N] pack of each item, N / num_packs items a pack: heaviest first, each to the
    lightest pack that still has room."""
    per_pack = len(weights) // num_packs
    pack_of, pack_load = torch.empty(len(weights), dtype=torch.long), [0.0] * num_packs
    pack_size = [0] * num_packs
    for item in torch.argsort(weights.double(), descending=True, stable=True).tolist():
        pack = min((p for p in range(num_packs) if pack_size[p] < per_pack), key=lambda p: pack_load[p])
        pack_of[item], pack_load[pack], pack_size[pack] = pack, pack_load[pack] + float(weights[item]), pack_size[pack] + 1
    return pack_of


def rebalance_layer(load: torch.Tensor, num_ranks: int, num_redundant: int) -> torch.Tensor:
    """[E] load -> [num_ranks, slots_per_rank] logical expert in each rank's slots."""
    num_slots = len(load) + num_redundant
    if num_slots % num_ranks:
        raise ValueError(f"num_redundant_experts: {len(load)} experts + {num_redundant} must divide over {num_ranks} ranks")
    slots = replicate_experts(load, num_slots)
    replicas = torch.bincount(slots, minlength=len(load))
    rank_of = balanced_packing(load.double()[slots] / replicas[slots], num_ranks)
    order = torch.argsort(rank_of, stable=True)
    return slots[order].view(num_ranks, num_slots // num_ranks)


def rebalance(load: torch.Tensor, num_ranks: int, num_redundant: int) -> torch.Tensor:
    """[layers, E] load -> [layers, num_ranks, slots_per_rank] placement."""
    return torch.stack([rebalance_layer(row, num_ranks, num_redundant) for row in load])


def better_of(current: torch.Tensor, proposed: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    """[layers, ranks, slots] each layer's proposed placement where it balances the load better than the current
    one, else the current (the greedy packing can lose to it, and an equal one is not worth the weight moves)."""
    return torch.stack([new if imbalance(new, row) < imbalance(old, row) else old
                        for old, new, row in zip(current, proposed, load)])


def initial_placement(num_layers: int, num_experts: int, num_ranks: int, num_redundant: int) -> torch.Tensor:
    """Before any load is known: experts in order over the ranks (vLLM's linear expert map), the redundant
    slots to experts 0, 1, ..."""
    num_slots = num_experts + num_redundant
    if num_slots % num_ranks:
        raise ValueError(f"num_redundant_experts: {num_experts} experts + {num_redundant} must divide over "
                         f"{num_ranks} ranks")
    slots = torch.cat([torch.arange(num_experts), torch.arange(num_redundant) % num_experts])
    return slots.view(1, num_ranks, -1).repeat(num_layers, 1, 1)


def rank_loads(placement: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    """[num_ranks] load of one layer's placement, each expert's load split evenly over its replicas."""
    replicas = torch.bincount(placement.flatten(), minlength=len(load)).double()
    return (load.double() / replicas)[placement].sum(dim=1)


def imbalance(placement: torch.Tensor, load: torch.Tensor) -> float:
    """max / mean of the ranks' loads (1.0: perfectly balanced)."""
    loads = rank_loads(placement, load)
    return float(loads.max() / loads.mean())
