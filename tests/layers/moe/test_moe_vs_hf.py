import pytest
import torch
from torch import nn
from transformers import (DeepseekV2Config, DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig,
                          Qwen2MoeConfig, Qwen3MoeConfig)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagedmoe.layers.moe.layer import FusedMoE
from pagedmoe.layers.moe.routers import RouterConfig

HIDDEN, INTER, NUM_TOKENS = 24, 16, 40


def mixtral():
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2)
    layer = FusedMoE(8, HIDDEN, INTER, RouterConfig("softmax", 2, renormalize=True))
    return MixtralSparseMoeBlock(config), layer, ("w1", "w3", "w2")


def qwen2_moe():
    config = Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, shared_expert_intermediate_size=20,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    layer = FusedMoE(8, HIDDEN, INTER, RouterConfig("softmax", 2), shared_intermediate_size=20,
                     shared_expert_gate=True)
    return Qwen2MoeSparseMoeBlock(config), layer, ("gate_proj", "up_proj", "down_proj")


def qwen3_moe(norm_topk_prob):
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=8,
                            num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    layer = FusedMoE(8, HIDDEN, INTER, RouterConfig("softmax", 3, renormalize=norm_topk_prob))
    return Qwen3MoeSparseMoeBlock(config), layer, ("gate_proj", "up_proj", "down_proj")


def olmoe():
    config = OlmoeConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_experts=8, num_experts_per_tok=2)
    layer = FusedMoE(8, HIDDEN, INTER, RouterConfig("softmax", 2, renormalize=False))
    return OlmoeSparseMoeBlock(config), layer, ("gate_proj", "up_proj", "down_proj")


def deepseek_v3():
    config = DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=16, n_group=4,
                              topk_group=2, num_experts_per_tok=4, n_shared_experts=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    router = RouterConfig("sigmoid_group", 4, True, 4, 2, 2.5, has_correction_bias=True, fp32_logits=True)
    layer = FusedMoE(16, HIDDEN, INTER, router, shared_intermediate_size=2 * INTER)
    return DeepseekV3MoE(config), layer, ("gate_proj", "up_proj", "down_proj")


def deepseek_v2(topk_method):
    config = DeepseekV2Config(hidden_size=HIDDEN, num_attention_heads=4, moe_intermediate_size=INTER,
                              n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                              n_shared_experts=1, routed_scaling_factor=1.5, topk_method=topk_method)
    kind = "softmax" if topk_method == "greedy" else "softmax_group"
    router = RouterConfig(kind, 3, False, 4, 2, 1.5, fp32_logits=True)
    layer = FusedMoE(16, HIDDEN, INTER, router, shared_intermediate_size=INTER)
    return DeepseekV2Moe(config), layer, ("gate_proj", "up_proj", "down_proj")


def gpt_oss():
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2)
    layer = FusedMoE(8, HIDDEN, INTER, RouterConfig("topk_softmax", 2), activation="swigluoai",
                     expert_bias=True, gate_bias=True)
    return GptOssMLP(config), layer, None


CASES = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe_norm": lambda: qwen3_moe(True),
    "qwen3_moe_no_norm": lambda: qwen3_moe(False), "olmoe": olmoe, "deepseek_v3": deepseek_v3,
    "deepseek_v2_greedy": lambda: deepseek_v2("greedy"),
    "deepseek_v2_group": lambda: deepseek_v2("group_limited_greedy"), "gpt_oss": gpt_oss,
}


def randomized(block: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, tensor in block.state_dict().items():
            tensor.normal_(std=0.05 if "down_proj" in name else 0.3)
    return block.eval()


def nan_filled(layer: FusedMoE) -> FusedMoE:
    with torch.no_grad():
        for tensor in layer.state_dict().values():
            tensor.fill_(float("nan"))
    return layer


def per_expert(state: dict, proj_names: tuple[str, str, str]) -> dict:
    out = {k: v for k, v in state.items() if not k.startswith("experts.")}
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    gate, up = gate_up.chunk(2, dim=1)
    for e in range(gate_up.shape[0]):
        for proj, tensor in zip(proj_names, (gate[e], up[e], down[e])):
            out[f"experts.{e}.{proj}.weight"] = tensor.clone()
    return out


def load_all(layer: FusedMoE, state: dict) -> FusedMoE:
    for name, tensor in state.items():
        assert layer.load_weight(name, tensor), name
    return layer


def hf_output(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)


def inputs() -> torch.Tensor:
    return torch.randn(NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)) * 2


LAYOUTS = [(case, "fused") for case in CASES] + [(case, "per_expert") for case in CASES if case != "gpt_oss"]


@pytest.mark.parametrize("case,layout", LAYOUTS)
def test_matches_hf_block(case, layout):
    block, layer, proj_names = CASES[case]()
    state = randomized(block).state_dict()
    if layout == "per_expert":
        state = per_expert(state, proj_names)
    layer = load_all(nan_filled(layer), state)
    x = inputs()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), hf_output(block, x), atol=1e-5, rtol=1e-5)


def test_deepseek_v3_correction_bias_changes_routing():
    block, layer, _ = deepseek_v3()
    state = randomized(block).state_dict()
    state["gate.e_score_correction_bias"] = torch.zeros(16)
    without_bias = load_all(layer, state)(inputs())
    state["gate.e_score_correction_bias"] = torch.randn(16, generator=torch.Generator().manual_seed(2))
    with_bias = load_all(layer, state)(inputs())
    assert not torch.allclose(with_bias, without_bias, atol=1e-3)


def test_gpt_oss_case_exercises_swiglu_clamp():
    block, layer, _ = gpt_oss()
    layer = load_all(layer, randomized(block).state_dict())
    gate_up = torch.einsum("th,eih->tei", inputs(), layer.w13) + layer.w13_bias
    assert gate_up.abs().max() > 7.0
