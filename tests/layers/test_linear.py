import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedmoe.layers import linear
from pagedmoe.layers.linear import PACK_MIN_BYTES, Linear, MergedLinear, can_pack, pack_weights
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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
