// Decode attention over a paged KV cache that reads each sequence's blocks in place, with no gather.
// One layer's cache: [2 * num_kv_heads, num_blocks, block_size, head_dim], K heads then V heads.
// A work item is one (sequence, KV head): the scores of its query heads over the context, an exact
// softmax, then the probability-weighted sum of V, accumulated in float32. Each thread takes a run of whole
// items, and prefetches along the rows it will read (Ahead). A sliding-window layer
// (window > 0) attends the last `window` positions only; attention sinks (gpt-oss: one logit per query
// head) join each softmax's denominator and nothing else.
// Built and loaded by pagedmoe/layers/attention/cpu_kernel.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <memory>

#include <omp.h>

#include "../../csrc/tile_gemm.h"

namespace {

using tile_gemm::BF16;
using tile_gemm::fvec;
using tile_gemm::load;
using tile_gemm::store;
using tile_gemm::to_float;
using tile_gemm::VLEN;

struct Shape {
    int64_t num_seqs, max_blocks, num_kv_heads, group_size, num_blocks, block_size, head_dim, window;
};

// fn(std::integral_constant<int, count>) for a runtime count in [1, MAX].
template <int MAX, typename Fn>
void for_heads(int count, Fn fn) {
    if constexpr (MAX > 1)
        if (count < MAX) return for_heads<MAX - 1>(count, fn);
    fn(std::integral_constant<int, MAX>{});
}

// Head sizes known at compile time let the compiler keep a head's accumulators in registers.
template <int HEAD_DIM>
int64_t head_dim_of(const Shape &s) { return HEAD_DIM ? HEAD_DIM : s.head_dim; }

// One head's rows of positions t, t + 1, ... in order: a block's rows are adjacent, so a row costs an add and
// a block a table read. No division per row: a 64-bit divide takes up to 45 cycles on Zen 1.
template <typename T>
class Rows {
    const T *head = nullptr, *block_row = nullptr;
    const int64_t *table = nullptr;
    int64_t block = 0, offset = 0, block_size = 0, dim = 0;

  public:
    Rows() = default;
    Rows(const T *head, const int64_t *table, int64_t t, const Shape &s)
        : head(head), table(table), block(t / s.block_size), offset(t % s.block_size), block_size(s.block_size),
          dim(s.head_dim) {
        block_row = head + table[block] * block_size * dim;
    }
    const T *next() {
        if (offset == block_size) offset = 0, block_row = head + table[++block] * block_size * dim;
        return block_row + offset++ * dim;
    }
};

// The context one query attends: the whole sequence, or its last s.window positions.
inline int64_t first_position(int64_t len, const Shape &s) {
    return s.window > 0 ? std::max<int64_t>(0, len - s.window) : 0;
}

// The rows an item (sequence, KV head) reads: its context, once for K and once for V.
inline int64_t item_rows(const int64_t *seq_lens, int64_t item, const Shape &s) {
    const int64_t len = seq_lens[item / s.num_kv_heads];
    return len - first_position(len, s);
}

// How far ahead of its reads a thread prefetches into L2. Into L2, not L1: on a Zen 4 EPYC (AVX-512)
// prefetcht0 left the walk at 18.5 GB/s where prefetcht1 reached 24.3; 8-64 KB timed alike there.
constexpr int64_t PREFETCH_BYTES = 16384;

// One thread's reads in order, as one stream: for each of its items (sequence, KV head) the K rows of the
// context, then its V rows (pos 2 * item and 2 * item + 1). step() prefetches the row PREFETCH_BYTES ahead of
// the reads, one row a call (a block's worth at once fills the line-fill buffers and stalls the core), across
// passes and items, so memory stays busy while the thread computes and a pass starts on rows already in L2:
// 1.1-1.25x a layer against prefetching within each pass, on a Zen 4 EPYC at 16-64 sequences.
template <typename T>
class Ahead {
    const T *cache;
    const int64_t *block_tables, *seq_lens;
    const Shape &s;
    int64_t pos, end, left = 0;
    Rows<T> rows;

    // To the first pass from pos with rows to read, or to the end.
    void seek() {
        for (; pos < end; pos++) {
            const int64_t item = pos / 2, seq = item / s.num_kv_heads, len = seq_lens[seq];
            const int64_t head = pos % 2 * s.num_kv_heads + item % s.num_kv_heads;
            left = item_rows(seq_lens, item, s);
            if (left == 0) continue;
            const T *head_rows = cache + head * s.num_blocks * s.block_size * s.head_dim;
            rows = Rows<T>(head_rows, block_tables + seq * s.max_blocks, len - left, s);
            return;
        }
    }

  public:
    Ahead(const T *cache, const int64_t *block_tables, const int64_t *seq_lens, const Shape &s, int64_t first_item,
          int64_t end_item)
        : cache(cache), block_tables(block_tables), seq_lens(seq_lens), s(s), pos(2 * first_item), end(2 * end_item) {
        seek();
        for (int64_t i = 0; i < PREFETCH_BYTES / int64_t(sizeof(T) * s.head_dim); i++) step();
    }
    // Not inlined: GCC then versioned the generic path's loops on the stream's state, and the versions'
    // vectorized sums round differently, so an item's output depended on the items after it. No cost measured.
    __attribute__((noinline)) void step() {
        if (pos >= end) return;
        const char *row = reinterpret_cast<const char *>(rows.next());
        for (int64_t line = 0; line < int64_t(sizeof(T)) * s.head_dim; line += 64)
            __builtin_prefetch(row + line, 0, 2);
        if (--left == 0) pos++, seek();
    }
};

// Rows from position first to len, each call stepping the thread's prefetch stream (or none).
template <typename T>
class RowWalk {
    Rows<T> rows;
    Ahead<T> *ahead;

  public:
    RowWalk(const T *head, const int64_t *table, int64_t first, const Shape &s, Ahead<T> *ahead)
        : rows(head, table, first, s), ahead(ahead) {}
    const T *next() {
        if (ahead) ahead->step();
        return rows.next();
    }
};

// The generic path (any head size): one dot product per position and query head.
template <int HEAD_DIM, typename T>
void scores_of(const float *q, const T *k_head, const int64_t *table, int64_t first, int64_t len,
               const Shape &s, float *scores, Ahead<T> *ahead) {
    const int64_t dim = head_dim_of<HEAD_DIM>(s), n = len - first;
    RowWalk<T> rows(k_head, table, first, s, ahead);
    for (int64_t t = 0; t < n; t++) {
        const T *row = rows.next();
        for (int64_t g = 0; g < s.group_size; g++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; d++) dot += q[g * dim + d] * to_float(row[d]);
            scores[g * n + t] = dot;
        }
    }
}

// Each of `rows` rows of len scores (rows `stride` apart) to its softmax, in place; sinks (or nullptr):
// one more logit per row that counts in the denominator only.
void softmax_rows(float *scores, int64_t rows, int64_t len, int64_t stride, const float *sinks) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * stride, max = sinks ? sinks[r] : row[0];
#pragma omp simd reduction(max : max)
        for (int64_t t = 0; t < len; t++) max = std::fmax(max, row[t]);
#pragma omp simd
        for (int64_t t = 0; t < len; t++) row[t] = expf(row[t] - max);
        float sum = sinks ? expf(sinks[r] - max) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) sum += row[t];
        const float inverse = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) row[t] *= inverse;
    }
}

template <int HEAD_DIM, typename T>
void weighted_values(const float *probs, const T *v_head, const int64_t *table, int64_t first, int64_t len,
                     const Shape &s, float *acc, Ahead<T> *ahead) {
    const int64_t dim = head_dim_of<HEAD_DIM>(s), n = len - first;
    std::memset(acc, 0, sizeof(float) * s.group_size * dim);
    RowWalk<T> rows(v_head, table, first, s, ahead);
    for (int64_t t = 0; t < n; t++) {
        const T *row = rows.next();
        for (int64_t g = 0; g < s.group_size; g++)
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) acc[g * dim + d] += probs[g * n + t] * to_float(row[d]);
    }
}

// The fast path, for head sizes of whole vectors: q (scores) or the output (values) of up to HEADS query
// heads, PASS_VECTORS vectors in all, are held while each K or V row is loaded once for all of them. On
// AVX-512 they fit its registers; AVX2 takes twice its 16 registers (4 heads of 64) and the compiler keeps the
// rest in L1, which costs less than loading every K and V row once per query head (1.33-1.39x at 8-64
// sequences of 3 heads per KV head on an AVX2 EPYC, bit-identical).
constexpr int PASS_VECTORS = VLEN == 16 ? 16 : 32;
typedef int32_t ivec __attribute__((vector_size(VLEN * 4)));

// Lane permutations that fold two vectors a, b into one that holds the sums of adjacent pairs: of lanes within
// each 128-bit lane first (IN_: a's pairs, then b's, in each), then of whole 128-bit lanes (ACROSS_). Constants,
// so each is one shuffle instruction; the in-lane ones first, as a lane-crossing shuffle costs several times
// as much (on Zen 1 a variable vpermps took 4 cycles where vshufps takes 1).
#if defined(__AVX512F__)
constexpr ivec IN_EVEN = {0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30};
constexpr ivec ACROSS_EVEN = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
#else
constexpr ivec IN_EVEN = {0, 2, 8, 10, 4, 6, 12, 14};
constexpr ivec ACROSS_EVEN = {0, 1, 2, 3, 8, 9, 10, 11};
#endif
constexpr ivec IN_ODD = IN_EVEN + 1, ACROSS_ODD = ACROSS_EVEN + 4;

inline fvec fold(fvec a, fvec b, ivec even, ivec odd) {
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

// The lane sums of p[0..VLEN) as one vector, in order (p is overwritten): two in-lane folds take VLEN vectors
// to VLEN / 4, each holding 4 positions' sums per 128-bit lane; folds across lanes add those up.
inline fvec sum_lanes(fvec *p) {
    int n = VLEN;
    for (int level = 0; level < 2; level++, n /= 2)
        for (int i = 0; i < n / 2; i++) p[i] = fold(p[2 * i], p[2 * i + 1], IN_EVEN, IN_ODD);
    for (; n > 1; n /= 2)
        for (int i = 0; i < n / 2; i++) p[i] = fold(p[2 * i], p[2 * i + 1], ACROSS_EVEN, ACROSS_ODD);
    return p[0];
}

// scores[g][t - first] = q[g] . k[t] for HEADS query heads (q scaled, float32 [HEADS][N * VLEN]); scores
// rows are `stride` apart, stride >= len - first rounded up to VLEN.
template <int N, int HEADS, typename T>
void scores_pass(const float *q, const T *k_head, const int64_t *table, int64_t first, int64_t len,
                 const Shape &s, float *scores, int64_t stride, Ahead<T> *ahead) {
    fvec qv[HEADS][N], part[HEADS][VLEN];
    for (int g = 0; g < HEADS; g++)
        for (int n = 0; n < N; n++) qv[g][n] = load(q + (g * N + n) * VLEN);
    RowWalk<T> rows(k_head, table, first, s, ahead);
    for (int64_t base = 0; base < len - first; base += VLEN) {
        const int count = int(std::min<int64_t>(VLEN, len - first - base));
        for (int i = 0; i < VLEN; i++) {
            if (i == count) {
                for (int g = 0; g < HEADS; g++) std::fill(part[g] + i, part[g] + VLEN, fvec{});
                break;
            }
            const T *row = rows.next();
            fvec k[N];
            for (int n = 0; n < N; n++) k[n] = load(row + n * VLEN);
            for (int g = 0; g < HEADS; g++) {
                fvec dot = qv[g][0] * k[0];
                for (int n = 1; n < N; n++) dot += qv[g][n] * k[n];
                part[g][i] = dot;
            }
        }
        for (int g = 0; g < HEADS; g++) {
            const fvec sums = sum_lanes(part[g]);
            std::memcpy(scores + g * stride + base, &sums, sizeof sums);
        }
    }
}

// Vectors of accumulators a values sweep keeps in registers, beside one for V and one per head's probability.
constexpr int SUM_VECTORS = VLEN == 16 ? 16 : 12;

// The widest slice of a head, in vectors, whose HEADS heads' sums fit SUM_VECTORS (a divisor of N).
constexpr int slice_of(int n, int heads) {
    int slice = std::max(1, std::min(n, SUM_VECTORS / heads));
    while (n % slice) slice--;
    return slice;
}

// acc[g][slice] = sum over t of probs[g][t] * v[t][slice], for HEADS heads (probs rows `stride` apart) and the
// SLICE vectors of each row from vector n0.
template <int N, int SLICE, int HEADS, typename T>
void values_sweep(const float *probs, int64_t stride, const T *v_head, const int64_t *table, int64_t first,
                  int64_t len, const Shape &s, int n0, float *acc, Ahead<T> *ahead) {
    fvec sum[HEADS][SLICE];
    for (int g = 0; g < HEADS; g++)
        for (int n = 0; n < SLICE; n++) sum[g][n] = fvec{};
    RowWalk<T> rows(v_head, table, first, s, ahead);
    for (int64_t t = 0; t < len - first; t++) {
        const T *row = rows.next() + n0 * VLEN;
        fvec p[HEADS];
        for (int g = 0; g < HEADS; g++) p[g] = fvec{} + probs[g * stride + t];
        for (int n = 0; n < SLICE; n++) {  // one V vector live at a time, not SLICE: the sums stay in registers
            const fvec v = load(row + n * VLEN);
            for (int g = 0; g < HEADS; g++) sum[g][n] += p[g] * v;
        }
    }
    for (int g = 0; g < HEADS; g++)
        for (int n = 0; n < SLICE; n++) tile_gemm::store_vec(acc + (g * N + n0 + n) * VLEN, sum[g][n]);
}

// acc[g] = sum over t of probs[g][t] * v[t], for HEADS heads, a slice of each row per sweep: the sums of a
// whole row (24 vectors for 3 heads of 64 on AVX2) spilled to L1, and Zen 1 stores half a vector a cycle.
// Each sum still adds its positions in order, so the outputs do not depend on the slicing.
template <int N, int HEADS, typename T>
void values_pass(const float *probs, int64_t stride, const T *v_head, const int64_t *table, int64_t first,
                 int64_t len, const Shape &s, float *acc, Ahead<T> *ahead) {
    constexpr int SLICE = slice_of(N, HEADS);
    for (int n0 = 0; n0 < N; n0 += SLICE)
        values_sweep<N, SLICE, HEADS>(probs, stride, v_head, table, first, len, s, n0, acc, n0 ? nullptr : ahead);
}

// One (sequence, KV head) on the fast path, its query heads in passes of up to HEADS.
template <int N, int HEADS = std::max(1, PASS_VECTORS / N), typename T>
void attend_fast(const float *qf, const T *k_head, const T *v_head, const int64_t *table, int64_t first,
                 int64_t len, const Shape &s, const float *sinks, float *scores, float *acc, Ahead<T> *ahead) {
    const int64_t stride = (len - first + VLEN - 1) / VLEN * VLEN, dim = N * VLEN;
    for (int64_t g = 0; g < s.group_size; g += HEADS)
        for_heads<HEADS>(int(std::min<int64_t>(HEADS, s.group_size - g)), [&](auto heads) {
            scores_pass<N, heads.value>(qf + g * dim, k_head, table, first, len, s, scores + g * stride, stride,
                                        g ? nullptr : ahead);
        });
    softmax_rows(scores, s.group_size, len - first, stride, sinks);
    for (int64_t g = 0; g < s.group_size; g += HEADS)
        for_heads<HEADS>(int(std::min<int64_t>(HEADS, s.group_size - g)), [&](auto heads) {
            values_pass<N, heads.value>(scores + g * stride, stride, v_head, table, first, len, s, acc + g * dim,
                                        g ? nullptr : ahead);
        });
}

// Where thread k of n starts: items are split in order, whole, about total / n rows to a thread. Static, not
// claimed one by one, so that each thread knows what it reads next (Ahead).
inline int64_t thread_start(const int64_t *seq_lens, const Shape &s, int64_t total, int k, int n) {
    const int64_t items = s.num_seqs * s.num_kv_heads;
    if (k == n) return items;
    int64_t item = 0;
    for (int64_t seen = 0; item < items && seen * n < total * k; item++) seen += item_rows(seq_lens, item, s);
    return item;
}

// One item: the attention of its query heads over its context, into out.
template <int HEAD_DIM, typename T>
void attend_item(const T *q, const T *cache, const int64_t *block_tables, const int64_t *seq_lens, T *out,
                 const Shape &s, float scale, const float *sinks, int64_t item, Ahead<T> *ahead) {
    constexpr bool FAST = HEAD_DIM > 0 && HEAD_DIM % VLEN == 0;
    const int64_t head_stride = s.num_blocks * s.block_size * s.head_dim, width = s.group_size * s.head_dim;
    const int64_t seq = item / s.num_kv_heads, kv_head = item % s.num_kv_heads, len = seq_lens[seq];
    const int64_t first = first_position(len, s), stride = (len - first + VLEN - 1) / VLEN * VLEN;
    const int64_t *table = block_tables + seq * s.max_blocks;
    const float *head_sinks = sinks ? sinks + kv_head * s.group_size : nullptr;
    const std::unique_ptr<float[]> buffer(new float[2 * width + s.group_size * stride]);  // not zeroed
    float *qf = buffer.get(), *acc = qf + width, *scores = acc + width;
    for (int64_t i = 0; i < width; i++) qf[i] = to_float(q[item * width + i]) * scale;
    const T *k_head = cache + kv_head * head_stride, *v_head = cache + (s.num_kv_heads + kv_head) * head_stride;
    if constexpr (FAST) {
        attend_fast<HEAD_DIM / VLEN>(qf, k_head, v_head, table, first, len, s, head_sinks, scores, acc, ahead);
    } else {
        scores_of<HEAD_DIM>(qf, k_head, table, first, len, s, scores, ahead);
        softmax_rows(scores, s.group_size, len - first, len - first, head_sinks);
        weighted_values<HEAD_DIM>(scores, v_head, table, first, len, s, acc, ahead);
    }
    for (int64_t i = 0; i < width; i++) store(out[item * width + i], acc[i]);
}

template <int HEAD_DIM, typename T>
void paged_decode(const T *q, const T *cache, const int64_t *block_tables, const int64_t *seq_lens, T *out,
                  const Shape &s, float scale, const float *sinks, int num_threads) {
    int64_t total = 0;
    for (int64_t item = 0; item < s.num_seqs * s.num_kv_heads; item++) total += item_rows(seq_lens, item, s);
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t first = thread_start(seq_lens, s, total, t, n), end = thread_start(seq_lens, s, total, t + 1, n);
        Ahead<T> ahead(cache, block_tables, seq_lens, s, first, end);
        for (int64_t item = first; item < end; item++)
            attend_item<HEAD_DIM>(q, cache, block_tables, seq_lens, out, s, scale, sinks, item, &ahead);
    }
}

template <typename T>
void paged_decode_any(const T *q, const T *cache, const int64_t *block_tables, const int64_t *seq_lens, T *out,
                      const Shape &s, float scale, const float *sinks, int num_threads) {
    switch (s.head_dim) {
        case 32: return paged_decode<32>(q, cache, block_tables, seq_lens, out, s, scale, sinks, num_threads);
        case 64: return paged_decode<64>(q, cache, block_tables, seq_lens, out, s, scale, sinks, num_threads);
        case 96: return paged_decode<96>(q, cache, block_tables, seq_lens, out, s, scale, sinks, num_threads);
        case 128: return paged_decode<128>(q, cache, block_tables, seq_lens, out, s, scale, sinks, num_threads);
        default: return paged_decode<0>(q, cache, block_tables, seq_lens, out, s, scale, sinks, num_threads);
    }
}

}  // namespace

// sinks: float32 [num_kv_heads * group_size], or nullptr.
#define EXPORT(NAME, T)                                                                                   \
    extern "C" void NAME(const T *q, const T *cache, const int64_t *block_tables, const int64_t *seq_lens, \
                         T *out, Shape shape, float scale, const float *sinks, int num_threads) {          \
        paged_decode_any(q, cache, block_tables, seq_lens, out, shape, scale, sinks, num_threads);         \
    }
EXPORT(paged_decode_f32, float)
EXPORT(paged_decode_bf16, BF16)
