"""Fused CPU pointwise ops (csrc/pointwise.cpp) for inference: RMSNorm, neox rotary in place and greedy
argmax, each one pass over memory where eager PyTorch issues 5-12 ops. Every function returns None where
the kernel does not apply (no kernel library, another device or dtype, autograd, odd layouts): the caller
then runs its PyTorch code, which stays the reference the kernels are tested against."""
import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from pagedmoe.layers import cpu_build
from pagedmoe.layers.cpu_build import num_threads, ptr

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "pointwise.cpp"
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
enabled = True  # False: always the PyTorch code (tests compare the two)


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL | None:
    try:
        return cpu_build.load_library(SOURCE, compiler, march)
    except RuntimeError as error:
        logger.warning("pointwise ops fall back to PyTorch: %s", error)
        return None


def _library_for(*tensors: Tensor) -> ctypes.CDLL | None:
    if not enabled or torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if any(t.device.type != "cpu" or t.dtype not in SUFFIXES for t in tensors):
        return None
    return load_library()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    library = _library_for(x, weight)
    if library is None or weight.dtype != x.dtype:
        return None
    dim = x.shape[-1]
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == dim:  # q or k heads viewed in qkv: read in place
        tokens, heads, token_stride = x.shape[0], x.shape[1], x.stride(0)
    else:
        x = x.contiguous()
        tokens, heads, token_stride = x.numel() // dim, 1, dim
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # torch.empty(shape) is 1 us slower
    fn = _typed(library, f"rms_norm_{SUFFIXES[x.dtype]}", NORM_ARGS)
    fn(x.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(), tokens, heads, token_stride, dim, eps,
       torch.get_num_threads())
    return out


NORM_ARGS = (*[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 4, ctypes.c_float, ctypes.c_int)


def _typed(library: ctypes.CDLL, name: str, argtypes: tuple) -> ctypes._CFuncPtr:
    """library.name with its argument types declared, so that plain ints and floats convert in C: wrapping
    each argument in a ctypes object took ~2 us of a ~5 us call at decode sizes."""
    fn = getattr(library, name)
    if fn.argtypes is None:
        fn.argtypes = argtypes
    return fn


def can_rotate(x: Tensor, positions: Tensor, cos: Tensor) -> bool:
    """Whether rotary_ runs x in place: [tokens, heads, head_dim] with contiguous heads (a view into qkv is
    fine), int64 positions, a float32 table."""
    if _library_for(x) is None or not _heads_contiguous(x):
        return False
    return positions.dtype == torch.int64 and positions.is_contiguous() and cos.dtype == torch.float32


def rotary_(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox rotary of x in place (can_rotate(x) must hold); cos and sin: [max_positions, head_dim] float32
    tables that cover every position."""
    fn = getattr(load_library(), f"rotary_{SUFFIXES[x.dtype]}")
    sizes = (x.shape[0], x.shape[1], x.stride(0), x.shape[2])
    fn(ptr(x), ptr(positions), ptr(cos), ptr(sin), *(ctypes.c_int64(n) for n in sizes), num_threads())
    return x


def _heads_contiguous(x: Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv(cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> bool:
    """k and v ([tokens, kv_heads, head_dim], views into qkv are fine) into their slots of one layer's cache
    ([2 * kv_heads, num_blocks, block_size, head_dim]); False, having written nothing, where it does not apply.
    The slots must lie in the cache (the scheduler's slot mapping does)."""
    library = _library_for(cache, k, v)
    if library is None or not (k.dtype == v.dtype == cache.dtype) or not cache.is_contiguous():
        return False
    if not (_heads_contiguous(k) and _heads_contiguous(v)) or k.shape != v.shape or slots.dtype != torch.int64:
        return False
    if cache.shape[0] != 2 * k.shape[1] or cache.shape[-1] != k.shape[2] or not slots.is_contiguous():
        return False
    fn = getattr(library, f"write_kv_{SUFFIXES[k.dtype]}")
    sizes = (k.stride(0), v.stride(0))
    fn(ptr(k), ptr(v), *map(ctypes.c_int64, sizes), ptr(slots), ptr(cache),
       *map(ctypes.c_int64, (k.shape[0], k.shape[1], k.shape[2], cache.shape[1] * cache.shape[2])))
    return True


def greedy_argmax(logits: Tensor) -> Tensor | None:
    library = _library_for(logits)
    if library is None or logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous() \
            or logits.shape[1] == 0:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.greedy_argmax_f32(ptr(logits), ptr(out), ctypes.c_int64(logits.shape[0]),
                              ctypes.c_int64(logits.shape[1]), num_threads())
    return out
