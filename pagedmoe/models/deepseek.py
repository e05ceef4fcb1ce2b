"""DeepSeek-V2/V3: multi-head latent attention (MLA) over a latent-only paged cache, dense first layers, then
MoE layers with shared experts (V3: sigmoid group-limited routing with a correction bias)."""
import torch
from torch import nn

from pagedmoe.layers.attention.metadata import AttentionMetadata
from pagedmoe.layers.attention.mla import MLAPagedAttention
from pagedmoe.layers.linear import Linear, MergedLinear
from pagedmoe.layers.moe.routers import RouterConfig
from pagedmoe.layers.norm import RMSNorm
from pagedmoe.layers.rotary import InterleavedRotaryEmbedding, RotaryEmbedding, rope_inv_freq, yarn_softmax_scale
from pagedmoe.models.llama import MLP, DecoderForCausalLM, _copy_param, select_rows
from pagedmoe.models.moe_block import MoEBlock


class MLAttention(nn.Module):
    """MLA with the up-projections absorbed: kv_b_proj is stored split as W_UK [heads, qk_nope, kv_lora_rank]
    and W_UV [heads, kv_lora_rank, v_head_dim]; attention itself runs in latent space."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = (config.num_attention_heads, config.q_lora_rank,
                                                               config.kv_lora_rank)
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        hidden, q_size, kv_a_size = config.hidden_size, self.num_heads * self.qk_dim, self.kv_lora_rank + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_size, bias=False)
            self.kv_a_proj_with_mqa = Linear(hidden, kv_a_size, bias=config.attention_bias)
        else:
            self.qkv_a_proj = MergedLinear(hidden, {"q_a_proj": self.q_lora_rank, "kv_a_proj_with_mqa": kv_a_size},
                                           bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = Linear(self.q_lora_rank, q_size, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope_dim, self.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.kv_lora_rank, self.v_dim))
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=config.attention_bias)
        self.rotary = rotary
        scale = yarn_softmax_scale(config.rope_parameters, self.qk_dim ** -0.5)
        self.attn = MLAPagedAttention(layer_idx, self.num_heads, self.kv_lora_rank, self.rope_dim, scale)

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        q, kv_a = self.project(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        o_latent = self.attn(q_latent, q_pe, self.kv_a_layernorm(latent), k_pe.squeeze(1), meta)
        o = torch.bmm(select_rows(o_latent, rows).transpose(0, 1), self.w_uv).transpose(0, 1)
        return self.o_proj(o.flatten(1))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_lora_rank is None:
            return self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_a, kv_a = self.qkv_a_proj(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], dim=-1)
        return self.q_b_proj(self.q_a_layernorm(q_a)), kv_a

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        if name == "kv_b_proj.weight":
            self.load_kv_b_proj(tensor)
            return True
        module, _, param = name.rpartition(".")
        if self.q_lora_rank is not None and module in self.qkv_a_proj.shard_offsets:
            self.qkv_a_proj.load_shard(module, param, tensor)
            return True
        return _copy_param(self, name, tensor)

    def load_kv_b_proj(self, weight: torch.Tensor):
        expected = (self.num_heads * (self.nope_dim + self.v_dim), self.kv_lora_rank)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight kv_b_proj: expected shape {expected}, got {tuple(weight.shape)}")
        w_uk, w_uv = weight.view(self.num_heads, -1, self.kv_lora_rank).split([self.nope_dim, self.v_dim], dim=1)
        self.w_uk.data.copy_(w_uk)
        self.w_uv.data.copy_(w_uv.transpose(1, 2))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        self.self_attn = MLAttention(config, layer_idx, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, meta, rows: torch.Tensor | None = None):
        x = select_rows(x, rows) + self.self_attn(positions, self.input_layernorm(x), meta, rows)
        return x + self.mlp(self.post_attention_layernorm(x), meta)


def is_moe_layer(config, layer_idx: int) -> bool:
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return bool(config.n_routed_experts) and layer_idx >= config.first_k_dense_replace and layer_idx % freq == 0


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """Layers past num_hidden_layers in a checkpoint (the multi-token-prediction module) are not loaded."""
    takes_fp4_packed = False  # MLA's projections load by their own rules: 4-bit weights are decoded

    def __init__(self, config):
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} not supported for DeepSeek (only 'silu')")
        super().__init__(config)

    def make_rotary(self, config) -> RotaryEmbedding:
        inv_freq, scaling = rope_inv_freq(config, config.qk_rope_head_dim)
        rotary_cls = InterleavedRotaryEmbedding if self.interleaved_rope(config) else RotaryEmbedding
        return rotary_cls(inv_freq, scaling, config.max_position_embeddings)

    def interleaved_rope(self, config) -> bool:
        return getattr(config, "rope_interleave", True)

    def make_layer(self, config, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekDecoderLayer(config, layer_idx, rotary, self.make_mlp(config, layer_idx))

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if not is_moe_layer(config, layer_idx):
            return MLP(config.hidden_size, config.intermediate_size)
        moe_index = sum(is_moe_layer(config, i) for i in range(layer_idx))
        return MoEBlock(moe_index, config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                        self.router(config),
                        shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0))

    def router(self, config) -> RouterConfig:
        return RouterConfig("sigmoid_group", config.num_experts_per_tok, bool(config.norm_topk_prob),
                            config.n_group or 1, config.topk_group or 1, config.routed_scaling_factor,
                            has_correction_bias=True, fp32_logits=True)

    def kv_cache_token_shape(self) -> tuple[int, tuple[int, ...]]:
        return 1, (self.config.kv_lora_rank + self.config.qk_rope_head_dim,)

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        parts = name.removeprefix("model.").split(".")
        if len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit():
            return super().load_weight(name, tensor)
        if int(parts[1]) >= len(self.layers):
            return False
        if parts[2] == "self_attn":
            return self.layers[int(parts[1])].self_attn.load_weight(".".join(parts[3:]), tensor)
        return super().load_weight(name, tensor)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2: softmax routing, greedy or group-limited, weights never renormalised (as HF)."""
    router_kinds = {"greedy": "softmax", "group_limited_greedy": "softmax_group"}

    def interleaved_rope(self, config) -> bool:
        return True

    def router(self, config) -> RouterConfig:
        if config.topk_method not in self.router_kinds:
            raise ValueError(f"topk_method {config.topk_method!r} not supported; known: {sorted(self.router_kinds)}")
        return RouterConfig(self.router_kinds[config.topk_method], config.num_experts_per_tok, False,
                            config.n_group or 1, config.topk_group or 1, config.routed_scaling_factor,
                            fp32_logits=True)
