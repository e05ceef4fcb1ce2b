"""Paged attention in Triton, one kernel for decodes, prefills and chunked prefills (the design of vLLM's
unified Triton attention): each program takes a tile of one sequence's query rows times the query heads of one
KV head (GQA: the group's heads share every K/V tile it loads), reads the sequence's block table in the kernel,
and runs an online softmax in float32 over the context, causal by position, so a query chunk attends the cached
prefix and itself in one pass. Long contexts split over several programs (split-K), whose partial maxima, sums
and outputs a reduce kernel combines. Sliding windows and attention sinks (gpt-oss) are masks and one more
term of the denominator. K and V are addressed separately, so MLA's latent cache (one head whose entry is
[latent | rope key], whose value is the latent) runs the same kernel."""
import triton.language as tl

from pagedmoe.layers.triton_utils import Kernel

MIN_DOT = 16  # tl.dot's smallest tile side on GPUs


def _paged_attention(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, block_tables_ptr,
                     seq_lens_ptr, query_starts_ptr, query_lens_ptr, sinks_ptr, scale, window,
                     stride_qt, stride_qh, stride_kh, stride_kb, stride_ko, stride_vh, stride_vb, stride_vo,
                     stride_ot, stride_oh, stride_table, num_tokens, num_heads, num_q_tiles,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr, DV: tl.constexpr,
                     DV_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
                     PRECISION: tl.constexpr):
    seq, q_tile = tl.program_id(0) // num_q_tiles, tl.program_id(0) % num_q_tiles
    kv_head, split = tl.program_id(1).to(tl.int64), tl.program_id(2)  # int64: offsets in a large pool
    seq_len = tl.load(seq_lens_ptr + seq)
    query_len = tl.load(query_lens_ptr + seq)
    if q_tile * BLOCK_Q >= query_len:
        return
    query_start = tl.load(query_starts_ptr + seq)
    # rows of the tile: BLOCK_Q query positions x GROUP_PAD heads of this KV head
    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_row = q_tile * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_valid = (q_row < query_len) & (offs_m % GROUP_PAD < GROUP)
    q_pos = seq_len - query_len + q_row  # the row's position in its sequence
    offs_dk, offs_dv = tl.arange(0, DK_PAD), tl.arange(0, DV_PAD)
    q = tl.load(q_ptr + (query_start + q_row)[:, None] * stride_qt + head[:, None] * stride_qh + offs_dk[None, :],
                mask=row_valid[:, None] & (offs_dk[None, :] < DK), other=0.0)

    # this split's share of the keys the tile can see (causal end; window start), in whole BLOCK_N tiles
    last_pos = seq_len - query_len + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)  # one past the last key
    first_pos = tl.where(window > 0, tl.maximum(seq_len - query_len + q_tile * BLOCK_Q - window + 1, 0), 0)
    first_tile = first_pos // BLOCK_N
    num_tiles = tl.cdiv(last_pos, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, first_tile + num_tiles)

    row_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DV_PAD], tl.float32)
    for tile in range(tile_begin, tile_end):
        key_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_valid = key_pos < last_pos
        block = tl.load(block_tables_ptr + seq * stride_table + key_pos // BLOCK_SIZE, mask=key_valid,
                        other=0).to(tl.int64)
        k_off = kv_head * stride_kh + block * stride_kb + (key_pos % BLOCK_SIZE) * stride_ko
        k = tl.load(k_ptr + k_off[:, None] + offs_dk[None, :], mask=key_valid[:, None] & (offs_dk[None, :] < DK),
                    other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        visible = visible & ((window == 0) | (key_pos[None, :] > q_pos[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that has seen no key yet
        probs = tl.exp(scores - safe_max[:, None])
        rescale = tl.exp(row_max - safe_max)
        v_off = kv_head * stride_vh + block * stride_vb + (key_pos % BLOCK_SIZE) * stride_vo
        v = tl.load(v_ptr + v_off[:, None] + offs_dv[None, :], mask=key_valid[:, None] & (offs_dv[None, :] < DV),
                    other=0.0)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        row_max = new_max

    token = query_start + q_row
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
            row_sum += tl.exp(sink - tl.where(row_max == float("-inf"), 0.0, row_max))
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (offs_dv[None, :] < DV))
    else:
        part = (split * num_tokens + token) * num_heads + head  # partials: [NUM_SPLITS, tokens, heads, ...]
        tl.store(part_max_ptr + part, row_max, mask=row_valid)
        tl.store(part_sum_ptr + part, row_sum, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * DV + offs_dv[None, :], acc,
                 mask=row_valid[:, None] & (offs_dv[None, :] < DV))


def _reduce_splits(part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, out_ptr, stride_ot, stride_oh,
                   num_tokens, num_heads, DV: tl.constexpr, DV_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """One (token, head) row: the splits' partial outputs rescaled to their common maximum and normalised."""
    token, head = tl.program_id(0), tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    part = (splits * num_tokens + token) * num_heads + head
    part_max = tl.load(part_max_ptr + part)
    top = tl.max(part_max, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(part_max - top)
    total = tl.sum(tl.load(part_sum_ptr + part) * weights, 0)
    if HAS_SINKS:
        total += tl.exp(tl.load(sinks_ptr + head).to(tl.float32) - top)
    offs_dv = tl.arange(0, DV_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * DV + offs_dv[None, :], mask=offs_dv[None, :] < DV, other=0.0)
    out = tl.sum(acc * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty),
             mask=offs_dv < DV)


paged_attention_kernel = Kernel(_paged_attention)
reduce_splits_kernel = Kernel(_reduce_splits)
