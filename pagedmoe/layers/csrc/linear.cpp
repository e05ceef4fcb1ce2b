// out = x W^T (+ bias) for decode-sized x (a few dozen rows), where oneDNN's small-M kernels stream a packed
// weight at about half the memory bandwidth and run their FMAs at about two thirds of the tile kernel's rate;
// with AMX for any number of rows (oneDNN JITs a new kernel for every new row count, 3-40 ms each).
// Panels (PANEL output columns each) are shared by the threads; every row block of a panel runs while the
// panel is in L2, so the weight is streamed from memory once per call.
// Weights are packed by pagedmoe/layers/cpu_linear.py as [N / PANEL, K, PANEL] (bf16 in k-pairs where the
// target has avx512_bf16). Shape.out_features is the output width: N, or I for the gated form.
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

template <bool AMX, typename T>
void linear(const T *x, const T *w, const T *bias, T *out, const Shape &s, int num_threads) {
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

}  // namespace

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
EXPORT(linear_f32, float, false)
EXPORT(linear_bf16, BF16, false)
EXPORT(linear_amx_bf16, BF16, true)
