// The pointwise work between the matmuls of a decode step, one pass over memory each, where eager PyTorch
// issues 5-12 ops (and as many dispatches and temporaries): RMSNorm, neox rotary in place, greedy argmax.
// Built and loaded by pagedmoe/layers/cpu_ops.py, which falls back to PyTorch where it cannot be.
#include "tile_gemm.h"

namespace {

using tile_gemm::BF16;
using tile_gemm::store;
using tile_gemm::to_float;

// HF's RMSNorm of one row: x * rsqrt(mean(x^2) + eps) in float32, rounded to the input dtype, then times the
// weight (out may be row).
template <typename T>
void rms_norm_row(const T *row, const T *weight, T *out, int64_t dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; i++) sum += to_float(row[i]) * to_float(row[i]);
    const float inverse = 1.0f / std::sqrt(sum / float(dim) + eps);
    for (int64_t i = 0; i < dim; i++) {
        T normed;
        store(normed, to_float(row[i]) * inverse);
        store(out[i], to_float(weight[i]) * to_float(normed));
    }
}

// `heads` rows of dim a token, tokens token_stride apart (q or k heads viewed in the qkv output: a copy to
// make them contiguous had cost more than the norm at a few rows); out is contiguous.
template <typename T>
void rms_norm_heads(const T *x, const T *weight, T *out, int64_t tokens, int64_t heads, int64_t token_stride,
                    int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * dim > 32768)
    for (int64_t r = 0; r < tokens * heads; r++)
        rms_norm_row(x + (r / heads) * token_stride + (r % heads) * dim, weight, out + r * dim, dim, eps);
}

template <typename T>
void rms_norm(const T *x, const T *weight, T *out, int64_t rows, int64_t dim, float eps, int num_threads) {
    rms_norm_heads(x, weight, out, rows, 1, dim, dim, eps, num_threads);
}

// x[h] = x * cos + rotate_half(x) * sin for one token's heads (adjacent) at its cos and sin rows, in place.
template <typename T>
void rotary_token(T *x, const float *cos, const float *sin, int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        T *v = x + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = to_float(v[i]), b = to_float(v[i + half]);
            store(v[i], a * cos[i] - b * sin[i]);
            store(v[i + half], b * cos[i + half] + a * sin[i + half]);
        }
    }
}

// x[t, h] = x * cos + rotate_half(x) * sin at position positions[t], in place; x's rows are row_stride apart
// (q and k may be views into the qkv projection's output); cos and sin are [max_positions, head_dim] float32.
template <typename T>
void rotary(T *x, const int64_t *positions, const float *cos_table, const float *sin_table, int64_t tokens,
            int64_t heads, int64_t row_stride, int64_t head_dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim > 32768)
    for (int64_t t = 0; t < tokens; t++)
        rotary_token(x + t * row_stride, cos_table + positions[t] * head_dim, sin_table + positions[t] * head_dim,
                     heads, head_dim);
}

// One token's K and V rows into its cache slot: cache is [2 * kv_heads, head_slots, head_dim] (K heads, then V).
template <typename T>
void write_kv_token(const T *k, const T *v, int64_t slot, T *cache, int64_t kv_heads, int64_t head_dim,
                    int64_t head_slots) {
    const size_t bytes = sizeof(T) * head_dim;
    for (int64_t h = 0; h < kv_heads; h++) {
        std::memcpy(cache + (h * head_slots + slot) * head_dim, k + h * head_dim, bytes);
        std::memcpy(cache + ((kv_heads + h) * head_slots + slot) * head_dim, v + h * head_dim, bytes);
    }
}

// New K and V rows into their cache slots; k and v are [tokens, kv_heads, head_dim] with rows k_stride / v_stride
// apart (views into qkv).
template <typename T>
void write_kv(const T *k, const T *v, int64_t k_stride, int64_t v_stride, const int64_t *slots, T *cache,
              int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t head_slots) {
    for (int64_t t = 0; t < tokens; t++)
        write_kv_token(k + t * k_stride, v + t * v_stride, slots[t], cache, kv_heads, head_dim, head_slots);
}

// The first index of each row's maximum (the first NaN if the row has one), as torch.argmax. Two vectorized
// passes (the max; whether any NaN, from the bits, since -ffast-math lets the compiler assume there is none),
// then a scan that stops at the answer.
int64_t argmax_row(const float *row, int64_t n) {
    float max = row[0];
    uint32_t nan_bits = 0;
#pragma omp simd reduction(max : max)
    for (int64_t i = 0; i < n; i++) max = std::fmax(max, row[i]);
    const uint32_t *bits = reinterpret_cast<const uint32_t *>(row);
#pragma omp simd reduction(| : nan_bits)
    for (int64_t i = 0; i < n; i++) nan_bits |= uint32_t((bits[i] & 0x7FFFFFFFu) > 0x7F800000u);
    for (int64_t i = 0; i < n; i++)
        if (nan_bits ? (bits[i] & 0x7FFFFFFFu) > 0x7F800000u : row[i] == max) return i;
    return 0;
}

}  // namespace

extern "C" void greedy_argmax_f32(const float *logits, int64_t *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n > 32768)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(logits + r * n, n);
}

#define EXPORT(SUFFIX, T)                                                                                       \
    extern "C" void rms_norm_##SUFFIX(const T *x, const T *weight, T *out, int64_t tokens, int64_t heads,       \
                                      int64_t token_stride, int64_t dim, float eps, int num_threads) {          \
        rms_norm_heads(x, weight, out, tokens, heads, token_stride, dim, eps, num_threads);                     \
    }                                                                                                           \
    extern "C" void rotary_##SUFFIX(T *x, const int64_t *positions, const float *cos, const float *sin,         \
                                    int64_t tokens, int64_t heads, int64_t row_stride, int64_t head_dim,        \
                                    int num_threads) {                                                          \
        rotary(x, positions, cos, sin, tokens, heads, row_stride, head_dim, num_threads);                       \
    }                                                                                                           \
    extern "C" void write_kv_##SUFFIX(const T *k, const T *v, int64_t k_stride, int64_t v_stride,               \
                                      const int64_t *slots, T *cache, int64_t tokens, int64_t kv_heads,         \
                                      int64_t head_dim, int64_t head_slots) {                                   \
        write_kv(k, v, k_stride, v_stride, slots, cache, tokens, kv_heads, head_dim, head_slots);               \
    }
EXPORT(f32, float)
EXPORT(bf16, BF16)
