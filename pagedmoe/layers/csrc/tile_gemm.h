// The register-tile GEMM shared by the CPU kernels (layers/moe/csrc/fused_moe.cpp, layers/csrc/linear.cpp).
// Weights are packed [N / PANEL, K, PANEL] (bf16 with avx512_bf16: [N / PANEL, K / 2, PANEL, 2]), so one tile
// of up to MAX_ROWS rows streams its panel once, prefetched ahead. Plain C++ with GCC vector types: the compiler
// emits AVX-512 or AVX2 (or SSE) for the target it is built for.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <utility>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tile_gemm {

struct BF16 { uint16_t bits; };

#if defined(__AVX512F__)
constexpr int VLEN = 16, MAX_ROWS = 12;  // 24 accumulators of 32 registers
#else
constexpr int VLEN = 8, MAX_ROWS = 6;  // 12 accumulators of 16 registers
#endif
constexpr int NV = 2, PANEL = NV * VLEN, HALF = PANEL / 2;
// The hardware prefetcher alone leaves the stream at half the memory bandwidth once a tile has 4+ rows of
// FMAs per weight; prefetching ahead into L2 keeps it near the peak. 16 KB ahead where AVX-512 runs (measured:
// 8-32 KB similar); 4 KB on AVX2, where 16 KB was 1-5% slower at 1-20 rows on a Zen 1 EPYC (1-8 KB alike,
// 64 KB slower still).
constexpr int64_t PREFETCH_BYTES = VLEN == 16 ? 16 * 1024 : 4 * 1024;

// Prefetches into L2 the bytes the tile will read PREFETCH_BYTES after the bytes at p.
inline void prefetch_ahead(const void *p, int bytes) {
    const char *ahead = static_cast<const char *>(p) + PREFETCH_BYTES;
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch(ahead + line, 0, 2);
}

typedef float fvec __attribute__((vector_size(VLEN * 4)));
typedef uint16_t hvec __attribute__((vector_size(VLEN * 2)));
typedef uint32_t uvec __attribute__((vector_size(VLEN * 4)));

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// By value, so that a tile's accumulators stay registers: memcpy from their array made it addressable, and GCC
// then zeroed the array with a memset call before every tile (1.2-1.5% of a decode step, never read).
inline void store_vec(float *p, fvec v) { std::memcpy(p, &v, sizeof v); }

inline fvec load(const float *p) {
    fvec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline fvec load(const BF16 *p) {  // widened by one zero-extending load where there are intrinsics for it
#if defined(__AVX512F__)
    return fvec(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif defined(__AVX2__)
    return fvec(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    hvec h;
    std::memcpy(&h, p, sizeof h);
    const uvec u = __builtin_convertvector(h, uvec) << 16;
    fvec v;
    std::memcpy(&v, &u, sizeof v);
    return v;
#endif
}

inline void store(float &dst, float x) { dst = x; }
inline void store(BF16 &dst, float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    dst.bits = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}


// acc[M][PANEL] = rows a[0..M) (K values each) times one packed panel b ([K][PANEL]).
inline float silu(float g) { return g / (1.0f + expf(-g)); }

// gpt-oss's clamped SwiGLU: (up + 1) * gate * sigmoid(1.702 gate), gate clamped above and up both ways at 7.
inline float swigluoai(float gate, float up) {
    gate = std::fmin(gate, 7.0f), up = std::fmax(std::fmin(up, 7.0f), -7.0f);
    return (up + 1.0f) * (gate / (1.0f + expf(-1.702f * gate)));
}

// out[0..HALF) = activation(gate, up) for one row of a gate-up tile (its first HALF columns gate, the rest
// up). In float first, so the activation vectorises for bf16 outputs too (one vector exp, not HALF scalar ones).
template <typename T, typename Activation>
inline void store_activation(T *out, const float *acc_row, Activation activation) {
    alignas(64) float act[HALF];
#pragma omp simd
    for (int c = 0; c < HALF; c++) act[c] = activation(acc_row[c], acc_row[HALF + c]);
    for (int c = 0; c < HALF; c++) store(out[c], act[c]);
}

// out[0..HALF) = silu(gate) * up.
template <typename T>
inline void store_gated(T *out, const float *acc_row) {
    store_activation(out, acc_row, [](float gate, float up) { return silu(gate) * up; });
}

// The same for P adjacent panels at once (acc[P][M][PANEL]; panel p at b + p * K * PANEL): a tile of 1-3 rows
// has too few accumulator chains to hide the FMA latency (one row: a k-step per 4 cycles where 6 rows take
// 6), so its remainder rows take 2-4 panels per pass. Each column still sums its k-steps in order: the
// outputs are bit-identical to P one-panel passes.
// warm: the panels are in L2 (an earlier block's pass read them), so each is prefetched ahead into L1; from
// memory, only the last one is, the hardware prefetcher keeping up with the others' streams.
template <int M, int P, typename A, typename W>
void panel_tile(const A *const *a, const W *b, int64_t K, float *acc, bool warm = true) {
    fvec c[P][M][NV];
    for (int p = 0; p < P; p++)
        for (int m = 0; m < M; m++)
            for (int v = 0; v < NV; v++) c[p][m][v] = fvec{};
    for (int64_t k = 0; k < K; k++) {
        for (int p = 0; p < P; p++) {
            const W *bk = b + (p * K + k) * PANEL;
            if (warm || p == P - 1) prefetch_ahead(bk, int(PANEL * sizeof(W)));
            fvec bv[NV];
            for (int v = 0; v < NV; v++) bv[v] = load(bk + v * VLEN);
            for (int m = 0; m < M; m++) {
                const float av = to_float(a[m][k]);
                for (int v = 0; v < NV; v++) c[p][m][v] += av * bv[v];
            }
        }
    }
    for (int p = 0; p < P; p++)
        for (int m = 0; m < M; m++)
            for (int v = 0; v < NV; v++) store_vec(acc + (p * M + m) * PANEL + v * VLEN, c[p][m][v]);
}

#if defined(__AVX512BF16__)
constexpr bool PAIRS = true;
// The same tile with avx512_bf16's dot products of k-pairs: b is packed [K / 2][PANEL][2], so one
// instruction does 2 k-steps of 16 columns, with no widening of the weights.
template <int M>
void panel_tile_pairs(const BF16 *const *a, const BF16 *b, int64_t K, float *acc) {
    __m512 c[M][NV];
    for (int m = 0; m < M; m++)
        for (int v = 0; v < NV; v++) c[m][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        prefetch_ahead(b + k * PANEL, int(2 * PANEL * sizeof(BF16)));
        __m512bh bv[NV];
        for (int v = 0; v < NV; v++) bv[v] = (__m512bh)_mm512_loadu_si512(b + k * PANEL + v * 2 * VLEN);
        for (int m = 0; m < M; m++) {
            uint32_t pair;
            std::memcpy(&pair, a[m] + k, sizeof pair);
            const __m512bh av = (__m512bh)_mm512_set1_epi32(int(pair));
            for (int v = 0; v < NV; v++) c[m][v] = _mm512_dpbf16_ps(c[m][v], av, bv[v]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc + m * PANEL + v * VLEN, c[m][v]);
}
#else
constexpr bool PAIRS = false;
template <int M>
void panel_tile_pairs(const BF16 *const *, const BF16 *, int64_t, float *) {}
#endif

template <typename A, typename W, int... Ms>
void tile_of(int rows, const A *const *a, const W *b, int64_t K, float *acc,
             std::integer_sequence<int, Ms...>) {
    if constexpr (PAIRS && std::is_same_v<A, BF16> && std::is_same_v<W, BF16>)
        ((rows == Ms + 1 ? panel_tile_pairs<Ms + 1>(a, b, K, acc) : void()), ...);
    else
        ((rows == Ms + 1 ? panel_tile<Ms + 1, 1>(a, b, K, acc) : void()), ...);
}

template <typename A, typename W>
void tile(int rows, const A *const *a, const W *b, int64_t K, float *acc) {
    tile_of(rows, a, b, K, acc, std::make_integer_sequence<int, MAX_ROWS>{});
}

// How many adjacent panels a tile of rows takes at once: enough for 8 accumulator chains (2 FMA units of
// latency 4), up to 4 panels; 1 where the pair kernel runs (its accumulators already take 2 k-steps).
// panels * rows stays <= 6 <= MAX_ROWS, so a one-block acc holds every panel's tile.
template <typename A, typename W>
constexpr int panels_per_tile(int rows) {
    if (PAIRS && std::is_same_v<A, BF16> && std::is_same_v<W, BF16>) return 1;
    return rows == 1 ? 4 : rows <= 3 ? 2 : 1;
}

// acc[p][rows][PANEL] = rows a times each of panels b .. b + (panels - 1) * K * PANEL (panels at most
// panels_per_tile(rows)); warm: the panels are in L2.
template <typename A, typename W>
void tile_panels(int rows, int panels, const A *const *a, const W *b, int64_t K, float *acc, bool warm) {
    if (panels == 1) return tile(rows, a, b, K, acc);
    if constexpr (panels_per_tile<A, W>(1) > 1) {
        const int key = rows * 8 + panels;
        switch (key) {
            case 1 * 8 + 2: return panel_tile<1, 2>(a, b, K, acc, warm);
            case 1 * 8 + 3: return panel_tile<1, 3>(a, b, K, acc, warm);
            case 1 * 8 + 4: return panel_tile<1, 4>(a, b, K, acc, warm);
            case 2 * 8 + 2: return panel_tile<2, 2>(a, b, K, acc, warm);
            case 3 * 8 + 2: return panel_tile<3, 2>(a, b, K, acc, warm);
        }
    }
    for (int p = 0; p < panels; p++) tile(rows, a, b + p * K * PANEL, K, acc + p * rows * PANEL);
}

}  // namespace tile_gemm
