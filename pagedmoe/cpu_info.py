"""What this CPU can do, detected once: torch's vector capability and the cpuid flags Linux lists in
/proc/cpuinfo. Dispatch decisions (oneDNN bf16 pre-packing, the dtype a bf16 checkpoint is computed in) ask the
predicates here. PAGEDMOE_CPU_FLAGS="avx2 fma ..." replaces the detected flags, so tests can drive every path
on one machine; it can take pre-packing away, never grant it where torch cannot do it."""
import functools
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FLAGS_ENV = "PAGEDMOE_CPU_FLAGS"
VENDOR_ENV = "PAGEDMOE_CPU_VENDOR"  # replaces /proc/cpuinfo's vendor_id, as FLAGS_ENV the flags
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")
# oneDNN's bf16 support (platform::has_data_type_support), which torch's mkldnn_bf16_device_check and so
# _reorder_linear_weight require: avx512_core, or avx2_vnni_2
ONEDNN_BF16_ISAS = (("avx512f", "avx512bw", "avx512vl", "avx512dq"),
                    ("avx2", "avx_vnni", "avx_vnni_int8", "avx_ne_convert"))
# without /proc/cpuinfo: what torch's capability implies (its AVX512 level needs avx512 f/bw/vl/dq and fma)
CAPABILITY_FLAGS = {"AVX512": ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
                    "AVX2": ("avx", "avx2", "fma")}
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16",
                  "avx_vnni", "avx_ne_convert", "amx_bf16", "amx_fp16")


def is_x86() -> bool:
    return platform.machine().lower() in X86_MACHINES


@functools.cache
def _proc_cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo; {} where there is none (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.strip().split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def detected_cpu_flags() -> frozenset[str]:
    """The x86 flags this CPU has, ignoring PAGEDMOE_CPU_FLAGS: what code built for it may execute."""
    if not is_x86():
        return frozenset()
    if "flags" in _proc_cpuinfo():
        return frozenset(_proc_cpuinfo()["flags"].split())
    return frozenset(CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), ()))


@functools.cache
def _parse_flags(text: str) -> frozenset[str]:
    return frozenset(text.replace(",", " ").lower().split())


def cpu_flags() -> frozenset[str]:
    """The flags dispatch decides on: PAGEDMOE_CPU_FLAGS (space or comma separated) when set."""
    override = os.environ.get(FLAGS_ENV)
    return detected_cpu_flags() if override is None else _parse_flags(override)


def has_native_bf16() -> bool:
    """bf16 arithmetic in hardware; without it torch emulates bf16 matmuls, ~100x slower than float32."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def bf16_is_emulated() -> bool:
    """An x86 CPU without native bf16: torch's bf16 matmuls are emulated there (~100x slower than float32),
    and the CPU kernels widen bf16 to float32 as they load it, at every size."""
    return is_x86() and not has_native_bf16()


@functools.cache
def _torch_can_prepack_bf16() -> bool:
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return torch.backends.mkldnn.is_available() and supported is not None and bool(supported())


def can_prepack_bf16() -> bool:
    """oneDNN has a bf16 path here, so torch.ops.mkldnn._reorder_linear_weight accepts bf16 weights."""
    flags = cpu_flags()
    return any(flags.issuperset(isa) for isa in ONEDNN_BF16_ISAS) and _torch_can_prepack_bf16()


def cpu_vendor() -> str:
    return os.environ.get(VENDOR_ENV) or _proc_cpuinfo().get("vendor_id", "")


def blas_is_tuned() -> bool:
    """torch's CPU BLAS runs tuned kernels here: MKL on Intel, another BLAS off x86. MKL's sgemm on other x86
    vendors ran 25-40% below the tile kernel at 64-2048 rows (2-core AMD EPYC, AVX2; oneDNN's packed GEMM ran
    level with the kernel)."""
    return not is_x86() or cpu_vendor() == "GenuineIntel"


def kernels_take_every_size(dtype: torch.dtype) -> bool:
    """Where the CPU tile kernels beat the GEMMs torch would call at every size, not only at decode sizes:
    float32 where its BLAS is MKL off Intel, bf16 where it is emulated."""
    if dtype == torch.float32:
        return not blas_is_tuned()
    return dtype == torch.bfloat16 and bf16_is_emulated()


def cpu_model_name() -> str:
    return _proc_cpuinfo().get("model name") or platform.processor() or platform.machine() or "unknown CPU"


def describe_cpu() -> str:
    """One line for logs and benchmark output: model name, torch's capability, the ISA extensions that matter."""
    flags = cpu_flags()
    isa = " ".join(flag for flag in REPORTED_FLAGS if flag in flags) or f"no x86 extensions ({platform.machine()})"
    forced = f", from {FLAGS_ENV}" if FLAGS_ENV in os.environ else ""
    return f"{cpu_model_name()} [torch {torch.backends.cpu.get_cpu_capability()}; {isa}{forced}]"


def cpu_compute_dtype(checkpoint_dtype: torch.dtype) -> torch.dtype:
    """What dtype="auto" computes a checkpoint in on CPU: 16-bit ones in float32 where bf16 is not native."""
    return _compute_dtype(checkpoint_dtype, has_native_bf16())


@functools.cache  # one log line per process and case, though the config's dtype is read at every step
def _compute_dtype(checkpoint_dtype: torch.dtype, native_bf16: bool) -> torch.dtype:
    if native_bf16 or checkpoint_dtype not in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    name = str(checkpoint_dtype).removeprefix("torch.")
    logger.warning("%s checkpoint computed in float32: this CPU (%s) has no native bf16 arithmetic; "
                   "pass --dtype %s to force it", name, describe_cpu(), name)
    return torch.float32
