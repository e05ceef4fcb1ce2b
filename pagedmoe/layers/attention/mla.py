import torch
import torch.nn.functional as F

from pagedmoe.layers.attention.metadata import AttentionGroup, AttentionMetadata
from pagedmoe.layers.attention.torch_backend import gather_rows


class MLAPagedAttention:
    """Multi-head latent attention over a paged cache that holds, per token, only the normalised KV latent
    [kv_lora_rank] and the shared rope key [rope_dim]. Queries come in already absorbed into latent space
    (q_nope @ W_UK), so every head scores against the same single-head cache entry:
    score = q_latent . latent + q_pe . k_pe, and the output stays in latent space (probs @ latent);
    the caller applies W_UV. Each group's heads are folded into its query rows for one padded SDPA call."""

    def __init__(self, layer_idx: int, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        self.layer_idx, self.num_heads = layer_idx, num_heads
        self.kv_lora_rank, self.entry_size, self.scale = kv_lora_rank, kv_lora_rank + rope_dim, scale

    def __call__(self, q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        if meta.triton is not None:
            return meta.triton.attend_latent(torch.cat((q_latent, q_pe), dim=-1), torch.cat((latent, k_pe), dim=-1),
                                             meta.layer_cache(self.layer_idx), self.kv_lora_rank, self.scale)
        cache = meta.layer_cache(self.layer_idx)[0]
        cache.view(-1, self.entry_size).index_copy_(0, meta.slot_mapping, torch.cat((latent, k_pe), dim=-1))
        q = torch.cat((q_latent, q_pe), dim=-1)
        out = q_latent.new_empty(q_latent.shape)
        for group in meta.groups:
            o = self._attend(q, cache, group, meta.workspace)
            out[group.token_index[group.valid]] = o[group.valid]
        return out

    def _attend(self, q: torch.Tensor, cache: torch.Tensor, group: AttentionGroup, workspace) -> torch.Tensor:
        num_seqs, num_rows = group.token_index.shape
        rows = cache.view(cache.shape[0], -1)
        index = group.block_tables.flatten()
        context = gather_rows(rows, index, workspace.get((index.numel(), rows.shape[1])))
        context = context.view(num_seqs, 1, -1, self.entry_size)
        queries = q[group.token_index].view(num_seqs, 1, num_rows * self.num_heads, self.entry_size)
        o = F.scaled_dot_product_attention(queries, context, context[..., :self.kv_lora_rank],
                                           attn_mask=self._per_head_mask(group.mask), scale=self.scale)
        return o.view(num_seqs, num_rows, self.num_heads, self.kv_lora_rank)

    def _per_head_mask(self, mask: torch.Tensor) -> torch.Tensor:
        num_seqs, _, num_rows, context_len = mask.shape
        per_head = mask[:, 0, :, None, :].expand(num_seqs, num_rows, self.num_heads, context_len)
        return per_head.reshape(num_seqs, 1, num_rows * self.num_heads, context_len)
