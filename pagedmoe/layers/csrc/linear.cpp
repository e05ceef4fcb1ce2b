// out = x W^T (+ bias) for decode-sized x (a few dozen rows), where oneDNN's small-M kernels stream a packed
// weight at about half the memory bandwidth and run their FMAs at about two thirds of the tile kernel's rate.
// Tasks are groups of panels (PANEL output columns each) shared by the threads; every row block of the panel
// runs while the panel is in L2, so the weight is streamed from memory once per call.
// Weights are packed by pagedmoe/layers/cpu_linear.py as [N / PANEL, K, PANEL].
// Shape.out_features is the output width: N, or I for the gated form.
#include "tile_gemm.h"

namespace {

using namespace tile_gemm;

struct Shape {
    int64_t rows, out_features, in_features;
};

template <typename T>
void linear(const T *x, const T *w, const T *bias, T *out, const Shape &s, int num_threads) {
    const int64_t num_panels = s.out_features / PANEL, K = s.in_features;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t j = 0; j < num_panels; j++) {
        const T *rows[MAX_ROWS];
        float acc[MAX_ROWS * PANEL];
        for (int64_t r = 0; r < s.rows; r += MAX_ROWS) {
            const int n = int(std::min<int64_t>(MAX_ROWS, s.rows - r));
            for (int m = 0; m < n; m++) rows[m] = x + (r + m) * K;
            tile(n, rows, w + j * K * PANEL, K, acc);
            for (int m = 0; m < n; m++)
                for (int c = 0; c < PANEL; c++)
                    store(out[(r + m) * s.out_features + j * PANEL + c],
                          acc[m * PANEL + c] + (bias ? to_float(bias[j * PANEL + c]) : 0.0f));
        }
    }
}

// out = silu(x G^T) * (x U^T) for a gate_up weight packed as gate-up panels (PANEL / 2 gate columns, then
// the matching up columns): the activation runs on the float32 tile, and [rows, 2I] is never written.
template <typename T>
void gated_linear(const T *x, const T *w, T *out, const Shape &s, int num_threads) {
    const int64_t num_panels = s.out_features / HALF, K = s.in_features;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t j = 0; j < num_panels; j++) {
        const T *rows[MAX_ROWS];
        float acc[MAX_ROWS * PANEL];
        for (int64_t r = 0; r < s.rows; r += MAX_ROWS) {
            const int n = int(std::min<int64_t>(MAX_ROWS, s.rows - r));
            for (int m = 0; m < n; m++) rows[m] = x + (r + m) * K;
            tile(n, rows, w + j * K * PANEL, K, acc);
            for (int m = 0; m < n; m++)
                for (int c = 0; c < HALF; c++)
                    store(out[(r + m) * s.out_features + j * HALF + c],
                          silu(acc[m * PANEL + c]) * acc[m * PANEL + HALF + c]);
        }
    }
}

}  // namespace

extern "C" int linear_panel() { return PANEL; }
extern "C" int linear_bf16_pairs() { return PAIRS; }

#define EXPORT(NAME, T)                                                                                   \
    extern "C" void NAME(const T *x, const T *w, const T *bias, T *out, Shape shape, int num_threads) { \
        linear(x, w, bias, out, shape, num_threads);                                                      \
    }                                                                                                     \
    extern "C" void gated_##NAME(const T *x, const T *w, T *out, Shape shape, int num_threads) {         \
        gated_linear(x, w, out, shape, num_threads);                                                      \
    }
EXPORT(linear_f32, float)
EXPORT(linear_bf16, BF16)
