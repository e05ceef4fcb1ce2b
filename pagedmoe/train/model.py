"""Model construction: HF model classes from a tiny config, with the sparse blocks' routers swapped.

Design: the trainer does not define its own transformer. It instantiates the transformers class
it will export to (Qwen3MoeForCausalLM for softmax top-k routers, DeepseekV3ForCausalLM for
sigmoid+bias routing with a shared expert, Qwen3ForCausalLM for the dense draft model) and
replaces only each sparse block's `gate` with a router from `routers.py` that subclasses HF's
router and keeps its parameter names. Attention, norms, RoPE, the fused 3-D expert tensors
(`experts.gate_up_proj`, `experts.down_proj`) and the expert dispatch are HF's own code, so
export is `save_pretrained` of a freshly built HF model loaded with the same state dict, and the
exported model computes exactly what the trainer computed in eval mode. The price is HF's
per-call overhead, which is acceptable at this size on a CPU.
"""

from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from pagedmoe.train.config import TrainConfig
from pagedmoe.train.routers import CapacityRouter, LoadRecorder, NoisyTopKRouter, SigmoidBiasRouter, SoftmaxTopKRouter

MAX_POSITIONS = 1024


def common_config(cfg: TrainConfig, tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.dense_intermediate_size,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def qwen3_moe_config(cfg: TrainConfig, tokenizer) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **common_config(cfg, tokenizer),
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.effective_top_k,
        norm_topk_prob=cfg.router != "switch",
        router_aux_loss_coef=cfg.effective_aux_coef,
    )


def deepseek_v3_config(cfg: TrainConfig, tokenizer) -> DeepseekV3Config:
    return DeepseekV3Config(
        **common_config(cfg, tokenizer),
        num_key_value_heads=cfg.num_heads,
        moe_intermediate_size=cfg.moe_intermediate_size,
        n_routed_experts=cfg.num_experts,
        n_shared_experts=1,
        num_experts_per_tok=cfg.effective_top_k,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        q_lora_rank=None,
        kv_lora_rank=cfg.hidden_size // 2,
        qk_nope_head_dim=cfg.head_dim // 2,
        qk_rope_head_dim=cfg.head_dim // 2,
        v_head_dim=cfg.head_dim,
    )


def qwen3_dense_config(cfg: TrainConfig, tokenizer) -> Qwen3Config:
    return Qwen3Config(**common_config(cfg, tokenizer), num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)


def hf_model_class(cfg: TrainConfig) -> type[PreTrainedModel]:
    if cfg.arch == "dense":
        return Qwen3ForCausalLM
    return DeepseekV3ForCausalLM if cfg.router == "sigmoid_bias" else Qwen3MoeForCausalLM


def hf_config(cfg: TrainConfig, tokenizer):
    if cfg.arch == "dense":
        return qwen3_dense_config(cfg, tokenizer)
    return deepseek_v3_config(cfg, tokenizer) if cfg.router == "sigmoid_bias" else qwen3_moe_config(cfg, tokenizer)


def make_router(cfg: TrainConfig, config):
    if cfg.router == "sigmoid_bias":
        return SigmoidBiasRouter(config, cfg.bias_update_speed)
    if cfg.router in ("switch", "top2"):
        return CapacityRouter(config, cfg.capacity_factor)
    return NoisyTopKRouter(config) if cfg.router == "noisy_topk" else SoftmaxTopKRouter(config)


def install_routers(model: PreTrainedModel, cfg: TrainConfig) -> None:
    for layer in model.model.layers:
        router = make_router(cfg, model.config)
        router.load_state_dict(layer.mlp.gate.state_dict(), strict=False)
        layer.mlp.gate = router


def build_model(cfg: TrainConfig, tokenizer) -> PreTrainedModel:
    model = hf_model_class(cfg)(hf_config(cfg, tokenizer))
    if cfg.arch == "moe":
        install_routers(model, cfg)
    return model


def routers_of(model) -> list[LoadRecorder]:
    return [module for module in model.modules() if isinstance(module, LoadRecorder)]


def parameter_counts(model: PreTrainedModel, cfg: TrainConfig) -> dict[str, int]:
    unique = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in unique)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    expert_params = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in experts)
    inactive = expert_params * (1 - cfg.effective_top_k / cfg.num_experts) if experts else 0
    return {"total": total, "active": int(total - inactive)}
