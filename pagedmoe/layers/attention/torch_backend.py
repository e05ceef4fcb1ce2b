import torch
import torch.nn.functional as F

from pagedmoe.layers.attention.metadata import AttentionGroup, AttentionMetadata, Workspace


class TorchPagedAttention:
    """PyTorch paged attention (CPU and CUDA). A layer's cache is head-major, [2 * num_kv_heads, num_blocks,
    block_size, head_dim] (K heads then V heads), so gathering a group's blocks gives [heads, seqs, context,
    head_dim] with no transpose copy. New K/V are written into their slots first, then each group (decodes /
    prefill chunks) attends over its context in one call."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.layer_idx, self.num_heads, self.num_kv_heads = layer_idx, num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        cache = meta.kv_caches[self.layer_idx]
        k_cache, v_cache = cache.split(self.num_kv_heads)
        for half, new in ((k_cache, k), (v_cache, v)):
            half.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, meta.slot_mapping, new.transpose(0, 1))
        out = torch.empty_like(q)
        for group in meta.groups:
            o = self._attend(q, cache, group, meta.workspace)
            out[group.token_index[group.valid]] = o[group.valid]
        return out

    def _attend(self, q, cache, group: AttentionGroup, workspace: Workspace) -> torch.Tensor:
        num_seqs, num_blocks = group.block_tables.shape
        context = workspace.get((2 * self.num_kv_heads, num_seqs * num_blocks, cache.shape[2] * self.head_dim))
        torch.index_select(cache.flatten(2), 1, group.block_tables.flatten(), out=context)
        keys, values = context.view(2 * self.num_kv_heads, num_seqs, -1, self.head_dim).split(self.num_kv_heads)
        if group.token_index.shape[1] == 1:
            return self._attend_decode(q[group.token_index[:, 0]], keys, values, group.mask)
        o = F.scaled_dot_product_attention(q[group.token_index].transpose(1, 2), keys.transpose(0, 1),
                                           values.transpose(0, 1), attn_mask=group.mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(1, 2)

    def _attend_decode(self, q, keys, values, mask) -> torch.Tensor:
        """One query per sequence: two batched matmuls with the query heads grouped per KV head
        (CPU SDPA kernels are slow for a single query row)."""
        num_seqs, group_size = q.shape[0], self.num_heads // self.num_kv_heads
        q = q.view(num_seqs, self.num_kv_heads, group_size, self.head_dim).transpose(0, 1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~mask.view(1, num_seqs, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, values)
        return o.transpose(0, 1).reshape(num_seqs, 1, self.num_heads, self.head_dim)
