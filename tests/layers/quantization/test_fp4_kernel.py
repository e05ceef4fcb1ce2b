"""The packed 4-bit CPU kernel against decode-then-matmul: its integer sums exactly as a float64 emulation of the
same int8 activations computes them, and within the int8 rounding bound of the exact product; every ISA path
this CPU runs (AVX-512 VNNI, AVX2, plain C++), each built for its target."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import missing_for
from pagedmoe import cpu_info
from pagedmoe.layers.quantization import fp4_kernel, fp4_linear
from pagedmoe.layers.activation import ACTIVATIONS
from pagedmoe.layers.moe.fused_moe import looped_experts
from pagedmoe.layers.quantization.fp4_kernel import Fp4Kernel, Fp4MoE, PackedFp4Weight, stacked, unstacked
from pagedmoe.layers.quantization.mxfp4 import quantize_mxfp4
from pagedmoe.layers.quantization.nvfp4 import quantize_nvfp4


def packed_weight(fmt: str, n: int, k: int, seed: int) -> PackedFp4Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    if fmt == "mxfp4":
        blocks, scales = quantize_mxfp4(w)
        return PackedFp4Weight.from_mxfp4(blocks, scales)
    q = quantize_nvfp4(w)
    return PackedFp4Weight.from_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"])


def int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding: per 32, d = amax / 127, q = round-half-even(x * 127 / amax); and where
    x * 127 / amax lies within a float32 ulp of a rounding tie (the kernel, built with -ffast-math, may round
    those the other way)."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scaled = torch.where(amax > 0, blocks * (127 / amax), torch.zeros_like(blocks))
    near_tie = ((scaled - scaled.floor()) - 0.5).abs() < 1e-5
    return torch.round(scaled), amax / 127, near_tie


def emulated(x: torch.Tensor, weight: PackedFp4Weight) -> torch.Tensor:
    q, d, _ = int8_activations(x)
    return ((q * d).flatten(1).double() @ weight.dequantize().double().T).float()


def tie_bound(x: torch.Tensor, weight: PackedFp4Weight) -> torch.Tensor:
    """What rounding the near-tie elements the other way can move each output: one step d of each."""
    _, d, near_tie = int8_activations(x)
    return (near_tie * d).flatten(1) @ weight.dequantize().abs().T


def cases():
    return dict(fmt=st.sampled_from(["mxfp4", "nvfp4"]), m=st.integers(1, 300), n=st.integers(1, 40),
                blocks=st.integers(1, 6), seed=st.integers(0, 10 ** 6))


def check_kernel(kernel: Fp4Kernel, fmt, m, n, blocks, seed):
    weight = packed_weight(fmt, n, 32 * blocks, seed)
    x = torch.randn(m, 32 * blocks, generator=torch.Generator().manual_seed(seed + 1))
    out = kernel.matmul(x, weight)
    scale = (x.abs() @ weight.dequantize().abs().T).clamp(min=1e-6)
    assert bool(((out - emulated(x, weight)).abs() <= 1e-5 * scale + tie_bound(x, weight) * 1.0001).all())
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


def kernel_linear(kernel: Fp4Kernel):
    """The int8 kernel one matmul at a time (its sums are checked against the emulation above)."""
    def linear(x, weight: PackedFp4Weight, bias=None):
        out = kernel.matmul(x, weight)
        return out if bias is None else out + bias
    return linear


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("fmt, activation, biases", [("mxfp4", "swigluoai", True), ("nvfp4", "silu", False)])
def test_fused_moe_kernel_matches_the_emulated_expert_loop(target, fmt, activation, biases):
    """Every expert's two matmuls, the activation and the biases in one call, against the expert loop over the
    same int8 kernel one matmul at a time (it quantises the intermediate rows as the fused call does); experts
    left idle, tokens 1-40."""
    if target != "native" and (not cpu_info.is_x86() or (target == "x86-64-v3" and missing_for(target))):
        pytest.skip("x86-64 targets")
    num_experts, hidden, inter = 5, 64, 96
    g = torch.Generator().manual_seed(0)
    w13 = stacked([packed_weight(fmt, 2 * inter, hidden, seed=e) for e in range(num_experts)])
    w2 = stacked([packed_weight(fmt, hidden, inter, seed=10 + e) for e in range(num_experts)])
    b13, b2 = (torch.randn(num_experts, 2 * inter, generator=g), torch.randn(num_experts, hidden, generator=g)) \
        if biases else (None, None)
    library = fp4_kernel.load_library(march=target)
    moe = Fp4MoE(w13, w2, activation, b13, b2, library)
    for num_tokens in (1, 7, 40):
        x = torch.randn(num_tokens, hidden, generator=g) * 3
        topk_weights = torch.rand(num_tokens, 2, generator=g)
        topk_ids = torch.randint(0, 4, (num_tokens, 2), generator=g)
        expected = looped_experts(x, unstacked(w13), unstacked(w2), topk_weights, topk_ids, ACTIVATIONS[activation],
                                  b13, b2, kernel_linear(Fp4Kernel(library)))
        torch.testing.assert_close(moe(x, topk_weights, topk_ids), expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("flags, panel_dtype", [(None, None), ("avx avx2 fma", torch.float32)])
def test_panels_past_the_kernel_rows_decode_exactly(monkeypatch, flags, panel_dtype):
    """Past MAX_DOT_ROWS the weight is decoded exactly, in bf16 panels for bf16 inputs where bf16 is native
    (float32 where it is emulated): the product is the float one on those panels."""
    if flags:
        monkeypatch.setenv("PAGEDMOE_CPU_FLAGS", flags)
    weight = packed_weight("mxfp4", 300, 64, seed=1)  # MXFP4 values are exact in bf16
    x = torch.randn(40, 64).bfloat16()
    panel_dtype = panel_dtype or (torch.float32 if cpu_info.bf16_is_emulated() else torch.bfloat16)
    out = fp4_linear.fp4_linear(x, weight)
    expected = (x.to(panel_dtype) @ weight.dequantize().to(panel_dtype).T).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    exact = fp4_linear.fp4_linear(x.float(), weight)
    torch.testing.assert_close(exact, x.float() @ weight.dequantize().T, atol=1e-5, rtol=1e-5)
