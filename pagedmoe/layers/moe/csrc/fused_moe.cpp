// The routed experts of one MoE layer in one call, for decode-sized batches (a few rows per expert), where
// the step is bound by streaming the active experts' weights: each is read from memory once per call.
//   1. bucket the (token, slot) pairs by expert (serial, microseconds);
//   2. w13: tasks of (expert, group of panels) shared by the threads; each panel holds PANEL / 2 gate columns
//      and the matching up columns, so the activation (silu(gate) * up, or gpt-oss's clamped
//      (up + 1) * gate * sigmoid(1.702 gate), biases first where the experts have them) is applied to the
//      float32 tile while it is in registers;
//   3. w2: the same over the hidden columns (plus the expert's down bias), one float32 row per pair;
//   4. out[t] = sum over t's slots of router weight * row, in float32.
// Weights are packed by pagedmoe/layers/moe/cpu_kernel.py as [experts, N / PANEL, K, PANEL], so a tile's
// weights are one contiguous stream. Plain C++ with GCC vector types: the compiler emits AVX-512 or AVX2
// (or SSE) for the target it is built for; bf16 uses avx512_bf16's dot products where the target has them
// and is widened with integer shifts where it does not.
// fused_moe_amx_bf16 runs the same steps on AMX tiles, for batches of any size: the pairs' rows are first
// gathered in expert order, so each expert's rows are contiguous A tiles.
#include <atomic>
#include <vector>

#include <omp.h>

#include "../../csrc/amx_tile.h"

namespace {

using namespace tile_gemm;
constexpr int64_t TASK_BYTES = 512 * 1024;  // weights per task: small enough for 2 threads to balance

struct Shape {
    int64_t num_tokens, top_k, num_experts, hidden, inter;
};

// What follows each expert's matmuls: the activation, and biases (float32, or null): b13 [experts, 2 * inter] in
// the packed panels' column order (each panel's gate columns, then its up columns), b2 [experts, hidden].
struct Epilogue {
    int64_t activation;  // 0: silu(gate) * up; 1: gpt-oss's swigluoai
    const float *b13, *b2;
};

template <typename T>
inline void store_activated(T *out, float *acc_row, const Epilogue &ep, int64_t expert, int64_t panel,
                            int64_t inter) {
    if (ep.b13)
        for (int c = 0; c < PANEL; c++) acc_row[c] += ep.b13[expert * 2 * inter + panel * PANEL + c];
    if (ep.activation == 0) return store_gated(out, acc_row);
    store_activation(out, acc_row, [](float gate, float up) { return swigluoai(gate, up); });
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

// Tasks in order of their expert's pairs, most first: threads that claim from both ends (claim) then run an
// expert with many rows, bound by arithmetic, beside one with few, bound by reading its weights, instead of
// both on the same expert. 1.02-1.07x a layer at 16-64 tokens on a Zen 4 EPYC (AVX-512), 2 threads.
std::vector<Task> tasks_of(const Buckets &b, int64_t num_panels, int64_t panel_bytes) {
    const int64_t group = std::max<int64_t>(1, TASK_BYTES / panel_bytes);
    std::vector<int64_t> experts(b.start.size() - 1);
    for (size_t e = 0; e < experts.size(); e++) experts[e] = int64_t(e);
    auto load = [&](int64_t e) { return b.start[e + 1] - b.start[e]; };
    std::stable_sort(experts.begin(), experts.end(), [&](int64_t x, int64_t y) { return load(x) > load(y); });
    std::vector<Task> tasks;
    for (int64_t e : experts)
        for (int64_t j = 0; load(e) > 0 && j < num_panels; j += group)
            tasks.push_back({e, j, std::min(num_panels, j + group)});
    return tasks;
}

// Even threads take tasks from the front, odd ones from the back; -1 once none is left.
int64_t claim(std::atomic<uint64_t> &ends, bool from_back) {
    uint64_t seen = ends.load();
    for (;;) {
        const uint64_t front = seen & 0xffffffffu, back = seen >> 32;
        if (front >= back) return -1;
        const uint64_t next = from_back ? ((back - 1) << 32 | front) : (back << 32 | (front + 1));
        if (ends.compare_exchange_weak(seen, next)) return int64_t(from_back ? back - 1 : front);
    }
}

// Calls fn(e, j, n, r, acc) for every panel j of every active expert's weights w ([experts, num_panels, K, PANEL])
// and each block of up to MAX_ROWS of that expert's pairs (pairs[r:r + n]); row m of the block is x's row
// pairs[r + m] / pairs_per_row. The threads share (expert, panel group) tasks, claimed from both ends. An
// expert's last block of 1-3 rows runs over a few adjacent panels at once (tile_panels), after their full blocks,
// while they are in L2.
template <typename A, typename W, typename Fn>
void for_each_expert_tile(const Buckets &b, int64_t num_panels, const A *x, int64_t pairs_per_row, int64_t K,
                          const W *w, int num_threads, Fn fn) {
    const std::vector<Task> tasks = tasks_of(b, num_panels, K * PANEL * sizeof(W));
    std::atomic<uint64_t> ends{uint64_t(tasks.size()) << 32};
#pragma omp parallel num_threads(num_threads)
    for (int64_t i; (i = claim(ends, omp_get_thread_num() % 2 == 1)) >= 0;) {
        const Task &t = tasks[i];
        const int64_t first = b.start[t.expert], count = b.start[t.expert + 1] - first;
        const int64_t last = first + (count - 1) / MAX_ROWS * MAX_ROWS;  // the last block's first pair
        const int last_rows = int(first + count - last), group = panels_per_tile<A, W>(last_rows);
        const A *rows[MAX_ROWS];
        float acc[MAX_ROWS * PANEL];
        auto rows_of = [&](int64_t r, int n) {
            for (int m = 0; m < n; m++) rows[m] = x + (b.pairs[r + m] / pairs_per_row) * K;
        };
        for (int64_t j = t.first_panel; j < t.end_panel; j += group) {
            const int panels = int(std::min<int64_t>(group, t.end_panel - j));
            const W *panel = w + (t.expert * num_panels + j) * K * PANEL;
            for (int p = 0; p < panels; p++)
                for (int64_t r = first; r < last; r += MAX_ROWS) {
                    rows_of(r, MAX_ROWS);
                    tile(MAX_ROWS, rows, panel + p * K * PANEL, K, acc);
                    fn(t.expert, j + p, MAX_ROWS, r, acc);
                }
            rows_of(last, last_rows);
            tile_panels(last_rows, panels, rows, panel, K, acc, last > first);
            for (int p = 0; p < panels; p++) fn(t.expert, j + p, last_rows, last, acc + p * last_rows * PANEL);
        }
    }
}

// The same over x's rows in expert order (xs: row i is pair b.pairs[i]'s), on AMX tiles of up to 32 rows.
template <typename Fn>
void for_each_expert_amx_tile(const Buckets &b, int64_t num_panels, const BF16 *xs, int64_t K, const BF16 *w,
                              int num_threads, Fn fn) {
    const std::vector<Task> tasks = tasks_of(b, num_panels, K * PANEL * sizeof(BF16));
#pragma omp parallel num_threads(num_threads)
    {
        Amx amx;
        alignas(64) float acc[AMX_ROWS * PANEL];
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < tasks.size(); i++) {
            const Task &t = tasks[i];
            for (int64_t j = t.first_panel; j < t.end_panel; j++)
                for (int64_t r = b.start[t.expert]; r < b.start[t.expert + 1]; r += AMX_ROWS) {
                    const int n = int(std::min<int64_t>(AMX_ROWS, b.start[t.expert + 1] - r));
                    amx.tile(n, xs + r * K, w + (t.expert * num_panels + j) * K * PANEL, K, acc,
                             r == b.start[t.expert]);
                    fn(t.expert, j, n, r, acc);
                }
        }
    }
}

template <typename A, typename W>
void gate_up(const A *x, const W *w13, const Buckets &b, const Shape &s, const Epilogue &ep, A *inter,
             int num_threads) {
    for_each_expert_tile(b, s.inter / HALF, x, s.top_k, s.hidden, w13, num_threads,
                         [&](int64_t e, int64_t j, int n, int64_t r, float *acc) {
        for (int m = 0; m < n; m++)
            store_activated(inter + b.pairs[r + m] * s.inter + j * HALF, acc + m * PANEL, ep, e, j, s.inter);
    });
}

// rows[pair] (float32, hidden wide) = the down tile's rows (plus expert e's down bias), for the pairs[r:r + n]
// of a block
inline void scatter_rows(const Buckets &b, const Shape &s, const Epilogue &ep, int64_t e, int64_t j, int n,
                         int64_t r, const float *acc, float *rows) {
    for (int m = 0; m < n; m++) {
        float *row = rows + b.pairs[r + m] * s.hidden + j * PANEL;
        std::memcpy(row, acc + m * PANEL, sizeof(float) * PANEL);
        if (ep.b2)
            for (int c = 0; c < PANEL; c++) row[c] += ep.b2[e * s.hidden + j * PANEL + c];
    }
}

template <typename A, typename W>
void down(const A *inter, const W *w2, const Buckets &b, const Shape &s, const Epilogue &ep, float *rows,
          int num_threads) {
    for_each_expert_tile(b, s.hidden / PANEL, inter, 1, s.inter, w2, num_threads,
                         [&](int64_t e, int64_t j, int n, int64_t r, const float *acc) {
        scatter_rows(b, s, ep, e, j, n, r, acc, rows);
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

// inter_sorted[i] = silu(xs[i] G^T) * (xs[i] U^T), then rows[pair] = inter_sorted[i] W2^T, on AMX tiles
void amx_experts(const BF16 *xs, const BF16 *w13, const BF16 *w2, const Buckets &b, const Shape &s,
                 const Epilogue &ep, float *rows, int num_threads) {
    std::vector<BF16> inter(b.start.back() * s.inter);  // rounded to bf16, as in HF
    for_each_expert_amx_tile(b, s.inter / HALF, xs, s.hidden, w13, num_threads,
                             [&](int64_t e, int64_t j, int n, int64_t r, float *acc) {
        for (int m = 0; m < n; m++)
            store_activated(inter.data() + (r + m) * s.inter + j * HALF, acc + m * PANEL, ep, e, j, s.inter);
    });
    for_each_expert_amx_tile(b, s.hidden / PANEL, inter.data(), s.inter, w2, num_threads,
                             [&](int64_t e, int64_t j, int n, int64_t r, const float *acc) {
        scatter_rows(b, s, ep, e, j, n, r, acc, rows);
    });
}

void fused_moe_on_amx(const BF16 *x, const int64_t *topk_ids, const float *topk_weights, const BF16 *w13,
                   const BF16 *w2, float *out, const Shape &s, const Epilogue &ep, int num_threads) {
    const Buckets b = bucket(topk_ids, s);
    std::vector<BF16> xs(b.start.back() * s.hidden);  // the pairs of known experts; the others contribute nothing
#pragma omp parallel for num_threads(num_threads)
    for (int64_t i = 0; i < b.start.back(); i++)
        std::memcpy(xs.data() + i * s.hidden, x + b.pairs[i] / s.top_k * s.hidden, sizeof(BF16) * s.hidden);
    std::vector<float> rows(s.num_tokens * s.top_k * s.hidden);
    amx_experts(xs.data(), w13, w2, b, s, ep, rows.data(), num_threads);
    combine(rows.data(), topk_ids, topk_weights, s, out, num_threads);
}

template <typename A>
void fused_moe(const A *x, const int64_t *topk_ids, const float *topk_weights, const A *w13, const A *w2,
               float *out, const Shape &s, const Epilogue &ep, int num_threads) {
    const Buckets b = bucket(topk_ids, s);
    std::vector<A> inter(s.num_tokens * s.top_k * s.inter);  // rounded to the model's dtype, as in HF
    std::vector<float> rows(s.num_tokens * s.top_k * s.hidden);
    gate_up(x, w13, b, s, ep, inter.data(), num_threads);
    down(inter.data(), w2, b, s, ep, rows.data(), num_threads);
    combine(rows.data(), topk_ids, topk_weights, s, out, num_threads);
}

// One expert's weights into a slot of the packed layouts (offloaded experts, moe/offload/): w13 [2I, H], gate
// rows then up rows, -> [I / HALF][H / pair][PANEL][pair]; w2 [H, I] -> [H / PANEL][I / pair][PANEL][pair];
// pair is 2 for bf16 weights packed in k-pairs, else 1. Source rows are read in order, the stores scattered.
int64_t gate_up_col(int64_t row, int64_t inter);
int64_t plain_col(int64_t row, int64_t);

template <typename T, int PAIR>
void pack_rows(const T *w, int64_t rows, int64_t k, T *out, int64_t (*panel_col)(int64_t, int64_t), int64_t arg) {
    for (int64_t row = 0; row < rows; row++) {
        const int64_t col = panel_col(row, arg);
        T *dst = out + col / PANEL * k * PANEL + col % PANEL * PAIR;
        const T *src = w + row * k;
        for (int64_t i = 0; i < k; i += PAIR, dst += PANEL * PAIR)
            for (int r = 0; r < PAIR; r++) dst[r] = src[i + r];
    }
}

template <typename T, int PAIR>
void pack_expert(const T *w13, const T *w2, T *p13, T *p2, int64_t inter, int64_t hidden) {
    pack_rows<T, PAIR>(w13, 2 * inter, hidden, p13, gate_up_col, inter);
    pack_rows<T, PAIR>(w2, hidden, inter, p2, plain_col, 0);
}

// w13's row -> its column among the packed panels: gate row r in panel r / HALF at r % HALF, up row I + r
// in the same panel at HALF + r % HALF
int64_t gate_up_col(int64_t row, int64_t inter) {
    const int64_t r = row < inter ? row : row - inter;
    return r / HALF * PANEL + (row < inter ? 0 : HALF) + r % HALF;
}

int64_t plain_col(int64_t row, int64_t) { return row; }

}  // namespace

extern "C" void fused_moe_pack_expert(const void *w13, const void *w2, void *p13, void *p2, int64_t inter,
                                      int64_t hidden, int64_t elem_size, int64_t pair) {
    using U16 = uint16_t;
    if (elem_size == 4)
        pack_expert<float, 1>((const float *)w13, (const float *)w2, (float *)p13, (float *)p2, inter, hidden);
    else if (pair == 2)
        pack_expert<U16, 2>((const U16 *)w13, (const U16 *)w2, (U16 *)p13, (U16 *)p2, inter, hidden);
    else
        pack_expert<U16, 1>((const U16 *)w13, (const U16 *)w2, (U16 *)p13, (U16 *)p2, inter, hidden);
}

extern "C" int fused_moe_panel() { return PANEL; }
extern "C" int fused_moe_bf16_pairs() { return PAIRS; }  // bf16 weights packed in k-pairs
// 1 where bf16 experts can run on AMX tiles: built for them, and the kernel granted the tile state
extern "C" int fused_moe_amx() { return HAS_AMX && PAIRS && amx_ready(); }

#define EXPORT(NAME, T)                                                                                 \
    extern "C" void NAME(const T *x, const int64_t *topk_ids, const float *topk_weights, const T *w13,  \
                         const T *w2, float *out, Shape shape, const Epilogue *ep, int num_threads) {     \
        fused_moe(x, topk_ids, topk_weights, w13, w2, out, shape, *ep, num_threads);                     \
    }
EXPORT(fused_moe_f32, float)
EXPORT(fused_moe_bf16, BF16)
extern "C" void fused_moe_amx_bf16(const BF16 *x, const int64_t *topk_ids, const float *topk_weights,
                                   const BF16 *w13, const BF16 *w2, float *out, Shape shape, const Epilogue *ep,
                                   int num_threads) {
    fused_moe_on_amx(x, topk_ids, topk_weights, w13, w2, out, shape, *ep, num_threads);
}
