"""Fused MoE in Triton, as vLLM's fused_moe kernel is designed: the (token, slot) pairs sorted by expert and
each expert's run padded to a whole BLOCK_M tile (so every tile belongs to one expert), then two grouped GEMM
kernels over the tiles: gate/up with the gated activation fused (silu, or gpt-oss's swigluoai), and down with
the router weight applied; the top-k rows of each token are summed in float32 at the end. The alignment is
tensor ops of fixed sizes (no host sync), so a CUDA graph can capture it."""
import torch
import triton.language as tl
from torch import Tensor

from pagedmoe.layers.activation import SWIGLU_ALPHA, SWIGLU_LIMIT
from pagedmoe.layers.triton_utils import Kernel, dot_precision

ACTIVATION_IDS = {"silu": 0, "swigluoai": 1}
TILES = {"cuda": (64, 64, 32), "cpu": (16, 32, 32)}  # BLOCK_M (pairs), BLOCK_N (outputs), BLOCK_K


def _gate_up(x_ptr, w13_ptr, b13_ptr, out_ptr, sorted_pairs_ptr, tile_experts_ptr, num_pairs, top_k, hidden,
             inter, stride_xt, stride_we, stride_wn, stride_ot, swiglu_alpha, swiglu_limit,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACTIVATION: tl.constexpr,
             HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Program (tile, n block): out[pair, n] = act(x[token] . w13[e, n] + b, x[token] . w13[e, I + n] + b)
    for the tile's pairs, all routed to expert e."""
    tile, n_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_valid = pairs < num_pairs
    tokens = tl.where(pair_valid, pairs // top_k, 0).to(tl.int64)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < inter
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w13_ptr + expert * stride_we
    for k in range(0, hidden, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_valid = offs_k < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                    mask=pair_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & n_valid[None, :]
        w_gate = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (inter + offs_n[None, :]) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        gate = tl.dot(x, w_gate, gate, input_precision=PRECISION)
        up = tl.dot(x, w_up, up, input_precision=PRECISION)
    if HAS_BIAS:
        gate += tl.load(b13_ptr + expert * 2 * inter + offs_n, mask=n_valid, other=0.0)[None, :].to(tl.float32)
        up += tl.load(b13_ptr + expert * 2 * inter + inter + offs_n, mask=n_valid, other=0.0)[None, :].to(tl.float32)
    if ACTIVATION == 0:  # silu(gate) * up
        hidden_act = gate * tl.sigmoid(gate) * up
    else:  # swigluoai: clamped, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        hidden_act = (up + 1) * (gate * tl.sigmoid(gate * swiglu_alpha))
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_ot + offs_n[None, :],
             hidden_act.to(out_ptr.dtype.element_ty), mask=pair_valid[:, None] & n_valid[None, :])


def _down(h_ptr, w2_ptr, b2_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, tile_experts_ptr, num_pairs, hidden,
          inter, stride_ht, stride_we, stride_wn, stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Program (tile, n block): out[pair, n] = weight[pair] * (h[pair] . w2[e, n] + b) in float32."""
    tile, n_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_valid = pairs < num_pairs
    rows = tl.where(pair_valid, pairs, 0).to(tl.int64)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w2_ptr + expert * stride_we
    for k in range(0, inter, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_valid = offs_k < inter
        h = tl.load(h_ptr + rows[:, None] * stride_ht + offs_k[None, :],
                    mask=pair_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * hidden + offs_n, mask=n_valid, other=0.0)[None, :].to(tl.float32)
    weight = tl.load(weights_ptr + rows, mask=pair_valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_ot + offs_n[None, :], acc * weight[:, None],
             mask=pair_valid[:, None] & n_valid[None, :])


gate_up_kernel = Kernel(_gate_up)
down_kernel = Kernel(_down)


def align_by_expert(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(sorted_pairs, tile_experts): the pair indices (token * top_k + slot) grouped by expert, each expert's
    run padded with num_pairs (no pair) to a multiple of block_m, in a buffer of the worst-case size; and each
    tile's expert, -1 for tiles past the last run. Pairs of id -1 (expert parallel: routed elsewhere) are left
    out."""
    ids = topk_ids.flatten().long()
    num_pairs, device = ids.numel(), ids.device
    bucket = torch.where(ids < 0, num_experts, ids)  # bucket num_experts: not here
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, bucket, torch.ones_like(ids))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank_in_run = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_bucket]
    num_tiles = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    trash = num_tiles * block_m  # where the pairs that are not here go, cut off below
    position = torch.where(sorted_bucket < num_experts,
                           (padded_ends - padded)[sorted_bucket.clamp(max=num_experts - 1)] + rank_in_run, trash)
    sorted_pairs = torch.full((trash + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, position, order.to(torch.int32))
    tile_starts = torch.arange(num_tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_pairs[:trash], tile_experts


def triton_fused_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                         activation: str = "silu", w13_bias: Tensor | None = None,
                         w2_bias: Tensor | None = None) -> Tensor:
    """sum over each token's top-k experts of weight * (act(x W13^T + b13) W2^T + b2): [tokens, hidden], float32;
    w13 [E, 2I, H], w2 [E, H, I] (contiguous in their last dim)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    block_m, block_n, block_k = TILES["cuda" if x.device.type == "cuda" else "cpu"]
    sorted_pairs, tile_experts = align_by_expert(topk_ids, num_experts, block_m)
    num_pairs, num_tiles = num_tokens * top_k, len(tile_experts)
    x = x.contiguous()
    h = x.new_empty(num_pairs, inter)
    precision = dot_precision(x.dtype)
    gate_up_kernel.on(x.device)[(num_tiles, -(-inter // block_n))](
        x, w13, w13_bias if w13_bias is not None else x, h, sorted_pairs, tile_experts, num_pairs, top_k, hidden,
        inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), SWIGLU_ALPHA, SWIGLU_LIMIT,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ACTIVATION=ACTIVATION_IDS[activation],
        HAS_BIAS=w13_bias is not None, PRECISION=precision)
    out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # pairs elsewhere stay 0
    down_kernel.on(x.device)[(num_tiles, -(-hidden // block_n))](
        h, w2, w2_bias if w2_bias is not None else x, topk_weights.contiguous(), out, sorted_pairs, tile_experts,
        num_pairs, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=w2_bias is not None, PRECISION=precision)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
