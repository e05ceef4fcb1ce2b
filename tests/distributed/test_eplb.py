"""EPLB's placement on hand-made skewed loads: a valid placement (every expert somewhere, each rank the same
number of slots) whose max/mean rank load falls to the stated bound."""
import pytest
import torch

from pagedmoe.distributed.eplb import (balanced_packing, better_of, imbalance, initial_placement, rebalance,
                                      replicate_experts)

SKEWED = torch.tensor([60.0, 30, 5, 5, 5, 5, 5, 5])  # contiguous on 4 ranks: [90, 10, 10, 10], max / mean 3.0


def test_skewed_load_balances_with_redundant_experts():
    before = initial_placement(1, 8, 4, 0)[0]
    assert before.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert imbalance(before, SKEWED) == pytest.approx(3.0)
    after = rebalance(SKEWED[None], num_ranks=4, num_redundant=4)[0]
    assert after.shape == (4, 3) and set(after.flatten().tolist()) == set(range(8))
    assert imbalance(after, SKEWED) <= 1.3
    assert imbalance(rebalance(SKEWED[None], 4, 0)[0], SKEWED) == pytest.approx(65 / 30)  # no replicas: 60 + a 5


def test_replicas_go_to_the_highest_load_per_replica():
    assert replicate_experts(torch.tensor([60.0, 30, 5]), 6).tolist() == [0, 0, 0, 1, 1, 2]


def test_packing_fills_every_pack_evenly():
    packs = balanced_packing(torch.tensor([9.0, 7, 5, 3, 1, 1]), 3)
    assert torch.bincount(packs).tolist() == [2, 2, 2]
    loads = torch.zeros(3).index_add_(0, packs, torch.tensor([9.0, 7, 5, 3, 1, 1]))
    assert loads.max() - loads.min() <= 4


def test_a_layer_keeps_its_placement_where_the_packing_would_balance_worse():
    """Greedy packing of [4, 2, 2, 2, 1, 1] on 2 ranks gives 7 / 5; the current placement is 6 / 6."""
    load = torch.tensor([[4.0, 2, 2, 2, 1, 1], [60.0, 30, 5, 5, 5, 5]])
    current = torch.tensor([[[0, 4, 5], [1, 2, 3]], [[0, 1, 2], [3, 4, 5]]])
    proposed = rebalance(load, num_ranks=2, num_redundant=0)
    assert imbalance(proposed[0], load[0]) == pytest.approx(7 / 6)
    chosen = better_of(current, proposed, load)
    assert chosen[0].tolist() == current[0].tolist()  # perfectly balanced already
    assert chosen[1].tolist() == proposed[1].tolist() and imbalance(chosen[1], load[1]) < imbalance(current[1], load[1])


def test_slots_must_divide_over_ranks():
    with pytest.raises(ValueError, match="num_redundant_experts"):
        rebalance(SKEWED[None], num_ranks=4, num_redundant=1)
