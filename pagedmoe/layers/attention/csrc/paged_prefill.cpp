// Causal prefill attention over a paged KV cache, for one sequence: its num_queries newest positions attend
// its first seq_len positions, each query the positions up to its own. One layer's cache: [2 * num_kv_heads,
// num_blocks, block_size, head_dim], K heads then V heads. Each KV head's K and V are first packed as the
// register-tile GEMM's panels (tile_gemm.h), in float32 and zero past seq_len: K^T in PANEL-key panels
// [head_dim][PANEL], V in CHUNK-key chunks of head_dim / PANEL panels [CHUNK][PANEL]. A work item (KV head,
// QTILE query positions) then runs its rows (positions x the head's query heads) in blocks of MAX_ROWS through
// the key chunks: scores by tiles, an online softmax in float32 (flash attention), probabilities times V by tiles.
// Built and loaded by pagedmoe/layers/attention/cpu_prefill.py.
#include <memory>

#include "../../csrc/tile_gemm.h"

namespace {

using namespace tile_gemm;
constexpr int64_t CHUNK = 64, QTILE = 16, MAX_HEAD_DIM = 256;
constexpr float NO_SCORE = -1e30f;  // finite: -ffast-math assumes there are no infinities
static_assert(CHUNK % PANEL == 0, "a chunk is whole panels");

struct Shape {
    int64_t num_queries, seq_len, num_heads, num_kv_heads, num_blocks, block_size, head_dim;
};

// KV head g's keys as K^T panels and its values as V chunks (layouts above). Past seq_len, the last K^T panel
// is zeroed (its scores are computed, then masked); V there is never read.
template <typename T>
void pack_head(const T *cache, const int64_t *table, const Shape &s, int64_t g, float *kt, float *v) {
    const int64_t D = s.head_dim, head = s.num_blocks * s.block_size * D;
    const T *keys = cache + g * head, *values = cache + (s.num_kv_heads + g) * head;
    for (int64_t t = s.seq_len; t % PANEL; t++)
        for (int64_t d = 0; d < D; d++) kt[t / PANEL * D * PANEL + d * PANEL + t % PANEL] = 0.0f;
    for (int64_t t = 0; t < s.seq_len; t++) {
        const int64_t row = (table[t / s.block_size] * s.block_size + t % s.block_size) * D;
        float *kt_col = kt + t / PANEL * D * PANEL + t % PANEL;
        float *v_row = v + t / CHUNK * CHUNK * D + t % CHUNK * PANEL;
        for (int64_t d = 0; d < D; d++) {
            kt_col[d * PANEL] = to_float(keys[row + d]);
            v_row[d / PANEL * CHUNK * PANEL + d % PANEL] = to_float(values[row + d]);
        }
    }
}

typedef int32_t ivec __attribute__((vector_size(VLEN * 4)));

// e^x for x <= 0 (scores less their max), within a few ulp: Cephes' expf, inline over a whole vector. libmvec's
// vector call took a quarter of the kernel's time on Zen 1.
inline fvec exp_nonpositive(fvec x) {
    x = x < -87.0f ? fvec{} - 87.0f : x;
    const ivec n = __builtin_convertvector(x * 1.44269504f - 0.5f, ivec);  // round(x log2 e) for x <= 0
    const fvec nf = __builtin_convertvector(n, fvec), r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    fvec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = ((p * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r + 1.6666665459e-1f;
    p = (p * r + 5.0000001201e-1f) * (r * r) + r + 1.0f;
    const ivec bits = (n + 127) << 23;
    fvec scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

inline ivec lane_index() {
    ivec lanes;
    for (int i = 0; i < VLEN; i++) lanes[i] = i;
    return lanes;
}

// One row's step of the online softmax over a chunk of scores, of which the first `valid` count: scores become
// probabilities (0 where not valid), and the row's running max, sum and output are rescaled to the new max.
inline void softmax_step(float *scores, int64_t valid, float &max, float &sum, float *o, int64_t D) {
    const ivec lanes = lane_index();
    fvec most = fvec{} + NO_SCORE;
    for (int j = 0; j < CHUNK; j += VLEN) {
        const fvec x = load(scores + j);
        most = lanes + j < int(valid) && x > most ? x : most;
    }
    float new_max = max;
    for (int i = 0; i < VLEN; i++) new_max = std::max(new_max, most[i]);
    const float correction = max == NO_SCORE ? 0.0f : expf(max - new_max);
    fvec total = fvec{};
    for (int j = 0; j < CHUNK; j += VLEN) {
        const fvec p = lanes + j < int(valid) ? exp_nonpositive(load(scores + j) - new_max) : fvec{};
        std::memcpy(scores + j, &p, sizeof p);
        total += p;
    }
    float chunk_sum = 0.0f;
    for (int i = 0; i < VLEN; i++) chunk_sum += total[i];
    sum = sum * correction + chunk_sum, max = new_max;
    if (correction != 1.0f)
        for (int64_t d = 0; d < D; d++) o[d] *= correction;
}

// Block state: up to MAX_ROWS query rows, each with the keys it sees ([0, limit)) and its running softmax.
template <typename T>
struct RowBlock {
    int n = 0;
    const T *rows[MAX_ROWS];
    int64_t limit[MAX_ROWS];
    float max[MAX_ROWS], sum[MAX_ROWS];
    alignas(64) float o[MAX_ROWS][MAX_HEAD_DIM];
};

// Scores of the block's rows against the first `keys` keys of chunk c (whole panels), times scale.
template <typename T>
void chunk_scores(const RowBlock<T> &b, const float *kt, int64_t c, int64_t keys, int64_t D, float scale,
                  float (*scores)[CHUNK]) {
    alignas(64) float acc[MAX_ROWS * PANEL];
    for (int64_t p = 0; p < (keys + PANEL - 1) / PANEL; p++) {
        tile(b.n, b.rows, kt + (c * CHUNK / PANEL + p) * D * PANEL, D, acc);
        for (int m = 0; m < b.n; m++)
            for (int x = 0; x < PANEL; x++) scores[m][p * PANEL + x] = acc[m * PANEL + x] * scale;
    }
}

// The block through every chunk its rows see, then out rows = o / sum.
template <typename T>
void attend_block(RowBlock<T> &b, const float *kt, const float *v, int64_t D, float scale, T *const *out_rows) {
    alignas(64) float scores[MAX_ROWS][CHUNK], acc[MAX_ROWS * PANEL];
    const float *probs[MAX_ROWS];
    const int64_t last_key = *std::max_element(b.limit, b.limit + b.n), num_chunks = (last_key + CHUNK - 1) / CHUNK;
    for (int m = 0; m < b.n; m++) {
        b.max[m] = NO_SCORE, b.sum[m] = 0.0f, probs[m] = scores[m];
        std::fill(b.o[m], b.o[m] + D, 0.0f);
    }
    for (int64_t c = 0; c < num_chunks; c++) {  // the last chunk only as far as a row sees: no masked work
        const int64_t keys = std::min(CHUNK, last_key - c * CHUNK);
        chunk_scores(b, kt, c, keys, D, scale, scores);
        for (int m = 0; m < b.n; m++) softmax_step(scores[m], b.limit[m] - c * CHUNK, b.max[m], b.sum[m], b.o[m], D);
        for (int64_t p = 0; p < D / PANEL; p++) {
            tile(b.n, probs, v + c * CHUNK * D + p * CHUNK * PANEL, keys, acc);
            for (int m = 0; m < b.n; m++)
                for (int x = 0; x < PANEL; x++) b.o[m][p * PANEL + x] += acc[m * PANEL + x];
        }
    }
    for (int m = 0; m < b.n; m++)
        for (int64_t d = 0; d < D; d++) store(out_rows[m][d], b.o[m][d] / b.sum[m]);
}

// Query positions [first, end) of KV head g: rows r = (i - first) * G + h for query head g * G + h.
template <typename T>
void attend_tile(const T *q, T *out, const Shape &s, int64_t g, int64_t first, int64_t end, const float *kt,
                 const float *v, float scale) {
    const int64_t G = s.num_heads / s.num_kv_heads, D = s.head_dim, num_rows = (end - first) * G;
    RowBlock<T> b;
    T *out_rows[MAX_ROWS];
    for (int64_t r0 = 0; r0 < num_rows; r0 += MAX_ROWS) {
        b.n = int(std::min<int64_t>(MAX_ROWS, num_rows - r0));
        for (int m = 0; m < b.n; m++) {
            const int64_t i = first + (r0 + m) / G, at = (i * s.num_heads + g * G + (r0 + m) % G) * D;
            b.rows[m] = q + at, out_rows[m] = out + at, b.limit[m] = s.seq_len - s.num_queries + i + 1;
        }
        attend_block(b, kt, v, D, scale, out_rows);
    }
}

template <typename T>
void prefill(const T *q, const T *cache, const int64_t *table, T *out, const Shape &s, float scale, int num_threads) {
    const int64_t packed = (s.seq_len + CHUNK - 1) / CHUNK * CHUNK * s.head_dim;
    const int64_t num_tiles = (s.num_queries + QTILE - 1) / QTILE;
    std::unique_ptr<float[]> kt(new float[s.num_kv_heads * packed]), v(new float[s.num_kv_heads * packed]);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < s.num_kv_heads; g++)
            pack_head(cache, table, s, g, kt.get() + g * packed, v.get() + g * packed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < s.num_kv_heads * num_tiles; item++) {  // the longest (last) tiles first
            const int64_t t = num_tiles - 1 - item / s.num_kv_heads, g = item % s.num_kv_heads;
            attend_tile(q, out, s, g, t * QTILE, std::min(s.num_queries, (t + 1) * QTILE), kt.get() + g * packed,
                        v.get() + g * packed, scale);
        }
    }
}

}  // namespace

extern "C" int64_t paged_prefill_max_head_dim() { return MAX_HEAD_DIM; }
extern "C" int64_t paged_prefill_panel() { return PANEL; }

#define EXPORT(NAME, T)                                                                                         \
    extern "C" void NAME(const T *q, const T *cache, const int64_t *table, T *out, Shape shape, float scale,    \
                         int num_threads) {                                                                     \
        prefill(q, cache, table, out, shape, scale, num_threads);                                               \
    }
EXPORT(paged_prefill_f32, float)
EXPORT(paged_prefill_bf16, BF16)
