"""Fused MoE in Triton, as vLLM's fused_moe kernel is designed: the (token, slot) pairs sorted by expert and
each expert's run padded to a whole BLOCK_M tile (so every tile belongs to one expert), then one grouped GEMM
kernel over the tiles, launched twice: gate/up with the gated activation fused (silu, or gpt-oss's swigluoai),
and down with the router weight applied; the top-k rows of each token are summed in float32 at the end. The alignment is
tensor ops of fixed sizes (no host sync), so a CUDA graph can capture it."""
import torch
import triton.language as tl
from torch import Tensor

from pagedmoe.layers.activation import SWIGLU_ALPHA, SWIGLU_LIMIT
from pagedmoe.layers.triton_utils import Kernel, dot_precision

ACTIVATION_IDS = {"silu": 0, "swigluoai": 1}
TILES = {"cuda": (64, 64, 32), "cpu": (16, 32, 32)}  # BLOCK_M (pairs), BLOCK_N (outputs), BLOCK_K


def _expert_gemm(a_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, sorted_pairs_ptr, tile_experts_ptr, num_pairs,
                 rows_per_a, n_size, k_size, stride_at, stride_we, stride_wn, stride_ot, swiglu_alpha, swiglu_limit,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                 ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Program (tile, n block), the tile's pairs all routed to expert e; a row of A serves rows_per_a pairs.
    GATED (gate/up): out[pair, n] = act(a . w[e, n] + b[e, n], a . w[e, N + n] + b[e, N + n]), in A's dtype;
    else (down): out[pair, n] = weight[pair] * (a . w[e, n] + b[e, n]), in float32."""
    tile, n_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_valid = pairs < num_pairs
    pairs = tl.where(pair_valid, pairs, 0).to(tl.int64)
    a_rows = pairs // rows_per_a
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < n_size
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GATED: the second half's outputs
    w_base = w_ptr + expert * stride_we
    for k in range(0, k_size, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_valid = offs_k < k_size
        a = tl.load(a_ptr + a_rows[:, None] * stride_at + offs_k[None, :],
                    mask=pair_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & n_valid[None, :]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_base + (n_size + offs_n[None, :]) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            up = tl.dot(a, w_up, up, input_precision=PRECISION)
    bias_base = bias_ptr + expert * (2 * n_size if GATED else n_size)
    if HAS_BIAS:
        acc += tl.load(bias_base + offs_n, mask=n_valid, other=0.0)[None, :].to(tl.float32)
        if GATED:
            up += tl.load(bias_base + n_size + offs_n, mask=n_valid, other=0.0)[None, :].to(tl.float32)
    out_mask = pair_valid[:, None] & n_valid[None, :]
    out_at = out_ptr + pairs[:, None] * stride_ot + offs_n[None, :]
    if GATED:
        if ACTIVATION == 0:  # silu(gate) * up
            acc = acc * tl.sigmoid(acc) * up
        else:  # swigluoai: clamped, (up + 1) * gate * sigmoid(alpha * gate)
            gate = tl.minimum(acc, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
            acc = (up + 1) * (gate * tl.sigmoid(gate * swiglu_alpha))
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        weight = tl.load(weights_ptr + pairs, mask=pair_valid, other=0.0).to(tl.float32)
        tl.store(out_at, acc * weight[:, None], mask=out_mask)


expert_gemm_kernel = Kernel(_expert_gemm)


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
    block_m = TILES["cuda" if x.device.type == "cuda" else "cpu"][0]
    num_pairs, x = num_tokens * top_k, x.contiguous()
    tiles = (*align_by_expert(topk_ids, num_experts, block_m), num_pairs)
    h = run_expert_gemm(x, w13, w13_bias, None, x.new_empty(num_pairs, inter), tiles, top_k, activation)
    out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # pairs elsewhere stay 0
    run_expert_gemm(h, w2, w2_bias, topk_weights.contiguous(), out, tiles, 1, activation)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


def run_expert_gemm(a: Tensor, w: Tensor, bias: Tensor | None, weights: Tensor | None, out: Tensor, tiles,
                 rows_per_a: int, activation: str) -> Tensor:
    """Gate/up where weights is None (w [E, 2N, K]), else down with the router weights (w [E, N, K])."""
    sorted_pairs, tile_experts, num_pairs = tiles
    block_m, block_n, block_k = TILES["cuda" if a.device.type == "cuda" else "cpu"]
    gated = weights is None
    n_size, k_size = w.shape[1] // 2 if gated else w.shape[1], w.shape[2]
    expert_gemm_kernel.on(a.device)[(len(tile_experts), -(-n_size // block_n))](
        a, w, bias if bias is not None else a, weights if weights is not None else a, out, sorted_pairs,
        tile_experts, num_pairs, rows_per_a, n_size, k_size, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        SWIGLU_ALPHA, SWIGLU_LIMIT, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated,
        ACTIVATION=ACTIVATION_IDS[activation], HAS_BIAS=bias is not None, PRECISION=dot_precision(a.dtype))
    return out
