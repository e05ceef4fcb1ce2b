"""The KV cache's writes and block copies as Triton kernels: reshape-and-cache (each new token's K/V rows into
its slot) and the copy of whole blocks within the device pool (copy-on-write, and any device-to-device move).
Swaps between host and device stay tensor copies: they cross devices, which is a DMA transfer, not a kernel."""
import torch
import triton.language as tl

from pagedmoe.layers.triton_utils import Kernel, next_power_of_2


def _write_rows(rows_ptr, cache_ptr, slot_mapping_ptr, stride_rt, stride_rh, stride_ch, ROW: tl.constexpr,
                ROW_PAD: tl.constexpr):
    """Program (token, head): rows[token, head] into the head's slot of a cache viewed [heads, slots, ROW];
    slot -1 (a CUDA graph's padding row) writes nothing."""
    token, head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)
    row = tl.load(rows_ptr + token * stride_rt + head * stride_rh + offs, mask=offs < ROW)
    tl.store(cache_ptr + head * stride_ch + slot * ROW + offs, row, mask=offs < ROW)


def _copy_blocks(cache_ptr, pairs_ptr, block_elems, stride_part, stride_block, CHUNK: tl.constexpr):
    """Program (pair, part, chunk): one chunk of block pairs[pair, 0] copied onto block pairs[pair, 1], in one
    part (layer x K/V tensor) of a cache viewed [parts, blocks, block_elems]."""
    pair, part, chunk = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    base = cache_ptr + part * stride_part
    values = tl.load(base + src * stride_block + offs, mask=offs < block_elems)
    tl.store(base + dst * stride_block + offs, values, mask=offs < block_elems)


write_rows_kernel = Kernel(_write_rows)
copy_blocks_kernel = Kernel(_copy_blocks)
COPY_CHUNK = 1024


def write_kv(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor):
    """cache [heads, num_blocks, block_size, row] (one layer's K heads then V heads, or MLA's one latent
    head) takes rows [num_tokens, heads, row] at slot_mapping [num_tokens]."""
    heads, _, _, row = cache.shape
    if rows.shape[1:] != (heads, row) or cache.stride(2) != row or rows.stride(-1) != 1:
        raise ValueError(f"rows {tuple(rows.shape)} do not fit a cache of shape {tuple(cache.shape)}")
    if rows.shape[0] == 0:
        return
    write_rows_kernel.on(cache.device)[(rows.shape[0], heads)](
        rows, cache, slot_mapping, rows.stride(0), rows.stride(1), cache.stride(0), ROW=row,
        ROW_PAD=next_power_of_2(row))


def copy_blocks(cache: torch.Tensor, pairs: list[tuple[int, int]]):
    """Every layer's and K/V tensor's block src copied onto block dst, for each (src, dst) pair, in a pool
    [layers, kv_tensors, num_blocks, ...] (contiguous)."""
    if not pairs:
        return
    num_blocks = cache.shape[2]
    parts = cache.view(cache.shape[0] * cache.shape[1], num_blocks, -1)
    block_elems = parts.shape[2]
    pair_tensor = torch.tensor(pairs, dtype=torch.int64).to(cache.device)
    grid = (len(pairs), parts.shape[0], -(-block_elems // COPY_CHUNK))
    copy_blocks_kernel.on(cache.device)[grid](parts, pair_tensor, block_elems, parts.stride(0), parts.stride(1),
                                              CHUNK=COPY_CHUNK)
