import math

import pytest
import torch

from pagedmoe.layers.moe.routers import (RouterConfig, select_experts, sigmoid_group_topk, softmax_group_topk,
                                         softmax_topk, topk_softmax)


def logits_for_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def logits_for_sigmoid(scores: list[float]) -> torch.Tensor:
    s = torch.tensor([scores], dtype=torch.float64)
    return (s / (1 - s)).log().float()


def assert_routed(result, weights, ids):
    topk_weights, topk_ids = result
    assert topk_weights.dtype == torch.float32 and topk_ids.dtype == torch.int64
    assert topk_ids.tolist() == [ids]
    torch.testing.assert_close(topk_weights, torch.tensor([weights]))


def test_softmax_without_renormalize():
    assert_routed(softmax_topk(logits_for_probs([0.1, 0.2, 0.3, 0.4]), 2, False), [0.4, 0.3], [3, 2])


def test_softmax_with_renormalize():
    assert_routed(softmax_topk(logits_for_probs([0.1, 0.2, 0.3, 0.4]), 2, True), [4 / 7, 3 / 7], [3, 2])


def test_softmax_routed_scaling_factor():
    assert_routed(softmax_topk(logits_for_probs([0.1, 0.2, 0.3, 0.4]), 2, False, 1.5), [0.6, 0.45], [3, 2])


def test_softmax_of_bf16_logits_is_fp32():
    topk_weights, _ = softmax_topk(torch.randn(5, 8, dtype=torch.bfloat16), 2, True)
    assert topk_weights.dtype == torch.float32


@pytest.mark.parametrize("logits", [[[0.0] * 8], [[1.0, 3.0, 3.0, 3.0, 0.0, 3.0]]])
def test_ties_follow_torch_topk(logits):
    logits = torch.tensor(logits)
    topk_weights, topk_ids = softmax_topk(logits, 3, True)
    assert torch.equal(topk_ids, torch.topk(torch.softmax(logits, -1), 3).indices)
    assert torch.equal(topk_softmax(logits, 2)[1], torch.topk(logits, 2).indices)
    torch.testing.assert_close(topk_weights, torch.full((1, 3), 1 / 3))


def test_correction_bias_changes_choice_not_weights():
    logits = logits_for_sigmoid([0.9, 0.8, 0.7, 0.6])
    assert_routed(sigmoid_group_topk(logits, 2, 1, 1, None, False), [0.9, 0.8], [0, 1])
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0])
    assert_routed(sigmoid_group_topk(logits, 2, 1, 1, bias, False), [0.7, 0.9], [2, 0])


def test_sigmoid_group_limit_excludes_best_expert():
    logits = logits_for_sigmoid([0.95, 0.1, 0.62, 0.58, 0.7, 0.55, 0.2, 0.1])
    assert_routed(sigmoid_group_topk(logits, 2, 4, 2, None, True, 2.0), [1.4 / 1.32, 1.24 / 1.32], [4, 2])
    assert_routed(sigmoid_group_topk(logits, 2, 4, 4, None, False), [0.95, 0.7], [0, 4])


def test_softmax_group_limit_uses_group_max():
    logits = logits_for_probs([0.30, 0.01, 0.2, 0.19, 0.25, 0.02, 0.02, 0.01])
    assert_routed(softmax_group_topk(logits, 2, 4, 1), [0.30, 0.01], [0, 1])
    assert_routed(softmax_group_topk(logits, 2, 4, 2, 2.0), [0.60, 0.50], [0, 4])


def test_topk_softmax_over_raw_logits():
    e = math.e
    assert_routed(topk_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), 2), [e / (1 + e), 1 / (1 + e)], [1, 2])


def test_select_experts_dispatches_on_kind():
    logits = logits_for_probs([0.1, 0.2, 0.3, 0.4])
    assert_routed(select_experts(RouterConfig("softmax", 2, renormalize=True), logits), [4 / 7, 3 / 7], [3, 2])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    config = RouterConfig("sigmoid_group", 1, has_correction_bias=True)
    assert select_experts(config, logits_for_sigmoid([0.9, 0.8, 0.7, 0.6]), bias)[1].tolist() == [[3]]


def test_unknown_router_kind_raises():
    with pytest.raises(ValueError, match="unknown router kind"):
        RouterConfig("nope")
