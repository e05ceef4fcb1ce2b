import pytest
import torch

from pagedmoe.layers.moe.fused_moe import expert_counts
from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig, select_experts

NUM_EXPERTS, HIDDEN, INTER = 8, 16, 8


def make_layer(**kwargs) -> FusedMoE:
    torch.manual_seed(0)
    layer = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, RouterConfig("softmax", 2, renormalize=True), **kwargs)
    with torch.no_grad():
        for tensor in layer.state_dict().values():
            tensor.normal_(std=0.3)
    return layer


def test_expert_load_accumulates_in_place():
    layer, x = make_layer(), torch.randn(30, HIDDEN)
    expert_load = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    layer(x, expert_load)
    layer(x[:7], expert_load)
    expected = sum(expert_counts(select_experts(layer.router, layer.gate(t))[1], NUM_EXPERTS) for t in (x, x[:7]))
    assert expert_load.tolist() == expected.tolist()
    assert int(expert_load.sum()) == (30 + 7) * 2


def test_expert_load_is_optional_and_output_unchanged():
    layer, x = make_layer(), torch.randn(5, HIDDEN)
    torch.testing.assert_close(layer(x), layer(x, torch.zeros(NUM_EXPERTS, dtype=torch.int64)))


def test_per_expert_weights_land_in_fused_slices():
    layer = make_layer()
    gate, up, down = torch.randn(INTER, HIDDEN), torch.randn(INTER, HIDDEN), torch.randn(HIDDEN, INTER)
    for name, tensor in (("w1", gate), ("w3", up), ("w2", down)):
        assert layer.load_weight(f"experts.5.{name}.weight", tensor)
    assert torch.equal(layer.w13[5], torch.cat([gate, up])) and torch.equal(layer.w2[5], down)
    assert layer.load_weight("experts.2.up_proj.weight", up) and torch.equal(layer.w13[2, INTER:], up)


def test_shared_expert_weights():
    layer = make_layer(shared_intermediate_size=12, shared_expert_gate=True)
    gate = torch.randn(12, HIDDEN)
    assert layer.load_weight("shared_expert.gate_proj.weight", gate)
    assert torch.equal(layer.shared_experts.gate_up_proj.weight[:12], gate)
    assert layer.load_weight("shared_expert_gate.weight", torch.ones(1, HIDDEN))
    assert torch.equal(layer.shared_expert_gate.weight, torch.ones(1, HIDDEN))


def test_unknown_names_return_false():
    layer = make_layer()
    for name in ("experts.0.w4.weight", "gate.bias", "shared_expert.gate_proj.weight", "e_score_correction_bias",
                 "experts.gate_up_proj_bias", "mlp.gate.weight"):
        assert not layer.load_weight(name, torch.zeros(1)), name


def test_bad_shapes_and_experts_raise():
    layer = make_layer()
    with pytest.raises(ValueError, match="expected shape"):
        layer.load_weight("gate.weight", torch.zeros(NUM_EXPERTS + 1, HIDDEN))
    with pytest.raises(ValueError, match="out of range"):
        layer.load_weight(f"experts.{NUM_EXPERTS}.w1.weight", torch.zeros(INTER, HIDDEN))
