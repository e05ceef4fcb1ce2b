"""Megatron's split of a loaded model over ranks, in place: QKV and gate/up by output rows (heads, the
intermediate dimension), O and down by input columns with one all-reduce of each block's output, the
embedding and LM head by vocabulary rows, and MoE experts either split like the MLP (tensor parallel) or
whole experts to each rank (expert parallel: expert e lives on rank e * size // E). Attention KV heads are
split, or replicated when there are fewer KV heads than ranks."""
import torch
from torch import nn

from pagedmoe.distributed import parallel_state as ps
from pagedmoe.distributed.eplb import initial_placement
from pagedmoe.distributed.eplb_state import EXPERT_WEIGHTS
from pagedmoe.distributed.expert_map import ExpertMap
from pagedmoe.layers.linear import Linear, MergedLinear

Rank = ps.RankInfo


def check_shardable(model: nn.Module, info: Rank):
    config = model.config
    if not hasattr(model, "layers") or not all(hasattr(layer, "self_attn") for layer in model.layers):
        raise ValueError(f"tensor_parallel_size: {type(model).__name__} has no tensor-parallel split yet")
    attn = model.layers[0].self_attn
    if getattr(model, "qk_norm", None) == "full" or not (hasattr(attn, "qkv_proj") or hasattr(attn, "w_uk")):
        raise ValueError(f"tensor_parallel_size: {type(model).__name__}'s attention has no tensor-parallel split yet")
    if config.num_attention_heads % info.world_size:
        raise ValueError(f"tensor_parallel_size {info.world_size} must divide num_attention_heads "
                         f"({config.num_attention_heads})")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv % info.world_size and info.world_size % kv:
        raise ValueError(f"tensor_parallel_size {info.world_size} and num_key_value_heads {kv}: one must divide the other")


def shard_model(model: nn.Module, info: Rank, expert_parallel: bool = False, num_redundant: int = 0) -> nn.Module:
    check_shardable(model, info)
    for layer in model.layers:
        (shard_mla if hasattr(layer.self_attn, "w_uk") else shard_attention)(layer.self_attn, info)
        if hasattr(layer.mlp, "num_experts") and expert_parallel:
            placement = initial_placement(1, layer.mlp.num_experts, info.world_size, num_redundant)[0]
            shard_experts(layer.mlp, info, placement)
        elif hasattr(layer.mlp, "num_experts"):
            shard_moe_intermediate(layer.mlp, info)
        else:
            shard_mlp(layer.mlp, info)
        for block in (layer.self_attn, layer.mlp):
            block.register_forward_hook(lambda module, args, out: ps.all_reduce(out))
    shard_vocab(model, info)
    return model


def split_range(size: int, info: Rank) -> tuple[int, int]:
    per_rank = size // info.world_size
    return info.rank * per_rank, (info.rank + 1) * per_rank


def kv_head_range(num_kv_heads: int, info: Rank) -> tuple[int, int]:
    if num_kv_heads >= info.world_size:
        return split_range(num_kv_heads, info)
    head = info.rank * num_kv_heads // info.world_size  # replicated: each KV head serves world / kv ranks
    return head, head + 1


def shard_attention(attn: nn.Module, info: Rank):
    d = attn.head_dim
    q0, q1 = split_range(attn.num_heads, info)
    k0, k1 = kv_head_range(attn.num_kv_heads, info)
    q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d
    rows = [range(q0 * d, q1 * d), range(q_size + k0 * d, q_size + k1 * d),
            range(q_size + kv_size + k0 * d, q_size + kv_size + k1 * d)]
    keep_rows(attn.qkv_proj, torch.tensor([r for part in rows for r in part]),
              {"q": (q1 - q0) * d, "k": (k1 - k0) * d, "v": (k1 - k0) * d})
    keep_columns(attn.o_proj, slice(q0 * d, q1 * d), info)
    if attn.sinks is not None:
        attn.sinks = nn.Parameter(attn.sinks.data[q0:q1].clone(), requires_grad=False)
    attn.num_heads, attn.num_kv_heads = q1 - q0, k1 - k0
    attn.attn.num_heads, attn.attn.num_kv_heads = q1 - q0, k1 - k0


def shard_mla(attn: nn.Module, info: Rank):
    """MLA as vLLM splits it: query heads (q_proj or q_b_proj rows, W_UK, W_UV) and O's columns per rank; the
    latent projections stay whole, so every rank keeps the whole latent cache (vLLM duplicates it too)."""
    h0, h1 = split_range(attn.num_heads, info)
    q_proj = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    keep_rows(q_proj, torch.arange(h0 * attn.qk_dim, h1 * attn.qk_dim))
    attn.w_uk = nn.Parameter(attn.w_uk.data[h0:h1].clone(), requires_grad=False)
    attn.w_uv = nn.Parameter(attn.w_uv.data[h0:h1].clone(), requires_grad=False)
    keep_columns(attn.o_proj, slice(h0 * attn.v_dim, h1 * attn.v_dim), info)
    attn.num_heads = attn.attn.num_heads = h1 - h0


def keep_rows(linear: Linear, rows: torch.Tensor, shard_sizes: dict[str, int] | None = None):
    linear.weight = nn.Parameter(linear.weight.data[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)
    if isinstance(linear, MergedLinear) and shard_sizes is not None:
        offsets, offset = {}, 0
        for name, size in shard_sizes.items():
            offsets[name], offset = (offset, size), offset + size
        linear.shard_offsets = offsets


def keep_columns(linear: Linear, columns: slice, info: Rank):
    """A row-parallel layer: its input columns; the bias on rank 0 alone (the all-reduce adds it once)."""
    linear.weight = nn.Parameter(linear.weight.data[:, columns].contiguous(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and info.rank != 0:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)


def gate_up_rows(intermediate: int, info: Rank) -> torch.Tensor:
    start, end = split_range(intermediate, info)
    return torch.cat([torch.arange(start, end), torch.arange(intermediate + start, intermediate + end)])


def shard_mlp(mlp: nn.Module, info: Rank):
    intermediate = mlp.gate_up_proj.weight.shape[0] // 2
    rows = gate_up_rows(intermediate, info)
    keep_rows(mlp.gate_up_proj, rows, {"gate": len(rows) // 2, "up": len(rows) // 2})
    start, end = split_range(intermediate, info)
    keep_columns(mlp.down_proj, slice(start, end), info)


def shard_moe_intermediate(moe: nn.Module, info: Rank):
    """Tensor-parallel experts: every expert keeps its slice of the intermediate dimension."""
    rows = gate_up_rows(moe.intermediate_size, info)
    start, end = split_range(moe.intermediate_size, info)
    moe.w13 = nn.Parameter(moe.w13.data[:, rows].clone(), requires_grad=False)
    moe.w2 = nn.Parameter(moe.w2.data[:, :, start:end].contiguous(), requires_grad=False)
    if moe.w13_bias is not None:
        moe.w13_bias = nn.Parameter(moe.w13_bias.data[:, rows].clone(), requires_grad=False)
        moe.w2_bias.data.mul_(float(info.rank == 0))
    moe.intermediate_size = end - start
    shard_shared_expert(moe, info)


def shard_experts(moe: nn.Module, info: Rank, placement: torch.Tensor, shared: bool = True):
    """Expert-parallel: this rank's slots of the placement ([ranks, slots] logical experts), whole experts;
    pairs routed to other ranks are skipped here."""
    moe.expert_map = ExpertMap(placement, info.rank)
    local = torch.tensor(moe.expert_map.local_experts)
    for name in EXPERT_WEIGHTS:
        if getattr(moe, name) is not None:
            setattr(moe, name, nn.Parameter(getattr(moe, name).data[local].clone(), requires_grad=False))
    if shared:  # data-parallel attention keeps the shared expert whole: it runs on the rank's own tokens
        shard_shared_expert(moe, info)


def shard_shared_expert(moe: nn.Module, info: Rank):
    if moe.shared_experts is not None:
        shard_mlp(moe.shared_experts, info)


def shard_vocab(model: nn.Module, info: Rank):
    """Embedding rows [start, end) of the vocabulary padded to a multiple of the ranks; the LM head's
    logits are gathered back to the whole vocabulary on every rank."""
    vocab = model.config.vocab_size
    per_rank = -(-vocab // info.world_size)
    start, end = info.rank * per_rank, min((info.rank + 1) * per_rank, vocab)
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight.data, start, end)
    head = model.embed_tokens.weight if tied else model.lm_head.weight.data
    model.lm_head = VocabParallelLMHead(head, start, end, per_rank, vocab)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, end: int):
        super().__init__()
        self.start, self.end = start, end
        self.weight = nn.Parameter(weight[start:end].clone(), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = (input_ids >= self.start) & (input_ids < self.end)
        x = nn.functional.embedding((input_ids - self.start).clamp(0, self.end - self.start - 1), self.weight)
        return ps.all_reduce(x.masked_fill_(~local[:, None], 0))


class VocabParallelLMHead(Linear):
    """This rank's vocabulary rows, zero-padded to per_rank so every rank gathers the same width."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, per_rank: int, vocab_size: int):
        super().__init__(weight.shape[1], per_rank, bias=False, device=weight.device, dtype=weight.dtype)
        rows = weight if weight.shape[0] == end - start else weight[start:end]
        padded = torch.zeros(per_rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
        padded[:end - start] = rows
        self.weight, self.vocab_size = nn.Parameter(padded, requires_grad=False), vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ps.all_gather_last_dim(super().forward(x))[..., :self.vocab_size]
