"""The CPU router (layers/moe/csrc/router.cpp) against the PyTorch routers (routers.py) it stands in for:
the same experts in the same order and weights to float rounding, for the softmax routers (renormalised or
not, scaled) and gpt-oss's top-k-then-softmax, float32 and bfloat16, with and without a gate bias; the
routed-token counts; and where it steps aside."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedmoe.layers import cpu_ops
from pagedmoe.layers.moe import cpu_router
from pagedmoe.layers.moe.cpu_router import CpuRouter
from pagedmoe.layers.moe.fused_moe import expert_counts
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig

ROUTERS = [RouterConfig("softmax", 2), RouterConfig("softmax", 4, renormalize=True),
           RouterConfig("softmax", 3, routed_scaling_factor=2.5), RouterConfig("topk_softmax", 4)]


def moe_layer(router: RouterConfig, experts: int, hidden: int, gate_bias: bool, dtype, seed: int) -> FusedMoE:
    torch.manual_seed(seed)
    layer = FusedMoE(experts, hidden, 32, router, gate_bias=gate_bias).to(dtype)
    torch.nn.init.normal_(layer.gate.weight, std=0.5)
    if gate_bias:
        torch.nn.init.normal_(layer.gate.bias)
    return layer


def boundary_ties(layer: FusedMoE, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """Tokens whose k-th and next scores are equal (bf16 logits tie now and then): either expert is right."""
    scores = layer.router_logits(x).float().sort(dim=-1, descending=True).values
    return scores[:, top_k - 1] == scores[:, top_k] if scores.shape[1] > top_k else torch.zeros(len(x), dtype=bool)


def rounding_ties(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """bfloat16: tokens with a logit whose float32 sum lies within summation-order error of a bf16 rounding
    midpoint; the kernel may round it to the other neighbour, a whole bf16 step (hypothesis found one whose
    weights then differed by 2e-3)."""
    if x.dtype != torch.bfloat16:
        return torch.zeros(len(x), dtype=torch.bool)
    logits = torch.nn.functional.linear(x.float(), *layer.float_gate())
    low, high = (logits - 1e-5 * (1 + logits.abs())).bfloat16(), (logits + 1e-5 * (1 + logits.abs())).bfloat16()
    return (low != high).any(dim=-1)


@settings(max_examples=30, deadline=None)
@given(router=st.sampled_from(ROUTERS), experts=st.sampled_from([4, 8, 16, 64]), hidden=st.sampled_from([32, 96, 576]),
       tokens=st.integers(1, cpu_router.MAX_TOKENS), gate_bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 1000))
def test_the_kernel_routes_as_pytorch(router, experts, hidden, tokens, gate_bias, dtype, seed):
    layer = moe_layer(router, experts, hidden, gate_bias, dtype, seed)
    x = torch.randn(tokens, hidden).to(dtype)
    with torch.inference_mode():
        expected_weights, expected_ids = layer.select(x)
        assert layer.use_cpu_router()
        weights, ids = layer.cpu_router(x)
    same = ~boundary_ties(layer, x, router.top_k) & ~rounding_ties(layer, x)
    assert torch.equal(ids[same], expected_ids[same])
    # the gate's sums run in another order: logits of ~10 differ by float32 rounding, weights by ~1e-5
    torch.testing.assert_close(weights[same], expected_weights[same], atol=1e-5, rtol=1e-4)


def test_the_counts_add_to_the_step_load():
    layer = moe_layer(RouterConfig("softmax", 2), 8, 64, False, torch.float32, 0)
    layer.use_cpu_router()
    load = torch.full((8,), 5, dtype=torch.int64)
    x = torch.randn(40, 64)
    with torch.inference_mode():
        _, ids = layer.route(x, load)
    assert torch.equal(load, 5 + expert_counts(ids, 8))


@pytest.mark.parametrize("case", ["prefill-sized", "grouped router", "PyTorch pointwise ops", "int32 load"])
def test_the_kernel_steps_aside(case, monkeypatch):
    """Past MAX_TOKENS, for DeepSeek's grouped routers, with the PyTorch ops asked for, or a load row it cannot
    add to, the layer routes in PyTorch."""
    router = RouterConfig("softmax_group", 2, n_group=2, topk_group=1) if case == "grouped router" else ROUTERS[0]
    layer = moe_layer(router, 8, 64, False, torch.float32, 0)
    assert layer.use_cpu_router() == (case != "grouped router")
    monkeypatch.setattr(cpu_ops, "enabled", case != "PyTorch pointwise ops")
    calls = []
    if layer.cpu_router is not None:
        layer.cpu_router.fns = {dtype: lambda *args: calls.append(args) for dtype in layer.cpu_router.fns}
    x = torch.randn(cpu_router.MAX_TOKENS + 1 if case == "prefill-sized" else 4, 64)
    load = torch.zeros(8, dtype=torch.int32 if case == "int32 load" else torch.int64)
    with torch.inference_mode():
        weights, ids = layer.route(x, load)
        expected = layer.select(x)
    assert calls == [] and torch.equal(ids, expected[1]) and int(load.sum()) == ids.numel()


def test_unsupported_routers_are_refused():
    with pytest.raises(ValueError, match="the CPU router takes"):
        CpuRouter(RouterConfig("sigmoid_group", 2, n_group=2, topk_group=1, has_correction_bias=True), None)
