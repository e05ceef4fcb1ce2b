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

#include "../../csrc/tile_gemm.h"

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

// Scale byte -> float, for each kind; `half` tables fold in the 1/2 of the doubled integer values; pairs: a
// code byte -> its two values (low nibble first).
struct ScaleTables {
    float full[2][256], half[2][256], pairs[256][2];
    ScaleTables() {
        for (int b = 0; b < 256; b++) {
            full[0][b] = b == 255 ? NAN : std::ldexp(1.0f, b - 127);
            full[1][b] = e4m3(uint8_t(b));
            for (int kind = 0; kind < 2; kind++) half[kind][b] = full[kind][b] * 0.5f;
            pairs[b][0] = VALUES[b & 15], pairs[b][1] = VALUES[b >> 4];
        }
    }
};
const ScaleTables SCALES;

// x [m, k] float32 -> q [m, k] int8 (each 32-block evens then odds) and d [m, k / 32].
void quantize_rows(const float *x, const Shape &s, int8_t *q, float *d, int num_threads = 1) {
    const int64_t blocks = s.k / ACT_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (s.m * blocks >= 1024)
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

inline __m256 block_scales(const uint8_t *scales, int64_t b, const Shape &s) {
    if (s.block == 32) return _mm256_set1_ps(SCALES.half[s.scale_kind][scales[b]]);
    alignas(32) float lanes[8];
    lane_scales(scales, b, s, lanes);
    return _mm256_load_ps(lanes);
}

// 32-blocks [b0, b1) of R activation rows against one weight row, into 8-lane accumulators.
template <int R>
void dot_blocks(const int8_t *q, const float *d, const uint8_t *codes, const uint8_t *scales, const Shape &s,
                int64_t b0, int64_t b1, __m256 *acc) {
    const int64_t blocks = s.k / ACT_BLOCK;
    for (int64_t b = b0; b < b1; b++) {
        const __m256i w = decode_block(codes + b * 16);
        const __m256 ws = block_scales(scales, b, s);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q + (r * blocks + b) * ACT_BLOCK));
            const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(d[r * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(w, x)), scale, acc[r]);
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// Two 32-blocks' weights as one 512-bit vector: [block 0 evens, block 0 odds, block 1 evens, block 1 odds].
inline __m512i decode_pair(const uint8_t *codes) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(DOUBLED)));
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(codes)), low = _mm256_set1_epi8(0x0F);
    const __m256i evens = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, low));
    const __m256i odds = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low));
    const __m512i order = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    return _mm512_permutex2var_epi64(_mm512_castsi256_si512(evens), order, _mm512_castsi256_si512(odds));
}

inline __m512 two_halves(__m256 first, __m256 second) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(first), second, 1);
}

// 512 bits a step: vpdpbusd multiplies unsigned by signed bytes, so the activations enter as q + 128 and each
// lane's sum starts at -128 * (its weights' sum), which one more vpdpbusd (by ones) gives for all rows.
template <int R>
void dot_row(const int8_t *q, const float *d, const uint8_t *codes, const uint8_t *scales, const Shape &s,
             float *sums) {
    const int64_t blocks = s.k / ACT_BLOCK, pairs = blocks / 2;
    const __m512i flip = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    __m512 acc[R];
    __m256 tail[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), tail[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512i w = decode_pair(codes + p * 32);
        const __m512i start = _mm512_sub_epi32(zero, _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, w), 7));
        const __m512 ws = two_halves(block_scales(scales, 2 * p, s), block_scales(scales, 2 * p + 1, s));
        for (int r = 0; r < R; r++) {
            const __m512i x = _mm512_loadu_si512(q + (r * blocks + 2 * p) * ACT_BLOCK);
            const __m512i dot = _mm512_dpbusd_epi32(start, _mm512_xor_si512(x, flip), w);
            const float *dr = d + r * blocks + 2 * p;
            const __m512 scale = _mm512_mul_ps(ws, two_halves(_mm256_set1_ps(dr[0]), _mm256_set1_ps(dr[1])));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
        }
    }
    dot_blocks<R>(q, d, codes, scales, s, 2 * pairs, blocks, tail);
    for (int r = 0; r < R; r++) sums[r] = _mm512_reduce_add_ps(acc[r]) + sum_lanes(tail[r]);
}
#else
template <int R>
void dot_row(const int8_t *q, const float *d, const uint8_t *codes, const uint8_t *scales, const Shape &s,
             float *sums) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    dot_blocks<R>(q, d, codes, scales, s, 0, s.k / ACT_BLOCK, acc);
    for (int r = 0; r < R; r++) sums[r] = sum_lanes(acc[r]);
}
#endif
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
    quantize_rows(x, s, q.data(), d.data(), num_threads);
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

// The routed experts of one MoE layer on 4-bit weights, in one call (as layers/moe/csrc/fused_moe.cpp does for
// float weights): the pairs (token, slot) bucketed by expert, each expert's rows quantised once and run
// against its gate_up rows, the activation (silu(gate) * up, or gpt-oss's clamped swigluoai) on float32 with the
// biases, then the down rows, then the router-weighted sum per token.
struct MoeShape {
    int64_t num_tokens, top_k, num_experts, hidden, inter, block, scale_kind, activation;
};

struct Fp4Experts {  // [experts, rows, k] packed as PackedFp4Weight; row_scale and bias float32 or null
    const uint8_t *codes, *scales;
    const float *row_scale, *bias;
};

struct PairBuckets {
    std::vector<int64_t> start, pairs, position;  // expert e's pairs: pairs[start[e]:start[e + 1]]
};

PairBuckets bucket_pairs(const int64_t *topk_ids, const MoeShape &s) {
    const int64_t num_pairs = s.num_tokens * s.top_k;
    PairBuckets b{std::vector<int64_t>(s.num_experts + 1, 0), {}, std::vector<int64_t>(num_pairs, -1)};
    for (int64_t p = 0; p < num_pairs; p++)
        if (topk_ids[p] >= 0 && topk_ids[p] < s.num_experts) b.start[topk_ids[p] + 1]++;
    for (int64_t e = 0; e < s.num_experts; e++) b.start[e + 1] += b.start[e];
    b.pairs.resize(b.start.back());
    std::vector<int64_t> fill(b.start.begin(), b.start.end() - 1);
    for (int64_t p = 0; p < num_pairs; p++)
        if (topk_ids[p] >= 0 && topk_ids[p] < s.num_experts) {
            b.position[p] = fill[topk_ids[p]]++;
            b.pairs[b.position[p]] = p;
        }
    return b;
}

// out[i, :] for each sorted pair i = its quantised row (q, d, sorted) against expert(i)'s rows of w: [n, k].
void experts_matmul(const int8_t *q, const float *d, const Fp4Experts &w, int64_t n, int64_t k,
                    const PairBuckets &b, const MoeShape &ms, float *out, int num_threads) {
    const Shape s{0, n, k, ms.block, ms.scale_kind};
    const int64_t chunks = (n + ROW_CHUNK - 1) / ROW_CHUNK, blocks = k / ACT_BLOCK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < ms.num_experts * chunks; task++) {
        const int64_t e = task / chunks, n0 = task % chunks * ROW_CHUNK, n1 = std::min(n, n0 + ROW_CHUNK);
        const int64_t first = b.start[e], count = b.start[e + 1] - first;
        if (count == 0) continue;
        const uint8_t *codes = w.codes + e * n * k / 2, *scales = w.scales + e * n * (k / ms.block);
        const float *row_scale = w.row_scale ? w.row_scale + e * n : nullptr;
        const int8_t *qe = q + first * k;
        const float *de = d + first * blocks;
        float *oe = out + first * n;
        int64_t r0 = 0;
        for (; r0 + ROWS <= count; r0 += ROWS) dot_rows<ROWS>(qe, de, codes, scales, s, r0, n0, n1, row_scale, oe);
        for (; r0 < count; r0++) dot_rows<1>(qe, de, codes, scales, s, r0, n0, n1, row_scale, oe);
    }
}

inline float activated(float gate, float up, int64_t activation) {
    return activation == 0 ? tile_gemm::silu(gate) * up : tile_gemm::swigluoai(gate, up);
}

// inter[i] = act(gate_up[i] + b13[e]) for each sorted pair i of expert e (gate columns first, then up).
void activate(const float *gate_up, const PairBuckets &b, const MoeShape &s, const float *b13, float *inter,
              int num_threads) {
    const int64_t pairs = b.start.back();
#pragma omp parallel for schedule(static) num_threads(num_threads) if (pairs * s.inter >= 16384)
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t e = std::upper_bound(b.start.begin(), b.start.end(), i) - b.start.begin() - 1;
        const float *row = gate_up + i * 2 * s.inter, *bias = b13 ? b13 + e * 2 * s.inter : nullptr;
        for (int64_t c = 0; c < s.inter; c++)
            inter[i * s.inter + c] = activated(row[c] + (bias ? bias[c] : 0.0f),
                                               row[s.inter + c] + (bias ? bias[s.inter + c] : 0.0f), s.activation);
    }
}

void fp4_moe_impl(const float *x, const int64_t *topk_ids, const float *topk_weights, const Fp4Experts &w13,
                  const Fp4Experts &w2, float *out, const MoeShape &s, int num_threads) {
    const PairBuckets b = bucket_pairs(topk_ids, s);
    const int64_t pairs = b.start.back();
    std::vector<float> xs(pairs * s.hidden), gate_up(pairs * 2 * s.inter), inter(pairs * s.inter);
    std::vector<float> rows(pairs * s.hidden);
    for (int64_t i = 0; i < pairs; i++)
        std::memcpy(xs.data() + i * s.hidden, x + b.pairs[i] / s.top_k * s.hidden, sizeof(float) * s.hidden);
    std::vector<int8_t> q(pairs * std::max(s.hidden, s.inter));
    std::vector<float> d(pairs * std::max(s.hidden, s.inter) / ACT_BLOCK);
    quantize_rows(xs.data(), Shape{pairs, 0, s.hidden, 0, 0}, q.data(), d.data(), num_threads);
    experts_matmul(q.data(), d.data(), w13, 2 * s.inter, s.hidden, b, s, gate_up.data(), num_threads);
    activate(gate_up.data(), b, s, w13.bias, inter.data(), num_threads);
    quantize_rows(inter.data(), Shape{pairs, 0, s.inter, 0, 0}, q.data(), d.data(), num_threads);
    experts_matmul(q.data(), d.data(), w2, s.hidden, s.inter, b, s, rows.data(), num_threads);
    for (int64_t t = 0; t < s.num_tokens; t++) {
        float *o = out + t * s.hidden;
        std::memset(o, 0, sizeof(float) * s.hidden);
        for (int64_t p = t * s.top_k; p < (t + 1) * s.top_k; p++) {
            if (b.position[p] < 0) continue;
            const float *row = rows.data() + b.position[p] * s.hidden, *bias = w2.bias;
            const int64_t e = topk_ids[p];
            for (int64_t c = 0; c < s.hidden; c++)
                o[c] += topk_weights[p] * (row[c] + (bias ? bias[e * s.hidden + c] : 0.0f));
        }
    }
}

}  // namespace

extern "C" {

// x float32 [tokens, hidden] (hidden and inter multiples of 32), out float32 [tokens, hidden].
void fp4_moe(const float *x, const int64_t *topk_ids, const float *topk_weights, Fp4Experts w13, Fp4Experts w2,
             float *out, MoeShape shape, int num_threads) {
    fp4_moe_impl(x, topk_ids, topk_weights, w13, w2, out, shape, num_threads);
}

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
        for (int64_t block = 0; block < s.k / s.block; block++) {
            const float scale = SCALES.full[s.scale_kind][row_scales[block]] * out_scale;
            const uint8_t *bytes = row + block * s.block / 2;
            float *o = out + r * s.k + block * s.block;
            for (int64_t j = 0; j < s.block / 2; j++) {
                o[2 * j] = scale * SCALES.pairs[bytes[j]][0];
                o[2 * j + 1] = scale * SCALES.pairs[bytes[j]][1];
            }
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
