import torch
import torch.nn.functional as F

from pagedmoe.layers.attention.metadata import AttentionGroup, AttentionMetadata


class TorchPagedAttention:
    """PyTorch paged attention (CPU and CUDA): write new K/V into their slots, then read each group's
    context through its block tables into one padded SDPA call."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.layer_idx, self.num_heads, self.num_kv_heads = layer_idx, num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        k_cache, v_cache = meta.kv_caches[self.layer_idx]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for group in meta.groups:
            o = self._attend(q, k_cache, v_cache, group)
            out[group.token_index[group.valid]] = o[group.valid]
        return out

    def _attend(self, q, k_cache, v_cache, group: AttentionGroup) -> torch.Tensor:
        num_seqs = group.block_tables.shape[0]
        keys = k_cache[group.block_tables].view(num_seqs, -1, self.num_kv_heads, self.head_dim)
        values = v_cache[group.block_tables].view(num_seqs, -1, self.num_kv_heads, self.head_dim)
        if group.token_index.shape[1] == 1:
            return self._attend_decode(q[group.token_index[:, 0]], keys, values, group.mask)
        o = F.scaled_dot_product_attention(q[group.token_index].transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=group.mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(1, 2)

    def _attend_decode(self, q, keys, values, mask) -> torch.Tensor:
        """One query per sequence: two batched matmuls with the query heads grouped per KV head
        (CPU SDPA kernels are slow for a single query row)."""
        num_seqs, group_size = q.shape[0], self.num_heads // self.num_kv_heads
        q = q.view(num_seqs, self.num_kv_heads, group_size, self.head_dim)
        scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, values.transpose(1, 2))
        return o.view(num_seqs, 1, self.num_heads, self.head_dim)
