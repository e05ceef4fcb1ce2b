"""The packed 4-bit CPU kernel against decode-then-matmul: its integer sums exactly as a float64 emulation of the
same int8 activations computes them, and within the int8 rounding bound of the exact product; every ISA path
this CPU runs (AVX-512 VNNI, AVX2, plain C++), each built for its target."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import missing_for
from pagedmoe import cpu_info
from pagedmoe.layers.quantization import fp4_kernel
from pagedmoe.layers.quantization.fp4_kernel import Fp4Kernel, PackedFp4Weight
from pagedmoe.layers.quantization.mxfp4 import quantize_mxfp4
from pagedmoe.layers.quantization.nvfp4 import quantize_nvfp4


def packed_weight(fmt: str, n: int, k: int, seed: int) -> PackedFp4Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    if fmt == "mxfp4":
        blocks, scales = quantize_mxfp4(w)
        return PackedFp4Weight.from_mxfp4(blocks, scales)
    q = quantize_nvfp4(w)
    return PackedFp4Weight.from_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"])


def int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding: per 32, d = amax / 127, q = round-half-even(x * 127 / amax)."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(blocks * (127 / amax)), torch.zeros_like(blocks))
    return q, amax / 127


def emulated(x: torch.Tensor, weight: PackedFp4Weight) -> torch.Tensor:
    q, d = int8_activations(x)
    return ((q * d).flatten(1).double() @ weight.dequantize().double().T).float()


def cases():
    return dict(fmt=st.sampled_from(["mxfp4", "nvfp4"]), m=st.integers(1, 300), n=st.integers(1, 40),
                blocks=st.integers(1, 6), seed=st.integers(0, 10 ** 6))


def check_kernel(kernel: Fp4Kernel, fmt, m, n, blocks, seed):
    weight = packed_weight(fmt, n, 32 * blocks, seed)
    x = torch.randn(m, 32 * blocks, generator=torch.Generator().manual_seed(seed + 1))
    out = kernel.matmul(x, weight)
    scale = (x.abs() @ weight.dequantize().abs().T).clamp(min=1e-6)
    assert bool(((out - emulated(x, weight)).abs() <= 1e-5 * scale).all())
    exact = x @ weight.dequantize().T  # int8 activations: each element off by at most d / 2 = amax / 254
    bound = (x.view(m, -1, 32).abs().amax(-1).repeat_interleave(32, 1) / 254) @ weight.dequantize().abs().T
    assert bool(((out - exact).abs() <= bound * 1.001 + 1e-6).all())


@settings(max_examples=40, deadline=None)
@given(**cases())
def test_native_kernel_matches_the_int8_emulation(fmt, m, n, blocks, seed):
    check_kernel(Fp4Kernel(), fmt, m, n, blocks, seed)


TARGETS = {"x86-64": "scalar", "x86-64-v3": "avx2", "native": None}


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_isa_path_matches_the_emulation(target):
    """x86-64 builds the plain C++ loop, x86-64-v3 the AVX2 one, native what this CPU has best."""
    if not cpu_info.is_x86() and target != "native":
        pytest.skip("x86-64 targets")
    if target == "x86-64-v3" and (reason := missing_for(target)):
        pytest.skip(reason)
    kernel = Fp4Kernel(fp4_kernel.load_library(march=target))
    assert TARGETS[target] in (None, kernel.isa)
    for seed, (fmt, m, n, blocks) in enumerate([("mxfp4", 1, 7, 3), ("nvfp4", 5, 33, 2), ("mxfp4", 300, 9, 1),
                                                ("nvfp4", 64, 16, 6)]):
        check_kernel(kernel, fmt, m, n, blocks, seed)


def test_native_build_uses_vnni_where_the_cpu_has_it():
    flags = cpu_info.detected_cpu_flags()
    expected = "avx512_vnni" if {"avx512_vnni", "avx512vl"} <= flags else "avx2" if "avx2" in flags else "scalar"
    assert Fp4Kernel().isa == expected


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_dequantize_rows_is_the_exact_decode(fmt):
    weight = packed_weight(fmt, 37, 96, seed=3)
    out = Fp4Kernel().dequantize_rows(weight, 5, torch.empty(20, 96))
    assert torch.equal(out, weight.dequantize()[5:25])


def test_bad_shapes_raise_value_errors():
    weight = packed_weight("mxfp4", 4, 64, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        Fp4Kernel().matmul(torch.randn(2, 32), weight)
