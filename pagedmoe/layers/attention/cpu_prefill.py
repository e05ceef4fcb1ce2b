"""The CPU prefill-attention kernel (csrc/paged_prefill.cpp): causal attention of one sequence's new positions
over its paged context, on the register-tile GEMM with an online softmax. torch's CPU flash attention (SDPA)
ran a 223-token prefill of the 100M models at ~24 GFLOP/s on Zen 1 (see docs/BENCHMARKS.md). Built and loaded
by layers/cpu_build.py; where it cannot be, RuntimeError: the model runner then keeps SDPA."""
import ctypes
import functools
from pathlib import Path

import torch

from pagedmoe.layers import cpu_build
from pagedmoe.layers.attention.cpu_kernel import check_tables
from pagedmoe.layers.cpu_build import num_threads, ptr

SOURCE = Path(__file__).with_name("csrc") / "paged_prefill.cpp"
ENTRY_POINTS = {torch.float32: "paged_prefill_f32", torch.bfloat16: "paged_prefill_bf16"}


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    library = cpu_build.load_library(SOURCE, compiler, march)
    for name in ("paged_prefill_max_head_dim", "paged_prefill_panel"):
        getattr(library, name).restype = ctypes.c_int64
    return library


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_queries", "seq_len", "num_heads", "num_kv_heads", "num_blocks", "block_size", "head_dim")]


class PagedPrefillKernel:
    """out = causal attention of q ([num_queries, num_heads, head_dim], the last num_queries of seq_len
    positions) over the first seq_len positions of a sequence's blocks (block_table) in one layer's cache
    ([2 * num_kv_heads, num_blocks, block_size, head_dim]). No sliding window and no sinks: those layers keep
    SDPA."""

    def __init__(self, dtype: torch.dtype, library: ctypes.CDLL | None = None):
        if dtype not in ENTRY_POINTS:
            raise ValueError(f"dtype: the CPU prefill kernel supports {sorted(map(str, ENTRY_POINTS))}, got {dtype}")
        library = library if library is not None else load_library()
        self.dtype, self.fn = dtype, getattr(library, ENTRY_POINTS[dtype])
        self.fn.restype = None
        self.max_head_dim, self.panel = library.paged_prefill_max_head_dim(), library.paged_prefill_panel()

    def supports(self, head_dim: int) -> bool:
        return head_dim % self.panel == 0 and head_dim <= self.max_head_dim

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                 scale: float, tables_checked: bool = False) -> torch.Tensor:
        """tables_checked: check_tables already passed for this step's tables (once per step, not once per
        layer and sequence)."""
        num_queries, num_heads, head_dim = q.shape
        _check(self, q, cache, block_table, seq_len)
        if not tables_checked:
            check_tables(block_table[None], torch.tensor([seq_len]), cache.shape[1], cache.shape[2])
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        shape = Shape(num_queries, seq_len, num_heads, cache.shape[0] // 2, cache.shape[1], cache.shape[2], head_dim)
        self.fn(*map(ptr, (q, cache, block_table, out)), shape, ctypes.c_float(scale), num_threads())
        return out


def _check(kernel: PagedPrefillKernel, q, cache, block_table, seq_len: int):
    if q.dtype != kernel.dtype or cache.dtype != kernel.dtype:
        raise ValueError(f"q and cache must be {kernel.dtype}, got {q.dtype} and {cache.dtype}")
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in (q, cache, block_table)):
        raise ValueError("the CPU prefill kernel needs contiguous CPU tensors")
    if block_table.dtype != torch.long or block_table.dim() != 1:
        raise ValueError("block_table must be one int64 row")
    if cache.shape[0] % 2 or q.shape[1] % (cache.shape[0] // 2) or q.shape[2] != cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of shape {tuple(cache.shape)}")
    if not kernel.supports(q.shape[2]):
        raise ValueError(f"head_dim: the CPU prefill kernel needs a multiple of {kernel.panel} up to "
                         f"{kernel.max_head_dim}, got {q.shape[2]}")
    if not 0 < q.shape[0] <= seq_len:
        raise ValueError(f"seq_len: {seq_len} must cover the {q.shape[0]} queries")
