"""Which physical expert slots a rank holds, and where each routed (token, expert) pair goes: a logical expert
with several replicas sends token t's pair to replica (t + slot) mod replicas, spreading its load."""
import torch


class ExpertMap:
    def __init__(self, placement: torch.Tensor, rank: int):
        """placement: [num_ranks, slots_per_rank] logical expert held in each rank's slots."""
        self.placement, self.rank = placement, rank
        self.slots_per_rank = placement.shape[1]
        physical_to_logical = placement.flatten()
        self.num_replicas = torch.bincount(physical_to_logical)
        self.replicas = torch.full((len(self.num_replicas), int(self.num_replicas.max())), -1, dtype=torch.long)
        seen = [0] * len(self.num_replicas)
        for physical, logical in enumerate(physical_to_logical.tolist()):
            self.replicas[logical, seen[logical]], seen[logical] = physical, seen[logical] + 1

    @property
    def local_experts(self) -> list[int]:
        return self.placement[self.rank].tolist()

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k] logical ids -> this rank's slot of each pair, -1 where another rank computes it."""
        tokens, k = topk_ids.shape
        turn = torch.arange(tokens)[:, None] + torch.arange(k)[None, :]
        physical = self.replicas[topk_ids, turn % self.num_replicas[topk_ids]]
        local = physical - self.rank * self.slots_per_rank
        return torch.where((local >= 0) & (local < self.slots_per_rank), local, -1)
