import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedmoe import cpu_info
from pagedmoe.layers import cpu_linear, linear
from pagedmoe.layers.linear import PACK_MIN_BYTES, Linear, MergedLinear, attach_cpu_kernels, can_pack, pack_weights
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
AVX2_ONLY = "avx avx2 fma f16c bmi1 bmi2 abm movbe"  # an AMD EPYC before Zen 4: no oneDNN bf16 path
ONEDNN_BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu_info.can_prepack_bf16(), reason="oneDNN bf16 pre-packing needs avx512bw, avx512vl and avx512dq "
                                            "(or avx_ne_convert with avx_vnni_int8)"))


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, ONEDNN_BF16])
@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_linear_matches_unpacked(dtype, num_rows):
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True).to(dtype)
    x = torch.randn(num_rows, 96).to(dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.pack()
    assert layer.packed_weight is not None
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(layer(x), expected, **tol)
    torch.testing.assert_close(layer(x.view(num_rows, 1, 96)), expected.view(num_rows, 1, 80), **tol)


def test_pack_skips_what_cannot_be_packed():
    assert not can_pack(torch.zeros(4, 4, dtype=torch.float16))
    assert not can_pack(torch.zeros(4, 4, 4))
    layer = Linear(8, 8).half()
    layer.pack()
    assert layer.packed_weight is None
    assert layer(torch.randn(2, 8).half()).shape == (2, 8)


@needs_onednn
def test_pack_weights_reaches_every_packable_layer(monkeypatch):
    monkeypatch.setattr(linear, "PACK_MIN_BYTES", 0)
    router = RouterConfig(top_k=2)
    model = nn.ModuleDict({"proj": MergedLinear(16, {"a": 8, "b": 8}), "plain": nn.Linear(16, 16),
                           "moe": FusedMoE(4, 16, 8, router)})
    pack_weights(model)
    assert model["proj"].packed_weight is not None
    assert model["moe"].packed_experts is not None and len(model["moe"].packed_experts[0]) == 4
    assert not hasattr(model["plain"], "packed_weight")


@needs_onednn
def test_pack_weights_leaves_small_weights_to_mkl():
    model = nn.ModuleDict({"small": Linear(64, 64), "large": Linear(1024, PACK_MIN_BYTES // 4096)})
    pack_weights(model)
    assert model["small"].packed_weight is None and model["large"].packed_weight is not None


@needs_onednn
def test_bf16_is_left_unpacked_where_onednn_has_no_bf16_path(monkeypatch):
    """What an AVX2-only CPU runs (there _reorder_linear_weight refuses bf16): float32 still packs, bf16
    linears and experts stay on F.linear and match it exactly."""
    monkeypatch.setenv(cpu_info.FLAGS_ENV, AVX2_ONLY)
    assert not cpu_info.can_prepack_bf16() and can_pack(torch.zeros(4, 4))
    torch.manual_seed(0)
    layer, moe = Linear(96, 80, bias=True), FusedMoE(4, 16, 8, RouterConfig(top_k=2))
    nn.init.normal_(moe.w13, std=0.3), nn.init.normal_(moe.w2, std=0.3)
    layer, moe = layer.bfloat16(), moe.bfloat16()
    x, tokens = torch.randn(7, 96).bfloat16(), torch.randn(5, 16).bfloat16()
    unpacked = layer(x), moe(tokens)
    layer.pack()
    moe.pack()
    assert layer.packed_weight is None and moe.packed_experts is None
    assert torch.equal(layer(x), unpacked[0]) and torch.equal(moe(tokens), unpacked[1])


def test_forced_flags_never_grant_bf16_packing(monkeypatch):
    monkeypatch.setenv(cpu_info.FLAGS_ENV, "avx2 avx512f avx512bw avx512vl avx512dq amx_bf16")
    monkeypatch.setattr(cpu_info, "_torch_can_prepack_bf16", lambda: False)
    assert not can_pack(torch.zeros(4, 4, dtype=torch.bfloat16))


def test_small_bf16_weights_take_the_tile_kernel_and_small_float32_ones_do_not():
    """PACK_MIN_BYTES keeps small float32 weights on MKL; a bf16 weight of any size takes the tile kernel where
    the kernel runs bf16 at all (oneDNN's bf16 F.linear reorders the weight on every call), and its output is
    F.linear's up to bf16 rounding of the float32 sums."""
    torch.manual_seed(0)
    small32, small16 = Linear(64, 64, bias=True), Linear(64, 64, bias=True).bfloat16()
    attach_cpu_kernels(nn.ModuleDict({"a": small32, "b": small16}), {"linear"})
    assert small32.cpu_kernel is None
    assert (small16.cpu_kernel is not None) == (cpu_linear.CpuLinear(small16.weight).max_rows > 0)
    x = torch.randn(3, 64).bfloat16()
    expected = F.linear(x.float(), small16.weight.float(), small16.bias.float())
    torch.testing.assert_close(small16(x).float(), expected, atol=2e-2, rtol=1e-2)
