// y[m, n] = row_scale[n] * sum_k x[m, k] * w[n, k] for 4-bit E2M1 weights kept packed: codes [n, k / 2] (element
// 2j in the low nibble) with one scale byte per block of the row: MXFP4 (block 32, E8M0 2^(e - 127)) or NVFP4
// (block 16, float8 E4M3; row_scale is the tensor's scale_2, one per row so that merged projections keep their
// own). row_scale may be null (1). In the llama.cpp manner: each activation row
// is quantised to int8 per 32 (d = amax / 127), the nibbles become int8 by a 16-entry table of doubled values
// (0, 1, 2, 3, 4, 6, 8, 12 and negatives; the block scale halved to match), and a block's 32 products are
// summed in integers: AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd), or plain C++ elsewhere.
// The activations of a 32-block are stored even elements first, then odd ones, so that the low nibbles of
// its 16 weight bytes meet the even elements and the high nibbles the odd ones with no shuffle per weight.
// Built and loaded by pagedmoe/layers/quantization/fp4_kernel.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ACT_BLOCK = 32;
constexpr int ROWS = 4;  // activation rows that share each decoded weight block

struct Shape {
    int64_t m, n, k, block, scale_kind;  // scale_kind: 0 E8M0 (MXFP4), 1 E4M3 (NVFP4)
};

const int8_t DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
const float VALUES[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

float e4m3(uint8_t byte) {
    const int sign = byte >> 7, exponent = (byte >> 3) & 15, mantissa = byte & 7;
    if (exponent == 15 && mantissa == 7) return NAN;
    const float magnitude = exponent ? std::ldexp(1.0f + mantissa / 8.0f, exponent - 7)
                                     : std::ldexp(mantissa / 8.0f, -6);
    return sign ? -magnitude : magnitude;
}

// Scale byte -> float, for each kind; `half` tables fold in the 1/2 of the doubled integer values.
struct ScaleTables {
    float full[2][256], half[2][256];
    ScaleTables() {
        for (int b = 0; b < 256; b++) {
            full[0][b] = b == 255 ? NAN : std::ldexp(1.0f, b - 127);
            full[1][b] = e4m3(uint8_t(b));
            for (int kind = 0; kind < 2; kind++) half[kind][b] = full[kind][b] * 0.5f;
        }
    }
};
const ScaleTables SCALES;

// x [m, k] float32 -> q [m, k] int8 (each 32-block evens then odds) and d [m, k / 32].
void quantize_rows(const float *x, const Shape &s, int8_t *q, float *d) {
    const int64_t blocks = s.k / ACT_BLOCK;
    for (int64_t i = 0; i < s.m * blocks; i++) {
        const float *src = x + i * ACT_BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < ACT_BLOCK; j++) amax = std::max(amax, std::fabs(src[j]));
        d[i] = amax / 127.0f;
        const float inverse = amax > 0 ? 127.0f / amax : 0.0f;
        for (int j = 0; j < ACT_BLOCK; j++)
            q[i * ACT_BLOCK + (j % 2) * 16 + j / 2] = int8_t(std::nearbyint(src[j] * inverse));
    }
}

// The weight scales of one 32-block, one per 4-element lane group as the integer dot products leave them:
// lanes 0-1 and 4-5 hold the first 16 elements, lanes 2-3 and 6-7 the second (NVFP4 has a scale per 16).
inline void lane_scales(const uint8_t *scales, int64_t b, const Shape &s, float *out) {
    const float *table = SCALES.half[s.scale_kind];
    const float first = table[scales[s.block == 16 ? 2 * b : b]];
    const float second = s.block == 16 ? table[scales[2 * b + 1]] : first;
    for (int lane = 0; lane < 8; lane++) out[lane] = lane % 4 < 2 ? first : second;
}

#if defined(__AVX2__)
inline __m256i decode_block(const uint8_t *codes) {
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i *>(DOUBLED));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(codes)), low = _mm_set1_epi8(0x0F);
    const __m128i evens = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low));
    const __m128i odds = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    return _mm256_set_m128i(odds, evens);
}

// 8 int32 lanes, each the sum of 4 products of w and x.
inline __m256i dot_lanes(__m256i w, __m256i x) {
    const __m256i magnitude = _mm256_sign_epi8(w, w), signed_x = _mm256_sign_epi8(x, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1));
#endif
}

inline float sum_lanes(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}

template <int R>
void dot_row(const int8_t *q, const float *d, const uint8_t *codes, const uint8_t *scales, const Shape &s,
             float *sums) {
    const int64_t blocks = s.k / ACT_BLOCK;
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    alignas(32) float lanes[8];
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i w = decode_block(codes + b * 16);
        lane_scales(scales, b, s, lanes);
        const __m256 ws = _mm256_load_ps(lanes);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q + (r * blocks + b) * ACT_BLOCK));
            const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(d[r * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(w, x)), scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = sum_lanes(acc[r]);
}
#else
template <int R>
void dot_row(const int8_t *q, const float *d, const uint8_t *codes, const uint8_t *scales, const Shape &s,
             float *sums) {
    const int64_t blocks = s.k / ACT_BLOCK;
    float lanes[8];
    for (int r = 0; r < R; r++) sums[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        lane_scales(scales, b, s, lanes);
        for (int r = 0; r < R; r++) {
            const int8_t *x = q + (r * blocks + b) * ACT_BLOCK;
            for (int lane = 0; lane < 8; lane++) {
                int32_t dot = 0;
                for (int j = lane * 4; j < lane * 4 + 4; j++) {
                    const uint8_t byte = codes[b * 16 + j % 16];
                    dot += int32_t(x[j]) * DOUBLED[j < 16 ? byte & 15 : byte >> 4];
                }
                sums[r] += float(dot) * lanes[lane] * d[r * blocks + b];
            }
        }
    }
}
#endif

// Rows [r0, r0 + R) of the activations against output rows [n0, n1).
template <int R>
void dot_rows(const int8_t *q, const float *d, const uint8_t *codes, const uint8_t *scales, const Shape &s,
              int64_t r0, int64_t n0, int64_t n1, const float *row_scale, float *out) {
    const int64_t blocks = s.k / ACT_BLOCK;
    float sums[R];
    for (int64_t n = n0; n < n1; n++) {
        dot_row<R>(q + r0 * s.k, d + r0 * blocks, codes + n * s.k / 2, scales + n * (s.k / s.block), s, sums);
        const float scale = row_scale ? row_scale[n] : 1.0f;
        for (int r = 0; r < R; r++) out[(r0 + r) * s.n + n] = sums[r] * scale;
    }
}

constexpr int64_t ROW_CHUNK = 16;

void fp4_gemm_impl(const float *x, const uint8_t *codes, const uint8_t *scales, const float *row_scale, float *out,
                   const Shape &s, int num_threads) {
    std::vector<int8_t> q(s.m * s.k);
    std::vector<float> d(s.m * (s.k / ACT_BLOCK));
    quantize_rows(x, s, q.data(), d.data());
    const int64_t chunks = (s.n + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * ROW_CHUNK, n1 = std::min(s.n, n0 + ROW_CHUNK);
        int64_t r0 = 0;
        for (; r0 + ROWS <= s.m; r0 += ROWS)
            dot_rows<ROWS>(q.data(), d.data(), codes, scales, s, r0, n0, n1, row_scale, out);
        for (; r0 < s.m; r0++) dot_rows<1>(q.data(), d.data(), codes, scales, s, r0, n0, n1, row_scale, out);
    }
}

}  // namespace

extern "C" {

// x float32 [m, k] (k a multiple of 32), codes uint8 [n, k / 2], scales uint8 [n, k / block], row_scale
// float32 [n] or null, out float32 [m, n].
void fp4_gemm(const float *x, const uint8_t *codes, const uint8_t *scales, const float *row_scale, float *out,
              Shape shape, int num_threads) {
    fp4_gemm_impl(x, codes, scales, row_scale, out, shape, num_threads);
}

// Rows [row0, row0 + rows) of the weight decoded to float32 [rows, k]: (block scale * row scale) * value, as
// the PyTorch decoders compute it.
void fp4_dequantize_rows(const uint8_t *codes, const uint8_t *scales, const float *row_scale, float *out, Shape s,
                         int64_t row0, int64_t rows, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = codes + (row0 + r) * s.k / 2, *row_scales = scales + (row0 + r) * (s.k / s.block);
        const float out_scale = row_scale ? row_scale[row0 + r] : 1.0f;
        for (int64_t j = 0; j < s.k; j++) {
            const float scale = SCALES.full[s.scale_kind][row_scales[j / s.block]] * out_scale;
            out[r * s.k + j] = scale * VALUES[j % 2 ? row[j / 2] >> 4 : row[j / 2] & 15];
        }
    }
}

int fp4_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
}
