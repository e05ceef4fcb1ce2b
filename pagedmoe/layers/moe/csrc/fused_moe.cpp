// The routed experts of one MoE layer in one call, for decode-sized batches (a few rows per expert), where
// the step is bound by streaming the active experts' weights: each is read from memory once per call.
//   1. bucket the (token, slot) pairs by expert (serial, microseconds);
//   2. w13: tasks of (expert, group of panels) shared by the threads; each panel holds PANEL / 2 gate columns
//      and the matching up columns, so silu(gate) * up is applied to the float32 tile while it is in registers;
//   3. w2: the same over the hidden columns, one float32 row per pair;
//   4. out[t] = sum over t's slots of router weight * row, in float32.
// Weights are packed by pagedmoe/layers/moe/cpu_kernel.py as [experts, N / PANEL, K, PANEL], so a tile's
// weights are one contiguous stream. Plain C++ with GCC vector types: the compiler emits AVX-512 or AVX2
// (or SSE) for the target it is built for; bf16 uses avx512_bf16's dot products where the target has them
// and is widened with integer shifts where it does not.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

struct BF16 { uint16_t bits; };

#if defined(__AVX512F__)
constexpr int VLEN = 16, MAX_ROWS = 8;  // 16 accumulators of 32 registers
#else
constexpr int VLEN = 8, MAX_ROWS = 6;  // 12 accumulators of 16 registers
#endif
constexpr int NV = 2, PANEL = NV * VLEN, HALF = PANEL / 2;
// The hardware prefetcher alone leaves the stream at half the memory bandwidth once a tile has 4+ rows of
// FMAs per weight; prefetching 16 KB ahead into L2 (measured: 8-32 KB similar) keeps it near the peak.
constexpr int64_t PREFETCH_BYTES = 16 * 1024;
constexpr int64_t TASK_BYTES = 512 * 1024;  // weights per task: small enough for 2 threads to balance

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

inline fvec load(const float *p) {
    fvec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline fvec load(const BF16 *p) {
    hvec h;
    std::memcpy(&h, p, sizeof h);
    const uvec u = __builtin_convertvector(h, uvec) << 16;
    fvec v;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

inline void store(float &dst, float x) { dst = x; }
inline void store(BF16 &dst, float x) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    dst.bits = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Shape {
    int64_t num_tokens, top_k, num_experts, hidden, inter;
};

// acc[M][PANEL] = rows a[0..M) (K values each) times one packed panel b ([K][PANEL]).
template <int M, typename A, typename W>
void panel_tile(const A *const *a, const W *b, int64_t K, float *acc) {
    fvec c[M][NV] = {};
    for (int64_t k = 0; k < K; k++) {
        const char *ahead = reinterpret_cast<const char *>(b + k * PANEL) + PREFETCH_BYTES;
        for (int line = 0; line < int(PANEL * sizeof(W)); line += 64) __builtin_prefetch(ahead + line, 0, 2);
        fvec bv[NV];
        for (int v = 0; v < NV; v++) bv[v] = load(b + k * PANEL + v * VLEN);
        for (int m = 0; m < M; m++) {
            const float av = to_float(a[m][k]);
            for (int v = 0; v < NV; v++) c[m][v] += av * bv[v];
        }
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < NV; v++) std::memcpy(acc + m * PANEL + v * VLEN, &c[m][v], sizeof(fvec));
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
        const char *ahead = reinterpret_cast<const char *>(b + k * PANEL) + PREFETCH_BYTES;
        for (int line = 0; line < int(2 * PANEL * sizeof(BF16)); line += 64) __builtin_prefetch(ahead + line, 0, 2);
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
        ((rows == Ms + 1 ? panel_tile<Ms + 1>(a, b, K, acc) : void()), ...);
}

template <typename A, typename W>
void tile(int rows, const A *const *a, const W *b, int64_t K, float *acc) {
    tile_of(rows, a, b, K, acc, std::make_integer_sequence<int, MAX_ROWS>{});
}

struct Buckets {
    std::vector<int64_t> start, pairs;  // expert e's pairs (token * top_k + slot): pairs[start[e]:start[e+1]]
};

Buckets bucket(const int64_t *topk_ids, const Shape &s) {
    Buckets b{std::vector<int64_t>(s.num_experts + 1, 0), std::vector<int64_t>(s.num_tokens * s.top_k)};
    for (int64_t p = 0; p < s.num_tokens * s.top_k; p++)
        if (topk_ids[p] >= 0 && topk_ids[p] < s.num_experts) b.start[topk_ids[p] + 1]++;
    for (int64_t e = 0; e < s.num_experts; e++) b.start[e + 1] += b.start[e];
    std::vector<int64_t> fill(b.start.begin(), b.start.end() - 1);
    for (int64_t p = 0; p < s.num_tokens * s.top_k; p++)
        if (topk_ids[p] >= 0 && topk_ids[p] < s.num_experts) b.pairs[fill[topk_ids[p]]++] = p;
    return b;
}

struct Task { int64_t expert, first_panel, end_panel; };

std::vector<Task> tasks_of(const Buckets &b, int64_t num_panels, int64_t panel_bytes) {
    const int64_t group = std::max<int64_t>(1, TASK_BYTES / panel_bytes);
    std::vector<Task> tasks;
    for (int64_t e = 0; e + 1 < int64_t(b.start.size()); e++)
        for (int64_t j = 0; b.start[e + 1] > b.start[e] && j < num_panels; j += group)
            tasks.push_back({e, j, std::min(num_panels, j + group)});
    return tasks;
}

// Calls fn(n, r, acc) for each block of up to MAX_ROWS of the task expert's rows (pairs[r:r + n]) against
// panel j of its weights w; row m of the block is x's row pairs[r + m] / pairs_per_row.
template <typename A, typename W, typename Fn>
void for_each_row_block(const Buckets &b, const Task &t, int64_t j, const A *x, int64_t pairs_per_row,
                        int64_t K, const W *w, Fn fn) {
    const A *rows[MAX_ROWS];
    float acc[MAX_ROWS * PANEL];
    const W *panel = w + j * K * PANEL;
    for (int64_t r = b.start[t.expert]; r < b.start[t.expert + 1]; r += MAX_ROWS) {
        const int n = int(std::min<int64_t>(MAX_ROWS, b.start[t.expert + 1] - r));
        for (int m = 0; m < n; m++) rows[m] = x + (b.pairs[r + m] / pairs_per_row) * K;
        tile(n, rows, panel, K, acc);
        fn(n, r, acc);
    }
}

inline float silu(float g) { return g / (1.0f + expf(-g)); }

template <typename A, typename W>
void gate_up(const A *x, const W *w13, const Buckets &b, const Shape &s, A *inter, int num_threads) {
    const int64_t num_panels = s.inter / HALF, expert_size = num_panels * s.hidden * PANEL;
    const std::vector<Task> tasks = tasks_of(b, num_panels, s.hidden * PANEL * sizeof(W));
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (size_t i = 0; i < tasks.size(); i++)
        for (int64_t j = tasks[i].first_panel; j < tasks[i].end_panel; j++)
            for_each_row_block(b, tasks[i], j, x, s.top_k, s.hidden, w13 + tasks[i].expert * expert_size,
                               [&](int n, int64_t r, const float *acc) {
                for (int m = 0; m < n; m++) {
                    A *out = inter + b.pairs[r + m] * s.inter + j * HALF;
                    for (int c = 0; c < HALF; c++) store(out[c], silu(acc[m * PANEL + c]) * acc[m * PANEL + HALF + c]);
                }
            });
}

template <typename A, typename W>
void down(const A *inter, const W *w2, const Buckets &b, const Shape &s, float *rows, int num_threads) {
    const int64_t num_panels = s.hidden / PANEL, expert_size = num_panels * s.inter * PANEL;
    const std::vector<Task> tasks = tasks_of(b, num_panels, s.inter * PANEL * sizeof(W));
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (size_t i = 0; i < tasks.size(); i++)
        for (int64_t j = tasks[i].first_panel; j < tasks[i].end_panel; j++)
            for_each_row_block(b, tasks[i], j, inter, 1, s.inter, w2 + tasks[i].expert * expert_size,
                               [&](int n, int64_t r, const float *acc) {
                for (int m = 0; m < n; m++)
                    std::memcpy(rows + b.pairs[r + m] * s.hidden + j * PANEL, acc + m * PANEL, sizeof(float) * PANEL);
            });
}

void combine(const float *rows, const int64_t *topk_ids, const float *topk_weights, const Shape &s, float *out,
             int num_threads) {
#pragma omp parallel for num_threads(num_threads)
    for (int64_t t = 0; t < s.num_tokens; t++) {
        float *o = out + t * s.hidden;
        std::memset(o, 0, sizeof(float) * s.hidden);
        for (int64_t slot = t * s.top_k; slot < (t + 1) * s.top_k; slot++) {
            if (topk_ids[slot] < 0 || topk_ids[slot] >= s.num_experts) continue;
            const float w = topk_weights[slot], *row = rows + slot * s.hidden;
#pragma omp simd
            for (int64_t n = 0; n < s.hidden; n++) o[n] += w * row[n];
        }
    }
}

template <typename A>
void fused_moe(const A *x, const int64_t *topk_ids, const float *topk_weights, const A *w13, const A *w2,
               float *out, const Shape &s, int num_threads) {
    const Buckets b = bucket(topk_ids, s);
    std::vector<A> inter(s.num_tokens * s.top_k * s.inter);  // rounded to the model's dtype, as in HF
    std::vector<float> rows(s.num_tokens * s.top_k * s.hidden);
    gate_up(x, w13, b, s, inter.data(), num_threads);
    down(inter.data(), w2, b, s, rows.data(), num_threads);
    combine(rows.data(), topk_ids, topk_weights, s, out, num_threads);
}

}  // namespace

extern "C" int fused_moe_panel() { return PANEL; }
extern "C" int fused_moe_bf16_pairs() { return PAIRS; }  // bf16 weights packed in k-pairs

#define EXPORT(NAME, T)                                                                                 \
    extern "C" void NAME(const T *x, const int64_t *topk_ids, const float *topk_weights, const T *w13,  \
                         const T *w2, float *out, Shape shape, int num_threads) {                         \
        fused_moe(x, topk_ids, topk_weights, w13, w2, out, shape, num_threads);                          \
    }
EXPORT(fused_moe_f32, float)
EXPORT(fused_moe_bf16, BF16)
