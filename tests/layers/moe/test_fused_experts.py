import pytest
import torch
import torch.nn.functional as F

from pagedmoe.layers.linear import pack_weight
from pagedmoe.layers.moe.fused_moe import expert_counts, fused_experts, swigluoai_and_mul

NUM_EXPERTS, HIDDEN, INTER = 6, 16, 8


def make_problem(num_tokens=20, top_k=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.3
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) * 0.3
    topk_weights, topk_ids = torch.rand(num_tokens, NUM_EXPERTS, generator=g).topk(top_k)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), topk_weights, topk_ids


def reference(x, w13, w2, topk_weights, topk_ids, act=None, w13_bias=None, w2_bias=None):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            h = F.linear(x[t], w13[e], None if w13_bias is None else w13_bias[e])
            gate, up = h.chunk(2)
            h = F.silu(gate) * up if act is None else act(h)
            out[t] += weight * F.linear(h, w2[e], None if w2_bias is None else w2_bias[e])
    return out


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_matches_per_token_reference(use_grouped_mm):
    x, w13, w2, topk_weights, topk_ids = make_problem()
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, use_grouped_mm=use_grouped_mm)
    torch.testing.assert_close(out, reference(x, w13, w2, topk_weights, topk_ids))


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_swigluoai_with_biases(use_grouped_mm):
    x, w13, w2, topk_weights, topk_ids = make_problem(seed=1)
    w13_bias, w2_bias = torch.randn(NUM_EXPERTS, 2 * INTER), torch.randn(NUM_EXPERTS, HIDDEN)
    out = fused_experts(x * 5, w13, w2, topk_weights, topk_ids, "swigluoai", w13_bias, w2_bias, use_grouped_mm)
    expected = reference(x * 5, w13, w2, topk_weights, topk_ids, swigluoai_and_mul, w13_bias, w2_bias)
    torch.testing.assert_close(out, expected)


def test_swigluoai_clamps():
    gate_up = torch.tensor([[10.0, -1.0, 9.0, -9.0]])
    gate, up = torch.tensor([7.0, -1.0]), torch.tensor([7.0, -7.0])
    expected = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    torch.testing.assert_close(swigluoai_and_mul(gate_up), expected.unsqueeze(0))


def test_unused_experts_and_single_token():
    x, w13, w2, _, _ = make_problem(num_tokens=1)
    topk_ids, topk_weights = torch.tensor([[4, 1]]), torch.tensor([[0.75, 0.25]])
    for use_grouped_mm in (True, False):
        out = fused_experts(x, w13, w2, topk_weights, topk_ids, use_grouped_mm=use_grouped_mm)
        torch.testing.assert_close(out, reference(x, w13, w2, topk_weights, topk_ids))


def test_no_tokens():
    x, w13, w2, topk_weights, topk_ids = make_problem(num_tokens=0)
    assert fused_experts(x, w13, w2, topk_weights, topk_ids).shape == (0, HIDDEN)


def test_bf16_close_to_fp32():
    x, w13, w2, topk_weights, topk_ids = make_problem(dtype=torch.bfloat16)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == torch.bfloat16
    expected = reference(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_expert_counts():
    topk_ids = torch.tensor([[0, 3], [3, 5], [0, 3]])
    assert expert_counts(topk_ids, NUM_EXPERTS).tolist() == [2, 0, 0, 3, 0, 1]


def test_gradients_flow_with_unused_experts():
    x, w13, w2, _, _ = make_problem(num_tokens=3)
    w13.requires_grad_(True)
    topk_ids, topk_weights = torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.full((3, 2), 0.5)
    fused_experts(x, w13, w2, topk_weights, topk_ids).sum().backward()
    assert w13.grad[0].abs().sum() > 0 and w13.grad[2:].abs().sum() == 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_prepacked_experts_match_reference():
    x, w13, w2, topk_weights, topk_ids = make_problem(seed=4)
    packed = ([pack_weight(w) for w in w13], [pack_weight(w) for w in w2])
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, packed=packed)
    torch.testing.assert_close(out, reference(x, w13, w2, topk_weights, topk_ids))
