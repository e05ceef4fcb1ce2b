// out = x W^T (+ bias) for decode-sized x (a few dozen rows), where oneDNN's small-M kernels stream a packed
// weight at about half the memory bandwidth and run their FMAs at about two thirds of the tile kernel's rate;
// with AMX for any number of rows (oneDNN JITs a new kernel for every new row count, 3-40 ms each).
// Panels (PANEL output columns each) are shared by the threads; every row block of a panel runs while the
// panel is in L2, so the weight is streamed from memory once per call.
// Weights are packed by pagedmoe/layers/cpu_linear.py as [N / PANEL, K, PANEL] (bf16 in k-pairs where the
// target has avx512_bf16). Shape.out_features is the output width: N, or I for the gated form.
#include <memory>

#include "amx_tile.h"

namespace {

using namespace tile_gemm;

struct Shape {
    int64_t rows, out_features, in_features;
};

// Calls epilogue(j, r, n, acc) for every panel j and row block [r, r + n) of x times the panels w: acc is the
// block's float32 tile [n][PANEL]. AMX (bf16 only): 16-row blocks on the tile unit, else the vector tiles.
// Prefill-sized x runs in chunks of CHUNK_ROWS rows (every panel over one chunk, then the next), so a chunk
// stays in L2 while the weight streams past it: 1.1-1.3x at 1024-2048 rows against whole-x passes per panel.
// The threads share (chunk, run of panels) tasks; a last block of 1-3 rows takes 2-4 panels in one tile
// (tile_panels), after their full blocks.
constexpr int64_t CHUNK_ROWS = 256;
constexpr int64_t TASK_BYTES = 192 * 1024;
// Panels per task: runs of adjacent panels (up to TASK_BYTES), so that each thread streams its weights in order;
// one panel per task interleaved the threads' panels (6 rows: 16% slower, AVX2 Zen 3). At least 8 tasks a thread.
inline int64_t panels_per_task(int64_t num_panels, int64_t panel_bytes, int group, int num_threads) {
    const int64_t most = std::max<int64_t>(1, num_panels / (8 * num_threads) / group);
    return group * std::min<int64_t>(most, std::max<int64_t>(1, TASK_BYTES / panel_bytes / group));
}

template <bool AMX, typename T, typename Epilogue>
void for_each_tile(const T *x, const T *w, int64_t num_panels, const Shape &s, int num_threads, Epilogue epilogue) {
    constexpr bool ON_TILES = AMX && HAS_AMX && std::is_same_v<T, BF16>;
    constexpr int BLOCK = ON_TILES ? AMX_ROWS : MAX_ROWS;
    const int64_t K = s.in_features, num_chunks = (s.rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    // panel groups where x is one block of 1-3 rows (more streams from memory)
    const int group = ON_TILES || s.rows > BLOCK ? 1 : panels_per_tile<T, T>(int(s.rows));
    const int64_t task = panels_per_task(num_panels, K * PANEL * sizeof(T), group, num_threads);
    const int64_t num_tasks = (num_panels + task - 1) / task;
#pragma omp parallel num_threads(num_threads)
    {
        Amx amx;
        const T *rows[MAX_ROWS];
        alignas(64) float acc[std::max(AMX_ROWS, MAX_ROWS) * PANEL];
        auto run = [&](int64_t j, int panels, int64_t r, int n) {  // rows [r, r + n) times panels j, j + 1, ...
            if constexpr (ON_TILES) return amx.tile(n, x + r * K, w + j * K * PANEL, K, acc, r % CHUNK_ROWS == 0);
            for (int m = 0; m < n; m++) rows[m] = x + (r + m) * K;
            tile_panels(n, panels, rows, w + j * K * PANEL, K, acc, r % CHUNK_ROWS != 0);
        };
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_chunks * num_tasks; i++) {
            const int64_t first = i / num_tasks * CHUNK_ROWS, end = std::min(s.rows, first + CHUNK_ROWS);
            const int64_t last = first + (end - first - 1) / BLOCK * BLOCK;
            for (int64_t j = i % num_tasks * task; j < std::min(num_panels, (i % num_tasks + 1) * task); j += group) {
                const int panels = int(std::min<int64_t>(group, num_panels - j));
                for (int p = 0; p < panels; p++)
                    for (int64_t r = first; r < last; r += BLOCK) {
                        run(j + p, 1, r, BLOCK);
                        epilogue(j + p, r, BLOCK, acc);
                    }
                run(j, panels, last, int(end - last));
                for (int p = 0; p < panels; p++) epilogue(j + p, last, int(end - last), acc + p * (end - last) * PANEL);
            }
        }
    }
}

template <bool AMX, typename T, typename O>
void linear(const T *x, const T *w, const T *bias, O *out, const Shape &s, int num_threads) {
    for_each_tile<AMX>(x, w, s.out_features / PANEL, s, num_threads, [&](int64_t j, int64_t r, int n, const float *acc) {
        for (int m = 0; m < n; m++)
            for (int c = 0; c < PANEL; c++)
                store(out[(r + m) * s.out_features + j * PANEL + c],
                      acc[m * PANEL + c] + (bias ? to_float(bias[j * PANEL + c]) : 0.0f));
    });
}

// out = silu(x G^T) * (x U^T) for a gate_up weight packed as gate-up panels (PANEL / 2 gate columns, then
// the matching up columns): the activation runs on the float32 tile, and [rows, 2I] is never written.
template <bool AMX, typename T>
void gated_linear(const T *x, const T *w, T *out, const Shape &s, int num_threads) {
    for_each_tile<AMX>(x, w, s.out_features / HALF, s, num_threads, [&](int64_t j, int64_t r, int n, const float *acc) {
        for (int m = 0; m < n; m++) store_gated(out + (r + m) * s.out_features + j * HALF, acc + m * PANEL);
    });
}

// From the bits: -ffast-math lets the compiler assume every float is finite.
inline bool finite(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return (bits & 0x7F800000u) != 0x7F800000u;
}

// The float32 products of row x with up to PANEL columns of W [N, K] (unpacked), gathered into a panel of their
// own and run on the tile that computes every column of x W^T, so that each is bit-identical to linear<false>'s.
void candidate_products(const float *x, const float *w, const int64_t *columns, int count, int64_t K, float *acc) {
    thread_local std::unique_ptr<float[]> panel;  // lanes past count keep earlier (finite) values, never read
    thread_local int64_t panel_k = 0;
    if (panel_k < K) panel.reset(new float[K * PANEL]()), panel_k = K;
    for (int c = 0; c < count; c++)
        for (int64_t k = 0; k < K; k++) panel[k * PANEL + c] = w[columns[c] * K + k];
    tile(1, &x, panel.get(), K, acc);
}

// The first column of row x's largest float32 product with W [N, K], x W^T, found from approx (the row of x W^T
// from bf16 copies of x and W) and bound: no column's float32 product is further than bound * w_norms[n] from
// its approx. Only the columns whose approx can still reach the largest lower bound are computed (a few).
// -1 where the row's bounds are not finite (the caller then takes the full logits).
int64_t bounded_argmax_row(const float *x, const float *w, const float *approx, const float *w_norms, float bound,
                           const Shape &s) {
    const int64_t N = s.out_features, K = s.in_features;
    float floor = approx[0] - bound * w_norms[0];
#pragma omp simd reduction(max : floor)
    for (int64_t n = 1; n < N; n++) floor = std::max(floor, approx[n] - bound * w_norms[n]);
    if (!finite(floor) || !finite(bound)) return -1;
    int64_t columns[PANEL], best = -1;
    int count = 0;
    alignas(64) float acc[PANEL];
    float best_value = 0.0f;
    for (int64_t j = 0; j < N; j += VLEN) {  // VLEN columns in one vector test, nearly all below the floor
        int reaches = 0;
#pragma omp simd reduction(| : reaches)
        for (int c = 0; c < VLEN; c++) reaches |= approx[j + c] + bound * w_norms[j + c] >= floor;
        for (int64_t n = j; reaches && n < j + VLEN; n++)
            if (approx[n] + bound * w_norms[n] >= floor) columns[count++] = n;
        if (count == 0 || (count + VLEN <= PANEL && j + VLEN < N)) continue;
        candidate_products(x, w, columns, count, K, acc);
        for (int c = 0; c < count; c++)
            if (best < 0 || acc[c] > best_value) best = columns[c], best_value = acc[c];
        count = 0;
    }
    return finite(best_value) ? best : -1;
}

}  // namespace

// w: the float32 weight [N, K] as the model holds it; bounds: per row of x, the bound of bounded_argmax_row.
extern "C" void bounded_argmax_f32(const float *x, const float *w, const float *approx, const float *w_norms,
                                   const float *bounds, int64_t *out, Shape s, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t r = 0; r < s.rows; r++)
        out[r] = bounded_argmax_row(x + r * s.in_features, w, approx + r * s.out_features, w_norms, bounds[r], s);
}

extern "C" int linear_panel() { return PANEL; }
extern "C" int linear_bf16_pairs() { return PAIRS; }
// 1 where bf16 linears can run on AMX tiles: built for them, and the kernel granted the tile state
extern "C" int linear_amx() { return HAS_AMX && amx_ready(); }

#define EXPORT(NAME, T, AMX)                                                                              \
    extern "C" void NAME(const T *x, const T *w, const T *bias, T *out, Shape shape, int num_threads) { \
        linear<AMX>(x, w, bias, out, shape, num_threads);                                                 \
    }                                                                                                     \
    extern "C" void gated_##NAME(const T *x, const T *w, T *out, Shape shape, int num_threads) {         \
        gated_linear<AMX>(x, w, out, shape, num_threads);                                                 \
    }
// bf16 x and W, float32 out (no bias): bounded_argmax's approx.
extern "C" void linear_bf16_to_f32(const BF16 *x, const BF16 *w, float *out, Shape shape, int num_threads) {
    linear<false>(x, w, (const BF16 *)nullptr, out, shape, num_threads);
}
extern "C" void linear_amx_bf16_to_f32(const BF16 *x, const BF16 *w, float *out, Shape shape, int num_threads) {
    linear<true>(x, w, (const BF16 *)nullptr, out, shape, num_threads);
}

EXPORT(linear_f32, float, false)
EXPORT(linear_bf16, BF16, false)
EXPORT(linear_amx_bf16, BF16, true)
