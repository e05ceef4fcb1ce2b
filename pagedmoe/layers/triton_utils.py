"""Triton kernels that run on either device: compiled for CUDA tensors, run by Triton's interpreter for CPU
tensors (slowly, but with the same code, so CPU tests prove the kernels the GPU runs).

The interpreter is picked per launch from the tensors' device (InterpretedFunction), not by TRITON_INTERPRET:
triton.jit reads that variable when a kernel is decorated, so it would depend on import order (xgrammar
imports triton long before any kernel module), and it would also turn the CUDA kernels into interpreted ones.
Triton's own device functions (tl.sum, tl.max, tl.cdiv, ...) are compiled-only JITFunctions unless
TRITON_INTERPRET was set when triton was imported; an interpreted launch runs them interpreted for its duration.
Setting TRITON_INTERPRET=1 before anything imports triton also works: then every kernel is interpreted.
Only the "triton" backends import this module (worker/backends.py checks that triton is installed)."""
import contextlib
import functools
import threading

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


class Kernel:
    """A kernel written once: `kernel.on(device)[grid](...)` launches the compiled or interpreted version."""

    def __init__(self, fn):
        self.fn = fn

    @functools.cached_property
    def compiled(self):
        return triton.jit(self.fn)

    @functools.cached_property
    def interpreted(self):
        return InterpretedFunction(self.fn)

    def on(self, device: torch.device):
        return self.compiled if device.type == "cuda" else Interpreted(self.interpreted)


class Interpreted:
    """`[grid](...)` launches through Triton's interpreter, its library device functions interpreted too."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with device_functions_interpreted():
                return self.fn[grid](*args, **kwargs)
        return launch


INTERPRET_LOCK = threading.Lock()


@contextlib.contextmanager
def device_functions_interpreted():
    """JITFunction calls inside the launch run as interpreted device functions (as they would had
    TRITON_INTERPRET been set at triton's import)."""
    with INTERPRET_LOCK:
        compiled_call = JITFunction.__call__
        JITFunction.__call__ = _interpreted_call
        try:
            yield
        finally:
            JITFunction.__call__ = compiled_call


@functools.cache
def _interpreted(fn) -> "InterpretedFunction":
    return InterpretedFunction(fn)


def _interpreted_call(jit_function, *args, **kwargs):
    return _interpreted(jit_function.fn)(*args, **kwargs)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 dots in IEEE float32 (Triton's default on GPUs is TF32, which would break float32 exactness)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
