// Decode attention over a paged KV cache that reads each sequence's blocks in place, with no gather.
// One layer's cache: [2 * num_kv_heads, num_blocks, block_size, head_dim], K heads then V heads.
// A work item is one (sequence, KV head): the scores of its query heads over the whole context, an exact
// softmax, then the probability-weighted sum of V, accumulated in float32.
// Built and loaded by pagedmoe/layers/attention/cpu_kernel.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include "../../csrc/tile_gemm.h"

namespace {

using tile_gemm::BF16;
using tile_gemm::store;
using tile_gemm::to_float;

struct Shape {
    int64_t num_seqs, max_blocks, num_kv_heads, group_size, num_blocks, block_size, head_dim;
};

// Head sizes known at compile time let the compiler keep a head's accumulators in registers.
template <int HEAD_DIM>
int64_t head_dim_of(const Shape &s) { return HEAD_DIM ? HEAD_DIM : s.head_dim; }

template <typename T>
void prefetch_block(const T *head, const int64_t *table, int64_t block, const Shape &s) {
    const char *start = reinterpret_cast<const char *>(head + table[block] * s.block_size * s.head_dim);
    for (int64_t offset = 0; offset < int64_t(sizeof(T)) * s.block_size * s.head_dim; offset += 64)
        __builtin_prefetch(start + offset);
}

// Calls fn(rows, start, n) for each block of the context: n positions from start, rows [n, head_dim].
// Blocks are scattered, which the hardware prefetcher cannot follow: the next one is prefetched by hand.
template <typename T, typename Fn>
void for_each_block(const T *head, const int64_t *table, int64_t len, const Shape &s, Fn fn) {
    const int64_t num_blocks = (len + s.block_size - 1) / s.block_size;
    prefetch_block(head, table, 0, s);
    for (int64_t block = 0; block < num_blocks; block++) {
        if (block + 1 < num_blocks) prefetch_block(head, table, block + 1, s);
        const int64_t start = block * s.block_size;
        fn(head + table[block] * s.block_size * s.head_dim, start, std::min(len - start, s.block_size));
    }
}

template <int HEAD_DIM, typename T>
void scores_of(const float *q, const T *k_head, const int64_t *table, int64_t len, const Shape &s,
               float *scores) {
    const int64_t dim = head_dim_of<HEAD_DIM>(s);
    for_each_block(k_head, table, len, s, [&](const T *rows, int64_t start, int64_t n) {
        for (int64_t g = 0; g < s.group_size; g++) {
            const float *qg = q + g * dim;
            for (int64_t t = 0; t < n; t++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += qg[d] * to_float(rows[t * dim + d]);
                scores[g * len + start + t] = dot;
            }
        }
    });
}

void softmax_rows(float *scores, int64_t rows, int64_t len) {
    for (float *row = scores; row < scores + rows * len; row += len) {
        float max = row[0], sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int64_t t = 0; t < len; t++) max = std::fmax(max, row[t]);
#pragma omp simd
        for (int64_t t = 0; t < len; t++) row[t] = expf(row[t] - max);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) sum += row[t];
        const float inverse = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) row[t] *= inverse;
    }
}

template <int HEAD_DIM, typename T>
void weighted_values(const float *probs, const T *v_head, const int64_t *table, int64_t len, const Shape &s,
                     float *acc) {
    const int64_t dim = head_dim_of<HEAD_DIM>(s);
    std::memset(acc, 0, sizeof(float) * s.group_size * dim);
    for_each_block(v_head, table, len, s, [&](const T *rows, int64_t start, int64_t n) {
        for (int64_t g = 0; g < s.group_size; g++) {
            const float *p = probs + g * len + start;
            float *ag = acc + g * dim;
            for (int64_t t = 0; t < n; t++)
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) ag[d] += p[t] * to_float(rows[t * dim + d]);
        }
    });
}

template <int HEAD_DIM, typename T>
void paged_decode(const T *q, const T *cache, const int64_t *block_tables, const int64_t *seq_lens, T *out,
                  const Shape &s, float scale, int num_threads) {
    const int64_t head_stride = s.num_blocks * s.block_size * s.head_dim, width = s.group_size * s.head_dim;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < s.num_seqs * s.num_kv_heads; item++) {
        const int64_t seq = item / s.num_kv_heads, kv_head = item % s.num_kv_heads, len = seq_lens[seq];
        const int64_t *table = block_tables + seq * s.max_blocks;
        std::vector<float> buffer(2 * width + s.group_size * len);
        float *qf = buffer.data(), *acc = qf + width, *scores = acc + width;
        for (int64_t i = 0; i < width; i++) qf[i] = to_float(q[item * width + i]) * scale;
        scores_of<HEAD_DIM>(qf, cache + kv_head * head_stride, table, len, s, scores);
        softmax_rows(scores, s.group_size, len);
        weighted_values<HEAD_DIM>(scores, cache + (s.num_kv_heads + kv_head) * head_stride, table, len, s, acc);
        for (int64_t i = 0; i < width; i++) store(out[item * width + i], acc[i]);
    }
}

template <typename T>
void paged_decode_any(const T *q, const T *cache, const int64_t *block_tables, const int64_t *seq_lens, T *out,
                      const Shape &s, float scale, int num_threads) {
    switch (s.head_dim) {
        case 64: return paged_decode<64>(q, cache, block_tables, seq_lens, out, s, scale, num_threads);
        case 128: return paged_decode<128>(q, cache, block_tables, seq_lens, out, s, scale, num_threads);
        default: return paged_decode<0>(q, cache, block_tables, seq_lens, out, s, scale, num_threads);
    }
}

}  // namespace

#define EXPORT(NAME, T)                                                                                   \
    extern "C" void NAME(const T *q, const T *cache, const int64_t *block_tables, const int64_t *seq_lens, \
                         T *out, Shape shape, float scale, int num_threads) {                              \
        paged_decode_any(q, cache, block_tables, seq_lens, out, shape, scale, num_threads);                \
    }
EXPORT(paged_decode_f32, float)
EXPORT(paged_decode_bf16, BF16)
