"""The CPU decode-attention kernel (csrc/paged_decode.cpp): it reads each sequence's KV blocks in place
instead of gathering them, so a decode step moves the context through memory once. Built and loaded by
layers/cpu_build.py; bf16 is converted with integer bit operations, so it needs no bf16 instructions.
Where it cannot be built or loaded, RuntimeError: the model runner then warns and uses the PyTorch path."""
import ctypes
import functools
from pathlib import Path

import torch

from pagedmoe.layers import cpu_build
from pagedmoe.layers.cpu_build import num_threads, ptr

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
ENTRY_POINTS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    return cpu_build.load_library(SOURCE, compiler, march)


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_seqs", "max_blocks", "num_kv_heads", "group_size", "num_blocks", "block_size", "head_dim", "window")]


class PagedDecodeKernel:
    """out[s] = attention of q[s] ([num_heads, head_dim]) over the first seq_lens[s] positions of sequence
    s's blocks in one layer's cache ([2 * num_kv_heads, num_blocks, block_size, head_dim]); with a window,
    over the last `window` of them only; sinks ([num_heads], float32): one more logit per head in each
    softmax's denominator (gpt-oss)."""

    def __init__(self, dtype: torch.dtype, library: ctypes.CDLL | None = None):
        if dtype not in ENTRY_POINTS:
            raise ValueError(f"dtype: the CPU attention kernel supports {sorted(map(str, ENTRY_POINTS))}, "
                             f"got {dtype}")
        self.dtype, self.fn = dtype, getattr(library if library is not None else load_library(), ENTRY_POINTS[dtype])
        self.fn.restype = None

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, tables_checked: bool = False, window: int = 0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """tables_checked: check_tables already passed for these tables and this cache's shape (once per step,
        not once per layer)."""
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = cache.shape[0] // 2
        _check(q, cache, block_tables, seq_lens, self.dtype)
        sinks = _float_sinks(sinks, num_heads)
        if not tables_checked:
            check_tables(block_tables, seq_lens, cache.shape[1], cache.shape[2])
        out = torch.empty_like(q)
        shape = Shape(num_seqs, block_tables.shape[1], num_kv_heads, num_heads // num_kv_heads,
                      cache.shape[1], cache.shape[2], head_dim, max(0, window or 0))
        self.fn(*map(ptr, (q, cache, block_tables, seq_lens, out)), shape, ctypes.c_float(scale), ptr(sinks),
                num_threads())
        return out


def _float_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    if sinks is None:
        return None
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks: expected shape ({num_heads},), got {tuple(sinks.shape)}")
    return sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _check(q, cache, block_tables, seq_lens, dtype):
    if q.dtype != dtype or cache.dtype != dtype:
        raise ValueError(f"q and cache must be {dtype}, got {q.dtype} and {cache.dtype}")
    if block_tables.dtype != torch.long or seq_lens.dtype != torch.long:
        raise ValueError("block_tables and seq_lens must be int64")
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in (q, cache, block_tables, seq_lens)):
        raise ValueError("the CPU attention kernel needs contiguous CPU tensors")
    if cache.shape[0] % 2 or q.shape[1] % (cache.shape[0] // 2) or q.shape[2] != cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of shape {tuple(cache.shape)}")
    if len(seq_lens) != q.shape[0] or block_tables.shape[0] != q.shape[0]:
        raise ValueError("q, block_tables and seq_lens must have one row per sequence")


def check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int):
    """The values the kernel indexes by: every seq_len in [1, blocks per table * block_size], every block id
    in [0, num_blocks)."""
    if len(seq_lens) and not (0 < int(seq_lens.min()) and int(seq_lens.max()) <= block_tables.shape[1] * block_size):
        raise ValueError("seq_lens must be >= 1 and within the block tables")
    if block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < num_blocks:
        raise ValueError(f"block_tables: block ids must be in [0, {num_blocks})")
