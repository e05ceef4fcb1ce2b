import torch
import torch.nn.functional as F

from pagedmoe.layers import cpu_ops

from pagedmoe.layers.attention.metadata import AttentionGroup, AttentionMetadata, DecodeChunk, Workspace


class TorchPagedAttention:
    """PyTorch paged attention (CPU and CUDA). A layer's cache is head-major, [2 * num_kv_heads, num_blocks,
    block_size, head_dim] (K heads then V heads): viewed as rows of one (head, block) each, a group's context
    is one row gather into the workspace, already [heads, seqs, context, head_dim]. New K/V are written into
    their slots first. Decodes attend in the chunks the metadata planned (CPU: <= CHUNK_BYTES of context each),
    two batched matmuls a chunk; prefill chunks one sequence at a time, so a chunk with no earlier context runs
    causal SDPA with no padding and no mask. With a decode kernel in the metadata (CPU), decodes read their
    blocks in place instead (cpu_kernel.py), and with a prefill kernel (CPU) so do prefill chunks
    (cpu_prefill.py). A sliding-window layer (gpt-oss) attends the last `sliding_window` positions only; sinks
    ([num_heads], passed per call) are one more logit per head that joins each softmax's denominator and adds
    nothing to the output, as HF's eager gpt-oss attention computes them; those layers keep SDPA for prefill."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None):
        self.layer_idx, self.num_heads, self.num_kv_heads = layer_idx, num_heads, num_kv_heads
        self.head_dim, self.scale, self.window = head_dim, scale, sliding_window or 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 sinks: torch.Tensor | None = None):
        meta = meta.for_layer(self.window)
        cache = meta.layer_cache(self.layer_idx)
        if meta.triton is not None:
            return meta.triton.attend(q, k, v, cache, self.scale, self.window, sinks)
        if not cpu_ops.write_kv(cache, k, v, meta.slot_mapping):
            for half, new in zip(cache.split(self.num_kv_heads), (k, v)):
                half.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, meta.slot_mapping, new.transpose(0, 1))
        if meta.decode_kernel is not None and len(meta.groups) == 1 and meta.groups[0].is_decode:
            group = meta.groups[0]  # every token a decode, in sequence order: no gather, no scatter
            return meta.decode_kernel(q.contiguous(), cache, group.block_tables, group.seq_lens_tensor, self.scale,
                                      tables_checked=True, window=self.window, sinks=sinks)
        rows = cache.view(-1, cache.shape[2] * self.head_dim)
        out = torch.empty_like(q)
        for group in meta.groups:
            if group.is_decode:
                self._attend_decodes(q, cache, rows, group, meta, out, sinks)
            elif self._can_use_prefill_kernel(meta, sinks):
                self._attend_prefill_kernel(q, cache, group, meta, out)
            else:
                self._attend_prefill(q, rows, group, meta.workspace, out, sinks)
        return out

    def _gather(self, rows, index: torch.Tensor, num_seqs: int, workspace: Workspace):
        """K and V of the indexed blocks, each [num_kv_heads, num_seqs, context, head_dim]."""
        context = gather_rows(rows, index, workspace.get((index.numel(), rows.shape[1])))
        return context.view(2 * self.num_kv_heads, num_seqs, -1, self.head_dim).split(self.num_kv_heads)

    def _attend_decodes(self, q, cache, rows, group: AttentionGroup, meta: AttentionMetadata, out: torch.Tensor,
                        sinks: torch.Tensor | None):
        if meta.decode_kernel is not None:
            index = group.token_index[:, 0]
            out[index] = meta.decode_kernel(q[index], cache, group.block_tables, group.seq_lens_tensor, self.scale,
                                            tables_checked=True, window=self.window, sinks=sinks)
            return
        for chunk in group.decode_chunks:
            out[chunk.token_index] = self._attend_decode(q[chunk.token_index], rows, chunk, meta.workspace, sinks)

    def _attend_decode(self, q, rows, chunk: DecodeChunk, workspace: Workspace,
                       sinks: torch.Tensor | None) -> torch.Tensor:
        """One query per sequence: two batched matmuls with the query heads grouped per KV head
        (CPU SDPA kernels are slow for a single query row)."""
        num_seqs, group_size = q.shape[0], self.num_heads // self.num_kv_heads
        keys, values = self._gather(rows, chunk.context_index, num_seqs, workspace)
        q = q.view(num_seqs, self.num_kv_heads, group_size, self.head_dim).transpose(0, 1)
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale)
        scores = scores.masked_fill_(self._decode_mask(chunk, scores.shape[-1]), float("-inf"))
        if sinks is not None:
            sinks = sinks.view(self.num_kv_heads, 1, group_size, 1)
        probs = softmax_with_sinks(scores, sinks).to(q.dtype)
        o = torch.matmul(probs, values)
        return o.transpose(0, 1).reshape(num_seqs, self.num_heads, self.head_dim)

    def _decode_mask(self, chunk: DecodeChunk, width: int) -> torch.Tensor:
        if not self.window:
            return chunk.padding
        key_pos = torch.arange(width, device=chunk.seq_lens.device)
        outside = key_pos[None, :] < (chunk.seq_lens - self.window)[:, None]
        return chunk.padding | outside[None, :, None, :]

    def _can_use_prefill_kernel(self, meta: AttentionMetadata, sinks: torch.Tensor | None) -> bool:
        kernel = meta.prefill_kernel
        return kernel is not None and sinks is None and not self.window and kernel.supports(self.head_dim)

    def _attend_prefill_kernel(self, q, cache, group: AttentionGroup, meta: AttentionMetadata, out: torch.Tensor):
        bs, checked = cache.shape[2], meta.decode_kernel is not None  # the metadata checked tables if so
        for i, (start, num_new, seq_len) in enumerate(zip(group.query_starts, group.query_lens, group.seq_lens)):
            table = group.block_tables[i, :-(-seq_len // bs)]
            out[start:start + num_new] = meta.prefill_kernel(q[start:start + num_new].contiguous(), cache, table,
                                                             seq_len, self.scale, tables_checked=checked)

    def _attend_prefill(self, q, rows, group: AttentionGroup, workspace: Workspace, out: torch.Tensor,
                        sinks: torch.Tensor | None):
        bs = rows.shape[1] // self.head_dim
        for i, (start, num_new, seq_len) in enumerate(zip(group.query_starts, group.query_lens, group.seq_lens)):
            index = group.context_index[:, i, :-(-seq_len // bs)].flatten()
            keys, values = (c[:, :, :seq_len].transpose(0, 1) for c in self._gather(rows, index, 1, workspace))
            mask = causal_mask(num_new, seq_len, q.device, self.window)
            if sinks is not None:
                keys, values, mask = with_sink_key(keys, values, mask, sinks.to(q.dtype))
            o = F.scaled_dot_product_attention(q[start:start + num_new].transpose(0, 1)[None], keys, values,
                                               attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            out[start:start + num_new] = o[0].transpose(0, 1)


def gather_rows(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] = rows[index[i]]. 16-bit rows of even width move as 32-bit words: index_select's 16-bit path
    ran 3x slower per byte on CPU."""
    if rows.element_size() == 2 and rows.shape[-1] % 2 == 0:
        torch.index_select(rows.view(torch.int32), 0, index, out=out.view(torch.int32))
    else:
        torch.index_select(rows, 0, index, out=out)
    return out


def causal_mask(num_queries: int, seq_len: int, device, window: int = 0) -> torch.Tensor | None:
    """[num_queries, seq_len]: the queries are the last num_queries positions of the sequence, each sees itself
    and what precedes it, within `window` positions if one is given (HF: key > query - window). None where
    that is plain causal attention over the whole sequence (SDPA's is_causal)."""
    if num_queries == seq_len and not 0 < window < seq_len:
        return None
    mask = torch.ones(num_queries, seq_len, dtype=torch.bool, device=device).tril(seq_len - num_queries)
    return mask.triu(seq_len - num_queries - window + 1) if window else mask


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Float32 softmax over the last dim; sinks (broadcastable to scores[..., :1]) join the denominator only."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    combined = torch.cat([scores.float(), sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]


def with_sink_key(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor):
    """Keys and values ([1, kv_heads, seq_len, head_dim]) with one zero row more, and SDPA's additive mask
    [1, num_heads, queries, seq_len + 1] whose last column is each head's sink: q . 0 + sink is the sink's
    logit, and its zero value adds nothing to the output."""
    seq_len = keys.shape[2]
    if mask is None:
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=keys.device).tril()
    zeros = keys.new_zeros(*keys.shape[:2], 1, keys.shape[3])
    bias = torch.zeros(len(sinks), *mask.shape, dtype=keys.dtype, device=keys.device).masked_fill_(~mask, -torch.inf)
    bias = torch.cat([bias, sinks.view(-1, 1, 1).expand(-1, mask.shape[0], 1)], dim=-1)
    return torch.cat([keys, zeros], dim=2), torch.cat([values, zeros], dim=2), bias[None]
