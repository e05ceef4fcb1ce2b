"""Builds the project's C++ CPU kernels (pagedmoe/layers/*/csrc/*.cpp) with the system C++ compiler on first
use (about a second each) into a cache keyed by source, flags and CPU, and loads them with ctypes, which
releases the GIL for each call. The code is plain C++ that the compiler vectorizes for the target
(-march=native: AVX2, AVX-512, ...). Where a kernel cannot be built or loaded (no compiler, no OpenMP, an
unwritable cache), RuntimeError: its caller then uses the PyTorch path."""
import ctypes
import hashlib
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedmoe.cpu_info import detected_cpu_flags

COMPILE_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC"]
# -ffast-math at compile time only: at link time GCC < 13 adds crtfastmath.o, which turns on flush-to-zero and
# denormals-are-zero for the whole process when the library loads
LINK_FLAGS = ["-shared", "-fopenmp"]
LOCAL_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)
HEADERS = Path(__file__).with_name("csrc")  # shared by the kernels: part of every build's cache key


def ptr(tensor) -> ctypes.c_void_p:
    """A tensor's data as a kernel argument (None for an absent optional tensor)."""
    return ctypes.c_void_p(None if tensor is None else tensor.data_ptr())


def num_threads() -> ctypes.c_int:
    """The threads a kernel call may use: torch's intra-op count, which the thread governor keeps."""
    return ctypes.c_int(torch.get_num_threads())


def kernel_cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagedmoe"
    return Path(os.environ.get("PAGEDMOE_CACHE_DIR", default)) / "kernels"


def cpu_identity() -> bytes:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    return "\n".join(sorted({line for line in lines if line.startswith(("flags", "model name"))})).encode()


def compile_flags(march: str) -> list[str]:
    return [*COMPILE_FLAGS, f"-march={march}", *vector_width_flags(march)]


def vector_width_flags(march: str) -> list[str]:
    """256-bit auto-vectorisation on a native AVX2 target without AVX-512. GCC tunes some of those (Zen 1:
    znver1) to vectorise in 128-bit halves, so every `omp simd` exp was a 4-wide libmvec call; AVX-512
    targets keep their default width."""
    flags = detected_cpu_flags()
    return ["-mprefer-vector-width=256"] if march == "native" and "avx2" in flags and "avx512f" not in flags else []


def load_library(source: Path, compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    """Builds source (once per source, flags and CPU) and loads it; RuntimeError if it cannot.
    march: the compiler's target, e.g. x86-64-v3 (AVX2) to check another machine's build here."""
    flags = [*compile_flags(march), *LINK_FLAGS]
    headers = b"".join(h.read_bytes() for h in sorted(HEADERS.glob("*.h")))
    key = hashlib.sha256(source_closure(source) + headers + " ".join(flags).encode() + cpu_identity()).hexdigest()
    path = kernel_cache_dir() / f"{source.stem}-{key[:16]}.so"
    try:
        if not path.exists():
            _build(source, compiler, march, path)
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise RuntimeError(f"cannot build or load the CPU kernel {source.name}: {error}") from error


def source_closure(source: Path, seen: set[Path] | None = None) -> bytes:
    """The source and every local file it includes (a kernel may include another's .cpp), recursively."""
    seen = set() if seen is None else seen
    seen.add(source.resolve())
    text = source.read_bytes()
    included = (source.parent / name.decode() for name in LOCAL_INCLUDE.findall(text))
    return text + b"".join(source_closure(path, seen) for path in included if path.resolve() not in seen)


def _build(source: Path, compiler: str, march: str, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj, library = Path(tmp, f"{source.stem}.o"), Path(tmp, f"{source.stem}.so")
        _run([compiler, *compile_flags(march), "-c", str(source), "-o", str(obj)], source)
        _run([compiler, *LINK_FLAGS, str(obj), "-o", str(library)], source)
        os.replace(library, path)


def _run(command: list[str], source: Path):
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise RuntimeError(f"cannot build the CPU kernel {source.name}: {error}") from error
    if result.returncode != 0:
        raise RuntimeError(f"cannot build the CPU kernel {source.name}:\n{result.stderr}")
