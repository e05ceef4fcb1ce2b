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

namespace {

struct BF16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline void store(float &dst, float x) { dst = x; }
inline void store(BF16 &dst, float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    dst.bits = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Shape {
    int64_t num_seqs, max_blocks, num_kv_heads, group_size, num_blocks, block_size, head_dim;
};

// Calls fn(row, t) for each context position t, row pointing at its head_dim values in that head's blocks.
template <typename T, typename Fn>
void for_each_position(const T *head, const int64_t *table, int64_t len, const Shape &s, Fn fn) {
    for (int64_t start = 0; start < len; start += s.block_size) {
        const T *block = head + table[start / s.block_size] * s.block_size * s.head_dim;
        const int64_t end = std::min(len, start + s.block_size);
        for (int64_t t = start; t < end; t++) fn(block + (t - start) * s.head_dim, t);
    }
}

template <typename T>
void scores_of(const float *q, const T *k_head, const int64_t *table, int64_t len, const Shape &s,
               float *scores) {
    for_each_position(k_head, table, len, s, [&](const T *k, int64_t t) {
        for (int64_t g = 0; g < s.group_size; g++) {
            const float *qg = q + g * s.head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < s.head_dim; d++) dot += qg[d] * to_float(k[d]);
            scores[g * len + t] = dot;
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

template <typename T>
void weighted_values(const float *probs, const T *v_head, const int64_t *table, int64_t len, const Shape &s,
                     float *acc) {
    std::memset(acc, 0, sizeof(float) * s.group_size * s.head_dim);
    for_each_position(v_head, table, len, s, [&](const T *v, int64_t t) {
        for (int64_t g = 0; g < s.group_size; g++) {
            const float p = probs[g * len + t];
            float *ag = acc + g * s.head_dim;
#pragma omp simd
            for (int64_t d = 0; d < s.head_dim; d++) ag[d] += p * to_float(v[d]);
        }
    });
}

template <typename T>
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
        scores_of(qf, cache + kv_head * head_stride, table, len, s, scores);
        softmax_rows(scores, s.group_size, len);
        weighted_values(scores, cache + (s.num_kv_heads + kv_head) * head_stride, table, len, s, acc);
        for (int64_t i = 0; i < width; i++) store(out[item * width + i], acc[i]);
    }
}

}  // namespace

#define EXPORT(NAME, T)                                                                                   \
    extern "C" void NAME(const T *q, const T *cache, const int64_t *block_tables, const int64_t *seq_lens, \
                         T *out, Shape shape, float scale, int num_threads) {                              \
        paged_decode(q, cache, block_tables, seq_lens, out, shape, scale, num_threads);                    \
    }
EXPORT(paged_decode_f32, float)
EXPORT(paged_decode_bf16, BF16)
