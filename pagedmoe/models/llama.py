import torch
from torch import nn

from pagedmoe.layers.attention.metadata import AttentionMetadata
from pagedmoe.layers.attention.torch_backend import TorchPagedAttention
from pagedmoe.layers.linear import GateUpLinear, Linear, MergedLinear
from pagedmoe.layers.norm import RMSNorm
from pagedmoe.layers.quantization.fp4_kernel import PackedFp4Weight
from pagedmoe.layers.rotary import RotaryEmbedding, rope_inv_freq
from pagedmoe.models.moe_block import MoEBlock

# HF projection name -> (our merged module, shard)
STACKED_PARAMS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                  "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The layer's window where HF's config marks it "sliding_attention" (gpt-oss: every even layer)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer_idx] == "sliding_attention":
        return config.sliding_window
    return None


class Attention(nn.Module):
    """qk_norm: None, "head" (Qwen3: RMSNorm per head) or "full" (OLMoE: RMSNorm over all heads).
    sinks: one learned logit per query head in each softmax's denominator (gpt-oss)."""

    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qk_norm: str | None, sinks: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.qk_norm, self.clip_qkv = qk_norm, getattr(config, "clip_qkv", None)
        q_norm_size, k_norm_size = (q_size, kv_size) if qk_norm == "full" else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_norm_size, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if sinks else None
        self.attn = TorchPagedAttention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                                        self.head_dim ** -0.5, sliding_window_of(config, layer_idx))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                         self.num_kv_heads * self.head_dim], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta, self.sinks)
        return self.o_proj(select_rows(o.flatten(1), rows))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding, qk_norm: str | None, mlp: nn.Module,
                 sinks: bool = False):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, rotary, qk_norm, sinks)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    decode_block = None  # CPU: the attention half in one call for steps of decodes (attach_decode_blocks)

    def forward(self, positions, x, meta, rows: torch.Tensor | None = None):
        """rows: compute only these past the attention (the last layer, where the step reads only some)."""
        fused = self.decode_block(positions, x, meta) if self.decode_block is not None and rows is None else None
        if fused is None:
            x = select_rows(x, rows) + self.self_attn(positions, self.input_layernorm(x), meta, rows)
            fused = x, self.post_attention_layernorm(x)
        x, normed = fused
        return x + self.mlp(normed, meta)


class DecoderForCausalLM(nn.Module):
    """Llama-family decoder (Llama, Qwen2, Qwen3). MoE families reuse it by overriding `make_mlp`."""
    qk_norm: str | None = None
    attention_sinks = False
    takes_fp4_packed = True  # load_weight takes PackedFp4Weight for linear layers and experts
    decode_stack = None  # CPU: every layer in one call for steps of decodes (layers/decode_stack.py)
    greedy_head = None  # CPU: greedy tokens without the full logits (layers/greedy_head.py)
    weight_renames: dict[str, str] = {}

    def __init__(self, config):
        super().__init__()
        self.config = config
        rotary = self.make_rotary(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, config) -> RotaryEmbedding:
        inv_freq, scaling = rope_inv_freq(config, head_dim_of(config))
        return RotaryEmbedding(inv_freq, scaling, config.max_position_embeddings)

    def make_layer(self, config, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(config, layer_idx, rotary, self.qk_norm, self.make_mlp(config, layer_idx),
                            self.attention_sinks)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        return MLP(config.hidden_size, config.intermediate_size)

    def kv_cache_token_shape(self) -> tuple[int, tuple[int, ...]]:
        """K and V of this rank's KV heads (all of them in one process)."""
        return 2 * self.layers[0].self_attn.num_kv_heads, (head_dim_of(self.config),)

    def hybrid_kv_layout(self) -> tuple[int, list[int]] | None:
        """Where full and sliding-window layers mix: the window, and each layer's KV storage slot (the n-th
        full layer and the n-th sliding one share slot n: a block holds one of the two block tables' KV)."""
        windows = [sliding_window_of(self.config, i) for i in range(self.config.num_hidden_layers)]
        if all(windows) or not any(windows) or len(set(filter(None, windows))) > 1:
            return None
        slots = [sum(bool(w) == bool(windows[i]) for w in windows[:i]) for i in range(len(windows))]
        return next(filter(None, windows)), slots

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        stacked = self.decode_stack(positions, x, meta) if self.decode_stack is not None else None
        x = stacked if stacked is not None else self._layers(positions, x, meta)
        x = self.norm(x)
        if len(self.layers) in meta.aux_hidden_layers:  # as HF's hidden_states[num_layers]: after the norm
            meta.aux_hidden.append(x)
        return x

    def _layers(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index in meta.aux_hidden_layers:
                meta.aux_hidden.append(x)
            x = layer(positions, x, meta, meta.output_rows if index == len(self.layers) - 1 else None)
        return x

    def has_plain_layers(self) -> bool:
        """Every layer a DecoderLayer with a dense MLP or a MoEBlock: what layers/decode_stack.py runs in one
        call."""
        return all(type(layer) is DecoderLayer and type(layer.mlp) in (MLP, MoEBlock) for layer in self.layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def moe_layers(self) -> list[nn.Module]:
        return [layer.mlp for layer in self.layers if hasattr(layer.mlp, "moe_index")]

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        name = name.removeprefix("model.")
        for old, new in self.weight_renames.items():
            name = name.replace(old, new)
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return False
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "layers" and parts[2] == "mlp" and parts[1].isdigit():
            mlp = self.layers[int(parts[1])].mlp if int(parts[1]) < len(self.layers) else None
            if hasattr(mlp, "moe_index"):
                return mlp.load_weight(".".join(parts[3:]), tensor)
        if len(parts) >= 2 and parts[-2] in STACKED_PARAMS:
            module_name, shard = STACKED_PARAMS[parts[-2]]
            try:
                module = self.get_submodule(".".join(parts[:-2] + [module_name]))
            except AttributeError:
                return False
            module.load_shard(shard, parts[-1], tensor)
            return True
        return _copy_param(self, name, tensor)


def select_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x[rows]


def _copy_param(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    if isinstance(tensor, PackedFp4Weight):
        return _set_fp4(model, name, tensor)
    try:
        param = model.get_parameter(name)
    except AttributeError:
        return False
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
    param.data.copy_(tensor)
    return True


def _set_fp4(model: nn.Module, name: str, weight: PackedFp4Weight) -> bool:
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    if leaf != "weight" or not hasattr(module, "set_fp4"):
        raise ValueError(f"{name}: a 4-bit weight for a layer that cannot hold one")
    module.set_fp4(weight)
    return True


class LlamaForCausalLM(DecoderForCausalLM):
    pass


class Qwen2ForCausalLM(DecoderForCausalLM):
    pass


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = "head"
