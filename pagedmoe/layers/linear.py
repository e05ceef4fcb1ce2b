import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One matmul for several HF projections (q/k/v, gate/up); each checkpoint tensor loads into its row range."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets, offset = {}, 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor):
        offset, size = self.shard_offsets[shard]
        target = getattr(self, param_name)
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard}.{param_name}: expected {size} rows, got {tuple(tensor.shape)}")
        target.data[offset:offset + size].copy_(tensor)
