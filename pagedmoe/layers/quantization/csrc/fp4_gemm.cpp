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

#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define FP4_VNNI512 1
constexpr bool PAIRED = true;  // activations laid out for the 512-bit step (q_index)
#else
constexpr bool PAIRED = false;
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

// Where element j of 32-block b goes in its row of q: each block's evens, then its odds; for the 512-bit step
// a pair of blocks (2p, 2p + 1) holds both blocks' evens, then both blocks' odds, so that one 512-bit shuffle
// decodes both blocks' weight bytes in that order (a last unpaired block stays evens then odds).
inline int64_t q_index(int64_t b, int j, int64_t blocks) {
    if (!PAIRED || (b == blocks - 1 && blocks % 2)) return b * ACT_BLOCK + (j % 2) * 16 + j / 2;
    return (b & ~int64_t(1)) * ACT_BLOCK + (j % 2) * 32 + (b & 1) * 16 + j / 2;
}

// x [m, k] float32 -> q [m, k] int8 (laid out by q_index) and d [m, k / 32].
void quantize_rows(const float *x, const Shape &s, int8_t *q, float *d, int num_threads = 1) {
    const int64_t blocks = s.k / ACT_BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (s.m * blocks >= 1024)
    for (int64_t i = 0; i < s.m * blocks; i++) {
        const float *src = x + i * ACT_BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < ACT_BLOCK; j++) amax = std::max(amax, std::fabs(src[j]));
        d[i] = amax / 127.0f;
        const float inverse = amax > 0 ? 127.0f / amax : 0.0f;
        int8_t *row = q + (i - i % blocks) * ACT_BLOCK;
        for (int j = 0; j < ACT_BLOCK; j++) row[q_index(i % blocks, j, blocks)] = int8_t(std::nearbyint(src[j] * inverse));
    }
}

// Quantised activation rows as the dot products read them: q and d from quantize_rows and, for the 512-bit
// VNNI step, per row and pair of blocks its 16 lanes' start (-12 x the lane's four activations).
struct Acts {
    const int8_t *q;
    const float *d;
    const int32_t *start;
    int64_t blocks;

    Acts at(int64_t row) const {  // the rows from `row` on
        return {q + row * blocks * ACT_BLOCK, d + row * blocks, start ? start + row * (blocks / 2) * 16 : nullptr,
                blocks};
    }
};

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
void dot_blocks(const Acts &a, const uint8_t *codes, const uint8_t *scales, const Shape &s, int64_t b0, int64_t b1,
                __m256 *acc) {
    const int64_t blocks = a.blocks;
    const int8_t *q = a.q;
    const float *d = a.d;
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

#if defined(FP4_VNNI512)
// Two 32-blocks' weights as one 512-bit vector, [block 0 evens, block 1 evens, block 0 odds, block 1 odds], each
// value + 12 (0..24) so that vpdpbusd can take the weights as its unsigned operand and the activations as they
// are: the lane's -12 x (sum of its activations) start, computed once per activation row (pair_starts), undoes
// the offset for every weight row.
const int8_t OFFSET_DOUBLED[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

inline __m512i decode_pair(const uint8_t *codes) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(OFFSET_DOUBLED)));
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(codes));
    const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
    return _mm512_shuffle_epi8(table, _mm512_and_si512(nibbles, _mm512_set1_epi8(0x0F)));
}

// start of rows [0, m) (Acts).
void pair_starts(const int8_t *q, int64_t m, int64_t blocks, int32_t *start) {
    const int64_t pairs = blocks / 2;
    const __m512i twelves = _mm512_set1_epi8(12), zero = _mm512_setzero_si512();
    for (int64_t r = 0; r < m; r++)
        for (int64_t p = 0; p < pairs; p++) {
            const __m512i x = _mm512_loadu_si512(q + (r * blocks + 2 * p) * ACT_BLOCK);
            _mm512_storeu_si512(start + (r * pairs + p) * 16,
                                _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, twelves, x)));
        }
}


// 16 scale bytes of a weight row from `first` on (`count` of them, the rest zero) as floats, up to a power of two
// (lane_factor): E8M0 e -> 2^(e - 127) as the float bits e << 23 (e = 0, 2^-127, becomes 0); E4M3 ->
// the float16 with the same bits below the sign moved up 7 (its exponent bias is 15 against E4M3's 7, the
// mantissa 3 bits at the top of 10, subnormals included), 2^-8 of the value.
inline __m512 scale_chunk(const uint8_t *scales, int64_t first, int64_t count, const Shape &s) {
    const __m128i bytes = _mm_maskz_loadu_epi8(count >= 16 ? 0xFFFF : (1u << count) - 1, scales + first);
    if (s.scale_kind == 0) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23));
    const __m256i wide = _mm256_cvtepu8_epi16(bytes);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

inline float lane_factor(const Shape &s) { return s.scale_kind == 0 ? 0.5f : 128.0f; }  // the doubled values' 1/2 too

// The activation scale d of the block each of a chunk's 16 weight scales covers, times lane_factor.
inline __m512 chunk_d(const float *d, int64_t first_block, int64_t count, const Shape &s) {
    if (s.block == 32)
        return _mm512_mul_ps(_mm512_maskz_loadu_ps(count >= 16 ? 0xFFFF : (1u << count) - 1, d + first_block),
                             _mm512_set1_ps(lane_factor(s)));
    const int64_t blocks = (count + 1) / 2;  // NVFP4: two scales a block
    const __m512 loaded = _mm512_maskz_loadu_ps((1u << blocks) - 1, d + first_block);
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_mul_ps(_mm512_permutexvar_ps(twice, loaded), _mm512_set1_ps(lane_factor(s)));
}

// Lane l of a pair's dot products takes scale PATTERN[l] + step * (pair within its scale chunk): lanes 0-3 are
// the first block's evens, 4-7 the second's, 8-11 and 12-15 their odds; NVFP4's scale per 16 splits each
// block's four lanes A A B B.
inline __m512i scale_pattern(const Shape &s) {
    return s.block == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                         : _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3);
}

// The weight rows stream from memory (a layer's experts are cold by the next token) faster than the hardware
// prefetcher alone fetches them: PREFETCH_BYTES ahead by hand (1-8 KB measured, 4 KB best).
constexpr int64_t PREFETCH_BYTES = 4096;

// 512 bits (two blocks) a step, the tail block 256. Each chunk of 16 weight scales is multiplied by the
// activations' d once, so that a step's lanes take their whole scale with one permute.
template <int R>
void dot_row(const Acts &a, const uint8_t *codes, const uint8_t *scales, const Shape &s, float *sums) {
    const int64_t pairs = a.blocks / 2, scales_per_pair = s.block == 32 ? 2 : 4, chunk = 16 / scales_per_pair;
    const __m512i pattern = scale_pattern(s), step = _mm512_set1_epi32(int(scales_per_pair));
    __m512 acc[R], table[R];
    __m256 tail[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), tail[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < pairs; c += chunk) {
        const int64_t end = std::min(pairs, c + chunk), count = (end - c) * scales_per_pair;
        const __m512 weight_scales = scale_chunk(scales, c * scales_per_pair, count, s);
        for (int r = 0; r < R; r++)
            table[r] = _mm512_mul_ps(weight_scales, chunk_d(a.d + r * a.blocks, 2 * c, count, s));
        __m512i index = pattern;
        for (int64_t p = c; p < end; p++, index = _mm512_add_epi32(index, step)) {
            _mm_prefetch(reinterpret_cast<const char *>(codes + p * 32 + PREFETCH_BYTES), _MM_HINT_T0);
            const __m512i w = decode_pair(codes + p * 32);
            for (int r = 0; r < R; r++) {
                const __m512i x = _mm512_loadu_si512(a.q + (r * a.blocks + 2 * p) * ACT_BLOCK);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(a.start + (r * pairs + p) * 16), w, x);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(index, table[r]), acc[r]);
            }
        }
    }
    dot_blocks<R>(a, codes, scales, s, 2 * pairs, a.blocks, tail);
    for (int r = 0; r < R; r++) sums[r] = _mm512_reduce_add_ps(acc[r]) + sum_lanes(tail[r]);
}

// Four accumulators' sums: a0..a3 -> lanes 0..3.
inline __m128 reduce4(const __m512 *acc) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One activation row against WEIGHT_ROWS consecutive weight rows at once: the activation loads are shared,
// the rows' accumulators are independent chains, and their sums reduce together. At one token a row of 9
// pairs had spent about a third of its time on one accumulator's latency and its own reduction.
constexpr int WEIGHT_ROWS = 4;
void dot_row4(const Acts &a, const uint8_t *codes, const uint8_t *scales, const Shape &s, float *sums) {
    const int64_t pairs = a.blocks / 2, scales_per_pair = s.block == 32 ? 2 : 4, chunk = 16 / scales_per_pair;
    const int64_t row_bytes = s.k / 2, row_scales = s.k / s.block;
    const __m512i pattern = scale_pattern(s), step = _mm512_set1_epi32(int(scales_per_pair));
    __m512 acc[WEIGHT_ROWS], table[WEIGHT_ROWS];
    for (int i = 0; i < WEIGHT_ROWS; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < pairs; c += chunk) {
        const int64_t end = std::min(pairs, c + chunk), count = (end - c) * scales_per_pair;
        const __m512 d = chunk_d(a.d, 2 * c, count, s);
        for (int i = 0; i < WEIGHT_ROWS; i++)
            table[i] = _mm512_mul_ps(scale_chunk(scales + i * row_scales, c * scales_per_pair, count, s), d);
        __m512i index = pattern;
        for (int64_t p = c; p < end; p++, index = _mm512_add_epi32(index, step)) {
            const __m512i x = _mm512_loadu_si512(a.q + 2 * p * ACT_BLOCK), start = _mm512_loadu_si512(a.start + p * 16);
            for (int i = 0; i < WEIGHT_ROWS; i++) {
                const uint8_t *row = codes + i * row_bytes + p * 32;
                _mm_prefetch(reinterpret_cast<const char *>(row + PREFETCH_BYTES), _MM_HINT_T0);
                const __m512i dot = _mm512_dpbusd_epi32(start, decode_pair(row), x);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(index, table[i]), acc[i]);
            }
        }
    }
    _mm_storeu_ps(sums, reduce4(acc));
    for (int i = 0; i < WEIGHT_ROWS && a.blocks % 2; i++) {
        __m256 tail = _mm256_setzero_ps();
        dot_blocks<1>(a, codes + i * row_bytes, scales + i * row_scales, s, 2 * pairs, a.blocks, &tail);
        sums[i] += sum_lanes(tail);
    }
}

#else
template <int R>
void dot_row(const Acts &a, const uint8_t *codes, const uint8_t *scales, const Shape &s, float *sums) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    dot_blocks<R>(a, codes, scales, s, 0, a.blocks, acc);
    for (int r = 0; r < R; r++) sums[r] = sum_lanes(acc[r]);
}
#endif
#else
template <int R>
void dot_row(const Acts &a, const uint8_t *codes, const uint8_t *scales, const Shape &s, float *sums) {
    const int64_t blocks = a.blocks;
    const int8_t *q = a.q;
    const float *d = a.d;
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
void dot_rows(const Acts &a, const uint8_t *codes, const uint8_t *scales, const Shape &s, int64_t r0, int64_t n0,
              int64_t n1, const float *row_scale, float *out) {
    const Acts rows = a.at(r0);
    float sums[R];
    int64_t n = n0;
#if defined(FP4_VNNI512)
    if constexpr (R == 1)
        for (float four[WEIGHT_ROWS]; n + WEIGHT_ROWS <= n1; n += WEIGHT_ROWS) {
            dot_row4(rows, codes + n * s.k / 2, scales + n * (s.k / s.block), s, four);
            for (int i = 0; i < WEIGHT_ROWS; i++)
                out[r0 * s.n + n + i] = four[i] * (row_scale ? row_scale[n + i] : 1.0f);
        }
#endif
    for (; n < n1; n++) {
        dot_row<R>(rows, codes + n * s.k / 2, scales + n * (s.k / s.block), s, sums);
        const float scale = row_scale ? row_scale[n] : 1.0f;
        for (int r = 0; r < R; r++) out[(r0 + r) * s.n + n] = sums[r] * scale;
    }
}

#if !defined(FP4_VNNI512)
inline void pair_starts(const int8_t *, int64_t, int64_t, int32_t *) {}  // no 512-bit step reads them
#endif

// Activation rows quantised for the dot products, with their pair starts where the VNNI step reads them.
struct QuantizedRows {
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> start;

    Acts quantize(const float *x, int64_t m, int64_t k, int num_threads) {
        const int64_t blocks = k / ACT_BLOCK;
        q.resize(m * k), d.resize(m * blocks);
        quantize_rows(x, Shape{m, 0, k, 0, 0}, q.data(), d.data(), num_threads);
        if (!PAIRED) return {q.data(), d.data(), nullptr, blocks};
        start.resize(m * (blocks / 2) * 16);
        pair_starts(q.data(), m, blocks, start.data());
        return {q.data(), d.data(), start.data(), blocks};
    }
};

// Output rows a task takes: long runs of consecutive weight rows, so that each thread streams its own part of
// the weight (in chunks of 16, a thread took every other 2 KB and the hardware prefetcher kept restarting:
// a layer's cold experts at one token 185 -> 120 us); a matmul's rows are split evenly between the threads.
constexpr int64_t ROW_CHUNK = 256;

int64_t gemm_chunk(int64_t n, int num_threads) {
    const int64_t even = (n + num_threads - 1) / std::max(num_threads, 1);
    return std::min(ROW_CHUNK, std::max<int64_t>(16, (even + 15) / 16 * 16));
}

void fp4_gemm_impl(const float *x, const uint8_t *codes, const uint8_t *scales, const float *row_scale, float *out,
                   const Shape &s, int num_threads) {
    QuantizedRows rows;
    const Acts a = rows.quantize(x, s.m, s.k, num_threads);
    const int64_t chunk = gemm_chunk(s.n, num_threads), chunks = (s.n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * chunk, n1 = std::min(s.n, n0 + chunk);
        int64_t r0 = 0;
        for (; r0 + ROWS <= s.m; r0 += ROWS)
            dot_rows<ROWS>(a, codes, scales, s, r0, n0, n1, row_scale, out);
        for (; r0 < s.m; r0++) dot_rows<1>(a, codes, scales, s, r0, n0, n1, row_scale, out);
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

// (expert, first output row) of every chunk of ROW_CHUNK rows of the experts that have pairs: idle experts
// never reach the scheduler (16 experts x 72 chunks of a gate_up had cost ~40 us of task grabs a layer).
std::vector<std::pair<int64_t, int64_t>> expert_tasks(const PairBuckets &b, int64_t num_experts, int64_t n) {
    std::vector<std::pair<int64_t, int64_t>> tasks;
    for (int64_t e = 0; e < num_experts; e++)
        for (int64_t n0 = 0; b.start[e + 1] > b.start[e] && n0 < n; n0 += ROW_CHUNK) tasks.emplace_back(e, n0);
    return tasks;
}

// out[i, :] for each sorted pair i = its quantised row (q, d, sorted) against expert(i)'s rows of w: [n, k].
void experts_matmul(const Acts &a, const Fp4Experts &w, int64_t n, int64_t k, const PairBuckets &b,
                    const MoeShape &ms, float *out, int num_threads) {
    const Shape s{0, n, k, ms.block, ms.scale_kind};
    const auto tasks = expert_tasks(b, ms.num_experts, n);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (size_t task = 0; task < tasks.size(); task++) {
        const auto [e, n0] = tasks[task];
        const int64_t n1 = std::min(n, n0 + ROW_CHUNK), first = b.start[e], count = b.start[e + 1] - first;
        const uint8_t *codes = w.codes + e * n * k / 2, *scales = w.scales + e * n * (k / ms.block);
        const float *row_scale = w.row_scale ? w.row_scale + e * n : nullptr;
        const Acts rows = a.at(first);
        float *oe = out + first * n;
        int64_t r0 = 0;
        for (; r0 + ROWS <= count; r0 += ROWS) dot_rows<ROWS>(rows, codes, scales, s, r0, n0, n1, row_scale, oe);
        for (; r0 < count; r0++) dot_rows<1>(rows, codes, scales, s, r0, n0, n1, row_scale, oe);
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
    QuantizedRows quantized;
    experts_matmul(quantized.quantize(xs.data(), pairs, s.hidden, num_threads), w13, 2 * s.inter, s.hidden, b, s,
                   gate_up.data(), num_threads);
    activate(gate_up.data(), b, s, w13.bias, inter.data(), num_threads);
    experts_matmul(quantized.quantize(inter.data(), pairs, s.inter, num_threads), w2, s.hidden, s.inter, b, s,
                   rows.data(), num_threads);
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
