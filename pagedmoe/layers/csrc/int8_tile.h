// int8 dot products for the greedy head's approximate logits (layers/greedy_head.py, linear.cpp's
// linear_i8_to_f32): x and W in [-127, 127], x as bytes (its values plus I8_OFFSET), W packed
// [N / I8_PANEL, K / 4, I8_PANEL, 4], so one 32-bit lane sums 4 k-steps of one column in int32, exactly.
// VNNI (avx512_vnni, avx_vnni) does it in one instruction, unsigned x (offset 128) times signed W; plain
// AVX2 / AVX-512BW in four: vpmaddubsw of |x| and W with x's signs (its int16 pair sums saturate, but
// 2 * 127 * 127 fits), then vpmaddwd against ones. Elsewhere HAS_I8 is false.
#pragma once
#include "tile_gemm.h"

namespace tile_gemm {

#if defined(__AVX512BW__) || defined(__AVX2__)
constexpr bool HAS_I8 = true;
#if defined(__AVX512BW__)
typedef __m512i ivec;
constexpr int I8_LANES = 16, I8_MAX_ROWS = 12;
inline ivec i8_load(const void *p) { return _mm512_loadu_si512(p); }
inline ivec i8_broadcast(int32_t v) { return _mm512_set1_epi32(v); }
#if defined(__AVX512VNNI__)
constexpr int I8_OFFSET = 128;
inline ivec dot4(ivec acc, ivec a, ivec b) { return _mm512_dpbusd_epi32(acc, a, b); }
#else
constexpr int I8_OFFSET = 0;
inline ivec dot4(ivec acc, ivec a, ivec b) {  // AVX-512BW has no vpsignb: x's signs by a mask
    const __mmask64 negative = _mm512_movepi8_mask(a);
    const ivec signed_b = _mm512_mask_sub_epi8(b, negative, _mm512_setzero_si512(), b);
    const ivec products = _mm512_maddubs_epi16(_mm512_abs_epi8(a), signed_b);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(products, _mm512_set1_epi16(1)));
}
#endif
#else
typedef __m256i ivec;
constexpr int I8_LANES = 8, I8_MAX_ROWS = 4;  // 8 sums, 2 weights, x, |x|, ones and 2 products: 15 of 16
inline ivec i8_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
inline ivec i8_broadcast(int32_t v) { return _mm256_set1_epi32(v); }
#if defined(__AVXVNNI__)
constexpr int I8_OFFSET = 128;
inline ivec dot4(ivec acc, ivec a, ivec b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#else
constexpr int I8_OFFSET = 0;
inline ivec dot4(ivec acc, ivec a, ivec b) {
    const ivec products = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(b, a));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(products, _mm256_set1_epi16(1)));
}
#endif
#endif
constexpr int I8_PANEL = 2 * I8_LANES;
typedef int32_t isum __attribute__((vector_size(I8_LANES * 4)));
inline void i8_store(int32_t *p, isum v) { std::memcpy(p, &v, sizeof v); }  // by value: see store_vec

// acc[M][I8_PANEL] = rows a[0..M) (K bytes each, K a multiple of 4) times one packed panel b, in int32.
template <int M>
void i8_panel_tile(const uint8_t *const *a, const int8_t *b, int64_t K, int32_t *acc) {
    // GCC vector types stored by value (as tile_gemm.h's): else GCC kept the sums in memory, stored every k-step
    isum c0[M], c1[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) c0[m] = c1[m] = isum{};
    for (int64_t k = 0; k < K; k += 4) {
        const int8_t *bk = b + k * I8_PANEL;
        prefetch_ahead(bk, 4 * I8_PANEL);
        const ivec b0 = i8_load(bk), b1 = i8_load(bk + 4 * I8_LANES);
        for (int m = 0; m < M; m++) {
            int32_t quad;
            std::memcpy(&quad, a[m] + k, sizeof quad);
            const ivec av = i8_broadcast(quad);
            c0[m] = isum(dot4(ivec(c0[m]), av, b0)), c1[m] = isum(dot4(ivec(c1[m]), av, b1));
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) i8_store(acc + m * I8_PANEL, c0[m]), i8_store(acc + m * I8_PANEL + I8_LANES, c1[m]);
}

template <int... Ms>
void i8_tile_of(int rows, const uint8_t *const *a, const int8_t *b, int64_t K, int32_t *acc,
                std::integer_sequence<int, Ms...>) {
    ((rows == Ms + 1 ? i8_panel_tile<Ms + 1>(a, b, K, acc) : void()), ...);
}

inline void i8_tile(int rows, const uint8_t *const *a, const int8_t *b, int64_t K, int32_t *acc) {
    i8_tile_of(rows, a, b, K, acc, std::make_integer_sequence<int, I8_MAX_ROWS>{});
}
#else
constexpr bool HAS_I8 = false;
constexpr int I8_PANEL = 32, I8_MAX_ROWS = 1, I8_OFFSET = 0;
inline void i8_tile(int, const uint8_t *const *, const int8_t *, int64_t, int32_t *) {}
#endif

}  // namespace tile_gemm
