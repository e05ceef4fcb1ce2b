"""The Triton fused MoE (interpreted on CPU tensors) against the PyTorch expert loop: expert counts and
routings where experts get no token, one token or every token, pairs routed elsewhere (-1, expert
parallel), silu and swigluoai, with and without biases; and the alignment's invariants.

Tolerance: float32, 1e-5 relative and absolute. The kernels accumulate each dot product in BLOCK_K slices
and apply the activation in float32, where the loop's matmuls sum in another order, so results differ by
float32 rounding (observed ~1e-6 of outputs of magnitude ~10)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from pagedmoe.layers.moe.fused_moe import fused_experts

pytest.importorskip("triton")
from pagedmoe.layers.moe.triton_moe import align_by_expert, triton_fused_experts  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


@st.composite
def routings(draw):
    """topk_ids [tokens, top_k] of distinct experts per token: random, all tokens on the same experts, or one
    token; some pairs -1 where drawn."""
    num_experts = draw(st.integers(1, 6))
    top_k = draw(st.integers(1, min(num_experts, 3)))
    num_tokens = draw(st.integers(1, 20))
    kind = draw(st.sampled_from(["random", "same", "one_token"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    if kind == "one_token":
        num_tokens = 1
    if kind == "same":
        ids = torch.randperm(num_experts, generator=g)[:top_k].expand(num_tokens, top_k).clone()
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    if draw(st.booleans()):
        ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
    return num_experts, ids


@settings(max_examples=20, deadline=None)
@given(routing=routings(), hidden=st.sampled_from([16, 40]), inter=st.sampled_from([8, 24, 40]),
       activation=st.sampled_from(["silu", "swigluoai"]), bias=st.booleans(), seed=st.integers(0, 1000))
def test_triton_fused_moe_matches_expert_loop(routing, hidden, inter, activation, bias, seed):
    num_experts, topk_ids = routing
    torch.manual_seed(seed)
    x = torch.randn(len(topk_ids), hidden)
    w13, w2 = torch.randn(num_experts, 2 * inter, hidden) * 0.3, torch.randn(num_experts, hidden, inter) * 0.3
    biases = (torch.randn(num_experts, 2 * inter), torch.randn(num_experts, hidden)) if bias else (None, None)
    topk_weights = torch.rand(topk_ids.shape)
    expected = fused_experts(x, w13, w2, topk_weights, topk_ids, activation, *biases, use_grouped_mm=False)
    got = triton_fused_experts(x, w13, w2, topk_weights, topk_ids, activation, *biases)
    torch.testing.assert_close(got, expected, **TOL)


@settings(max_examples=40, deadline=None)
@given(routing=routings(), block_m=st.sampled_from([1, 4, 16]))
def test_alignment_puts_each_pair_once_in_a_tile_of_its_expert(routing, block_m):
    num_experts, topk_ids = routing
    sorted_pairs, tile_experts = align_by_expert(topk_ids, num_experts, block_m)
    ids, num_pairs = topk_ids.flatten(), topk_ids.numel()
    assert len(sorted_pairs) == len(tile_experts) * block_m
    assert len(tile_experts) * block_m >= num_pairs + num_experts * (block_m - 1)  # the worst case fits
    tiles = sorted_pairs.view(-1, block_m).long()
    for tile, expert in zip(tiles, tile_experts.tolist()):
        pairs = tile[tile < num_pairs]
        assert (ids[pairs] == expert).all() if expert >= 0 else len(pairs) == 0
    placed = sorted(sorted_pairs[sorted_pairs < num_pairs].tolist())
    assert placed == [p for p in range(num_pairs) if ids[p] >= 0]
    active = tile_experts[tile_experts >= 0]
    assert torch.equal(active, active.sort().values)  # runs in expert order, so tiles hold contiguous runs
