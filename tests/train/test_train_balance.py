import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagedmoe.train.balance import coefficient_of_variation
from pagedmoe.train.config import DEFAULT_AUX_COEF
from pagedmoe.train.routers import (
    CapacityRouter,
    NoisyTopKRouter,
    SigmoidBiasRouter,
    SoftmaxTopKRouter,
    capacity_keep_mask,
    expert_capacity,
)

ROUTER_CLASSES = {"none": SoftmaxTopKRouter, "switch": CapacityRouter, "top2": CapacityRouter, "noisy_topk": NoisyTopKRouter}


def skewed_inputs(hidden: int = 16) -> torch.Tensor:
    x = torch.randn(8, 32, hidden)
    x[..., 0] += 2.0
    return x


def skew_towards_expert_zero(router) -> None:
    with torch.no_grad():
        router.weight.normal_(std=0.1)
        router.weight[0, 0] = 3.0


def toy_block(kind: str, top_k: int) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=top_k, norm_topk_prob=kind != "switch", experts_implementation="eager")
    block = Qwen3MoeSparseMoeBlock(config)
    torch.nn.init.normal_(block.experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(block.experts.down_proj, std=0.1)
    block.gate = ROUTER_CLASSES[kind](config)
    skew_towards_expert_zero(block.gate)
    return block


def final_cv_after_regression(kind: str, top_k: int, steps: int = 200) -> tuple[float, float]:
    torch.manual_seed(0)
    block = toy_block(kind, top_k)
    x, target = skewed_inputs(), torch.randn(8, 32, 16)
    optimizer = torch.optim.Adam(block.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = ((block(x) - target) ** 2).mean() + DEFAULT_AUX_COEF[kind] * block.gate.last_aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    block.eval()
    block(x)
    return coefficient_of_variation(block.gate.last_load), DEFAULT_AUX_COEF[kind]


def test_aux_losses_lower_load_cv_against_no_balancing():
    none_top2, _ = final_cv_after_regression("none", 2)
    none_top1, _ = final_cv_after_regression("none", 1)
    assert final_cv_after_regression("top2", 2)[0] < 0.85 * none_top2
    assert final_cv_after_regression("noisy_topk", 2)[0] < 0.5 * none_top2
    assert final_cv_after_regression("switch", 1)[0] < 0.85 * none_top1


def test_no_balancing_router_has_zero_aux_loss():
    block = toy_block("none", 2)
    block(skewed_inputs())
    assert float(block.gate.last_aux_loss) == 0.0


def sigmoid_router(speed: float) -> SigmoidBiasRouter:
    config = DeepseekV3Config(hidden_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    router = SigmoidBiasRouter(config, bias_update_speed=speed)
    skew_towards_expert_zero(router)
    return router


def test_sigmoid_bias_moves_load_towards_balance_without_gradients():
    torch.manual_seed(0)
    router, x = sigmoid_router(speed=1e-2), skewed_inputs()
    router(x)
    initial_cv, initial_load = coefficient_of_variation(router.last_load), router.last_load.clone()
    for _ in range(300):
        router(x)
        router.after_step()
    router.eval()
    router(x)
    assert coefficient_of_variation(router.last_load) < 0.3 * initial_cv
    assert router.e_score_correction_bias[initial_load.argmax()] < 0
    assert router.weight.grad is None


def test_sigmoid_bias_sequence_loss_is_positive_and_differentiable():
    router = sigmoid_router(speed=0.0)
    router(skewed_inputs())
    router.last_aux_loss.backward()
    assert router.last_aux_loss.detach().item() > 0
    assert router.weight.grad.abs().sum() > 0


def test_capacity_mask_serves_first_choices_before_second_choices():
    indices = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])
    keep = capacity_keep_mask(indices, num_experts=2, capacity=3)
    assert keep[:, 0].tolist() == [True, True, True, True]
    assert keep[:, 1].tolist() == [True, True, False, False]


def test_switch_capacity_drops_overflow_tokens_and_zeroes_their_weight():
    torch.manual_seed(0)
    router = toy_block("switch", 1).gate
    hidden = skewed_inputs().view(-1, 16)
    _, weights, indices = router(hidden)
    capacity = expert_capacity(len(hidden), 4, 1, router.capacity_factor)
    kept_on_zero = ((indices[:, 0] == 0) & (weights[:, 0] > 0)).sum()
    assert kept_on_zero == capacity
    assert router.last_dropped == (indices == 0).sum() - capacity
