"""The Triton attention backend: a step's per-sequence tables and lengths as device tensors (built once a step,
read by every layer), the KV write and the paged attention kernels (triton_cache_ops.py, triton_attention.py)."""
from dataclasses import dataclass

import torch

from pagedmoe.layers.attention.triton_attention import MIN_DOT, paged_attention_kernel, reduce_splits_kernel
from pagedmoe.layers.attention.triton_cache_ops import write_kv
from pagedmoe.layers.triton_utils import dot_precision, next_power_of_2

BLOCK_N = {"cuda": 64, "cpu": 16}  # keys per tile (the interpreter's cost grows with tile count, not size)
MAX_PREFILL_ROWS = 64  # query rows x heads per program in a prefill tile
SPLIT_TOKENS = 256  # decode: about this much context per split
MAX_SPLITS = 16


@dataclass
class TritonAttention:
    """One step's attention inputs, per sequence: its query tokens are rows query_starts[s] ...
    + query_lens[s] of the step, the last of its seq_lens[s] positions, over block_tables[s]."""
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_starts: torch.Tensor  # [num_seqs] int32
    query_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    num_splits: int  # split-K programs per sequence and KV head (a power of 2)
    slot_mapping: torch.Tensor | None = None  # [num_tokens] the KV write's slots (the metadata's)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, scale: float,
               window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A standard layer: k and v [num_tokens, num_kv_heads, head_dim] written into cache
        [2 * num_kv_heads, num_blocks, block_size, head_dim] (K heads, then V heads), then q attends."""
        num_kv_heads = cache.shape[0] // 2
        write_kv(cache, torch.cat((k, v), dim=1), self.slot_mapping)
        return paged_attention(q, cache[:num_kv_heads], cache[num_kv_heads:], self, scale, window, sinks)

    def attend_latent(self, q: torch.Tensor, entries: torch.Tensor, cache: torch.Tensor, latent_dim: int,
                      scale: float) -> torch.Tensor:
        """MLA: entries [num_tokens, latent + rope] into cache [1, num_blocks, block_size, latent + rope];
        q [num_tokens, num_heads, latent + rope] scores against whole entries and takes their latents."""
        write_kv(cache, entries[:, None], self.slot_mapping)
        return paged_attention(q, cache, cache[..., :latent_dim], self, scale)


def build_triton_attention(query_lens: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           block_size: int, device: torch.device, num_splits: int | None = None) -> TritonAttention:
    as_int32 = lambda t: t.to(device=device, dtype=torch.int32)
    max_query_len = int(query_lens.max())
    if num_splits is None:
        num_splits = decode_splits(int(seq_lens.max())) if max_query_len == 1 else 1
    query_starts = torch.cumsum(query_lens, 0) - query_lens
    num_blocks = -(-int(seq_lens.max()) // block_size)
    return TritonAttention(as_int32(block_tables[:, :num_blocks].contiguous()), as_int32(seq_lens),
                           as_int32(query_starts), as_int32(query_lens), max_query_len, num_splits)


def decode_splits(max_seq_len: int) -> int:
    return min(MAX_SPLITS, next_power_of_2(-(-max_seq_len // SPLIT_TOKENS)))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: TritonAttention,
                    scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """out [num_tokens, num_heads, v_dim]: each query row attends its sequence's positions up to its own
    (within `window` of it, where given) in k_cache / v_cache [num_kv_heads, num_blocks, block_size, dim]."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    num_tokens, num_heads, k_dim = q.shape
    num_kv_heads, _, block_size, v_dim = v_cache.shape
    out = q.new_empty(num_tokens, num_heads, v_dim)
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_q = max(MIN_DOT // group_pad, 1, min(next_power_of_2(step.max_query_len), MAX_PREFILL_ROWS // group_pad))
    num_q_tiles = -(-step.max_query_len // block_q)
    splits = step.num_splits
    partials = _partials(splits, num_tokens, num_heads, v_dim, q.device)
    sinks_arg = sinks.float().contiguous() if sinks is not None else out
    grid = (len(step.seq_lens) * num_q_tiles, num_kv_heads, splits)
    paged_attention_kernel.on(q.device)[grid](
        q, k_cache, v_cache, out, *partials, step.block_tables, step.seq_lens, step.query_starts, step.query_lens,
        sinks_arg, scale, window or 0, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), step.block_tables.stride(0), num_tokens, num_heads, num_q_tiles,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=BLOCK_N.get(q.device.type, 64),
        BLOCK_SIZE=block_size, DK=k_dim, DK_PAD=_dot_side(k_dim), DV=v_dim, DV_PAD=_dot_side(v_dim),
        NUM_SPLITS=splits, HAS_SINKS=sinks is not None, PRECISION=dot_precision(q.dtype))
    if splits > 1:
        reduce_splits_kernel.on(q.device)[(num_tokens, num_heads)](
            *partials, sinks_arg, out, out.stride(0), out.stride(1), num_tokens, num_heads, DV=v_dim,
            DV_PAD=next_power_of_2(v_dim), NUM_SPLITS=splits, HAS_SINKS=sinks is not None)
    return out


def _partials(splits: int, num_tokens: int, num_heads: int, v_dim: int, device) -> tuple[torch.Tensor, ...]:
    """Split-K's per-split outputs, maxima and sums (float32); one-element placeholders without splits."""
    rows = (splits, num_tokens, num_heads) if splits > 1 else (1, 1, 1)
    acc = torch.empty(*rows, v_dim if splits > 1 else 1, dtype=torch.float32, device=device)
    return acc, torch.empty(rows, dtype=torch.float32, device=device), torch.empty(rows, dtype=torch.float32,
                                                                                  device=device)


def _dot_side(dim: int) -> int:
    return max(next_power_of_2(dim), MIN_DOT)
