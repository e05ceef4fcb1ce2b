"""The CPU tile-GEMM linear (layers/csrc/linear.cpp) against F.linear in float64, built for each x86-64 level
this CPU runs (AVX2, AVX-512) and natively (with avx512_bf16's pair dot products where the CPU has them)."""
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import x86_targets
from pagedmoe import cpu_info
from pagedmoe.layers import cpu_linear
from pagedmoe.layers.cpu_linear import CpuLinear
from pagedmoe.layers.linear import GateUpLinear, Linear, attach_cpu_kernels
from pagedmoe.memory import HUGE_PAGE

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", x86_targets())
def test_matches_f_linear(target, dtype):
    """Row counts cover one row, partial and full row blocks (6 on AVX2, 12 on AVX-512) and several."""
    library = cpu_linear.load_library(march=target)
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 80, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    kernel = CpuLinear(weight, library, max_rows=64)
    for rows in (1, 2, 3, 5, 12, 25, 64):
        x = torch.randn(rows, 80, generator=g).to(dtype)
        for b in (None, bias):
            out = kernel(x, b)
            assert out.dtype == dtype and out.shape == (rows, 96)
            expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
            torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype], check_dtype=False)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("target", x86_targets())
def test_a_row_does_not_depend_on_its_batch(target, gated):
    """Every column sums its k-steps in order whatever tile a row lands in (a full block, a remainder, or 1-3 rows
    over several panels at once), so a row's float32 output is bit-identical alone and in any batch."""
    library = cpu_linear.load_library(march=target)
    g = torch.Generator().manual_seed(2)
    kernel = CpuLinear(torch.randn(128, 80, generator=g), library, max_rows=64, gated=gated)  # whole panels of 16 and 32
    x = torch.randn(40, 80, generator=g)
    batched = kernel(x)
    for rows in (1, 2, 3, 7, 13):
        assert torch.equal(kernel(x[:rows]), batched[:rows])


@pytest.mark.skipif(not (cpu_linear.load_library().linear_amx() and "amx_bf16" in cpu_info.cpu_flags()),
                    reason="no AMX bf16 tiles on this CPU")
def test_amx_tiles_match_f_linear():
    """Row blocks of up to 32 (two A tiles) on the tile unit, full and partial, one to eight of them, and
    prefill-sized inputs across 256-row chunks (every row count runs here); K in 32-wide steps."""
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 96, generator=g).bfloat16()
    bias = torch.randn(64, generator=g).bfloat16()
    kernel = CpuLinear(weight)
    assert kernel.on_amx and kernel.max_rows == cpu_linear.MAX_ROWS_AMX
    for rows in (1, 9, 16, 17, 31, 32, 40, 64, 100, 256, 257, 300, 700):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        expected = F.linear(x.double(), weight.double(), bias.double())
        torch.testing.assert_close(kernel(x, bias).double(), expected, **TOLERANCE[torch.bfloat16])


def test_amx_follows_the_reported_cpu(monkeypatch):
    """PAGEDMOE_CPU_FLAGS without amx_bf16 (another machine's ISA) keeps bf16 linears off the tiles."""
    monkeypatch.setenv("PAGEDMOE_CPU_FLAGS", "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16")
    assert not CpuLinear(torch.randn(64, 64).bfloat16()).on_amx


def test_keeps_leading_dimensions_and_rejects_what_it_cannot_run():
    weight = torch.randn(64, 32)
    out = CpuLinear(weight)(torch.randn(2, 3, 32))
    assert out.shape == (2, 3, 64)
    with pytest.raises(ValueError, match="out_features"):
        CpuLinear(torch.randn(63, 32))
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        CpuLinear(weight.half())
    with pytest.raises(ValueError, match="x must be"):
        CpuLinear(weight)(torch.randn(2, 31))


def test_the_layer_uses_the_kernel_for_small_inputs_and_mkl_for_large(monkeypatch):
    """On Intel, where MKL's GEMMs are tuned."""
    monkeypatch.setenv("PAGEDMOE_CPU_VENDOR", "GenuineIntel")
    torch.manual_seed(0)
    layer = Linear(64, 128, bias=True)
    small, large = torch.randn(4, 64), torch.randn(cpu_linear.MAX_ROWS[torch.float32] + 1, 64)
    with torch.inference_mode():
        expected = [layer(x) for x in (small, large)]
        assert attach_cpu_kernels(layer, {"linear"}, min_bytes=0) == 1
        calls = []
        fn = layer.cpu_kernel.fn
        layer.cpu_kernel.fn = lambda *args: calls.append(args) or fn(*args)
        for x, ref in zip((small, large), expected):
            torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == 1


def test_bfloat16_takes_the_kernel_on_amx_or_without_native_bf16_and_small_weights_keep_onednn():
    """bf16 linears run on AMX tiles where the CPU has them, widened on the vector tiles where bf16 is not
    native, on avx512_bf16's pair dot products up to decode sizes, else stay on oneDNN (its native bf16
    kernels); float32 weights under min_bytes stay too."""
    library = cpu_linear.load_library()
    on_amx = bool(library.linear_amx()) and "amx_bf16" in cpu_info.cpu_flags()
    pairs = bool(library.linear_bf16_pairs()) and cpu_info.has_native_bf16()
    layer = Linear(64, 128).bfloat16()
    layer.pack()
    assert attach_cpu_kernels(layer, {"linear"}, min_bytes=0) == int(on_amx or pairs or not cpu_info.has_native_bf16())
    if pairs and not on_amx:  # decode sizes on the kernel, the rest on oneDNN's packed copy
        rows = cpu_linear.MAX_ROWS_BF16_PAIRS
        assert layer.cpu_kernel.max_rows == rows and layer.packed_weight is not None
        assert layer.cpu_kernel.fits(torch.zeros(rows, 64).bfloat16())
        assert not layer.cpu_kernel.fits(torch.zeros(rows + 1, 64).bfloat16())
        x = torch.randn(rows + 1, 64).bfloat16()
        with torch.inference_mode():
            expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            torch.testing.assert_close(layer(x).double(), expected, **TOLERANCE[torch.bfloat16])
    assert attach_cpu_kernels(Linear(64, 128), {"linear"}, min_bytes=1 << 20) == 0
    assert attach_cpu_kernels(Linear(64, 128), {"moe"}, min_bytes=0) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target", x86_targets())
def test_gated_form_matches_silu_and_mul(target, dtype):
    """GateUpLinear's kernel: silu(x gate^T) * (x up^T) on the float32 tile, [rows, 2I] never written."""
    library = cpu_linear.load_library(march=target)
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(2 * 48, 64, generator=g) * 0.3).to(dtype)
    kernel = CpuLinear(gate_up, library, max_rows=64, gated=True)
    for rows in (1, 7, 30):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        h = F.linear(x.double(), gate_up.double())
        expected = F.silu(h[:, :48]) * h[:, 48:]
        torch.testing.assert_close(kernel(x).double(), expected, **TOLERANCE[dtype], check_dtype=False)


def test_gate_up_layer_with_and_without_the_kernel():
    torch.manual_seed(0)
    layer = GateUpLinear(64, 48)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        expected = F.silu(F.linear(x, layer.weight[:48])) * F.linear(x, layer.weight[48:])
        torch.testing.assert_close(layer(x), expected)
        assert attach_cpu_kernels(layer, {"linear"}, min_bytes=0) == 1 and layer.cpu_kernel.gated
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vendor, flags, dtype, every_size", [
    ("GenuineIntel", "avx2 fma", torch.float32, False),
    ("AuthenticAMD", "avx2 fma", torch.float32, True),  # MKL's sgemm is not tuned off Intel
    ("AuthenticAMD", "avx2 fma", torch.bfloat16, True),  # widened bf16 against oneDNN's emulation
    ("GenuineIntel", "avx2 fma", torch.bfloat16, True),
    ("AuthenticAMD", "avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16", torch.bfloat16, False),
    ("AuthenticAMD", "avx2 fma avx512f avx512bw avx512vl avx512dq", torch.float32, False)])  # oneDNN above
def test_row_limit_follows_the_cpu(monkeypatch, vendor, flags, dtype, every_size):
    """Which inputs the kernel takes, for the vendor and flags PAGEDMOE_CPU_VENDOR / _FLAGS report; a layer
    that takes every size runs a prefill-sized input through the kernel and matches F.linear."""
    if not cpu_info.is_x86():
        pytest.skip("x86 dispatch")
    monkeypatch.setenv("PAGEDMOE_CPU_VENDOR", vendor)
    monkeypatch.setenv("PAGEDMOE_CPU_FLAGS", flags)
    layer = Linear(64, 96).to(dtype)
    x = torch.randn(300, 64).to(dtype)
    with torch.inference_mode():
        expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        attached = attach_cpu_kernels(layer, {"linear"}, min_bytes=0) == 1
        assert (attached and layer.cpu_kernel.fits(x)) == every_size
        torch.testing.assert_close(layer(x).double(), expected, **TOLERANCE[dtype])


def test_float32_off_intel_with_avx512_runs_large_inputs_on_onednns_packed_copy(monkeypatch):
    """AVX-512 off Intel: the kernel up to MAX_ROWS rows, oneDNN's packed copy (kept) above, where it was faster."""
    if not cpu_info.is_x86():
        pytest.skip("x86 dispatch")
    monkeypatch.setenv("PAGEDMOE_CPU_VENDOR", "AuthenticAMD")
    monkeypatch.setenv("PAGEDMOE_CPU_FLAGS", "avx2 fma avx512f avx512bw avx512vl avx512dq")
    layer = Linear(64, 96)
    layer.pack()
    assert attach_cpu_kernels(layer, {"linear"}, min_bytes=0) == 1 and layer.packed_weight is not None
    assert layer.cpu_kernel.max_rows == cpu_linear.MAX_ROWS[torch.float32]
    x = torch.randn(300, 64)
    with torch.inference_mode():
        expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        torch.testing.assert_close(layer(x).double(), expected, **TOLERANCE[torch.float32])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages: Linux anonymous mappings")
@pytest.mark.parametrize("gated", [False, True])
def test_packed_weights_start_on_a_huge_page(gated):
    """Every decode step streams them from memory: on 4 KB pages each 4 KB of the stream was a TLB miss."""
    kernel = CpuLinear(torch.randn(1024, 768), gated=gated)  # 3 MiB
    assert kernel.weight.data_ptr() % HUGE_PAGE == 0
