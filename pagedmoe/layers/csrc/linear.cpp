// out = x W^T (+ bias) for decode-sized x (a few dozen rows), where oneDNN's small-M kernels stream a packed
// weight at about half the memory bandwidth and run their FMAs at about two thirds of the tile kernel's rate;
// with AMX for any number of rows (oneDNN JITs a new kernel for every new row count, 3-40 ms each).
// Panels (PANEL output columns each) are shared by the threads; every row block of a panel runs while the
// panel is in L2, so the weight is streamed from memory once per call.
// Weights are packed by pagedmoe/layers/cpu_linear.py as [N / PANEL, K, PANEL] (bf16 in k-pairs where the
// target has avx512_bf16). Shape.out_features is the output width: N, or I for the gated form.
#include <memory>
#include <vector>

#include "amx_tile.h"
#include "int8_tile.h"

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

// out[r][n] = float(x_r . w_n) * x_scales[r] * w_scales[n] for x in bytes (its int8 values plus I8_OFFSET,
// K a multiple of 4) and W packed by int8_tile.h (N padded up to whole panels with zero rows, whose columns
// are not written); w_sums[n] (the sum of w_n's values) takes the offset back out. The threads share runs
// of panels; each panel's row blocks run while it is in L2.
void linear_i8(const uint8_t *x, const int8_t *w, const int32_t *w_sums, const float *x_scales,
               const float *w_scales, float *out, const Shape &s, int num_threads) {
    const int64_t N = s.out_features, K = s.in_features, num_panels = (N + I8_PANEL - 1) / I8_PANEL;
    const int64_t task = panels_per_task(num_panels, K * I8_PANEL, 1, num_threads);
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t first = 0; first < num_panels; first += task) {
        const uint8_t *rows[I8_MAX_ROWS];
        alignas(64) int32_t acc[I8_MAX_ROWS * I8_PANEL];
        for (int64_t j = first; j < std::min(num_panels, first + task); j++)
            for (int64_t r = 0; r < s.rows; r += I8_MAX_ROWS) {
                const int n = int(std::min<int64_t>(I8_MAX_ROWS, s.rows - r));
                for (int m = 0; m < n; m++) rows[m] = x + (r + m) * K;
                i8_tile(n, rows, w + j * K * I8_PANEL, K, acc);
                const int64_t col = j * I8_PANEL, width = std::min<int64_t>(I8_PANEL, N - col);
                for (int m = 0; m < n; m++) {
                    float *row = out + (r + m) * N + col;
#pragma omp simd
                    for (int64_t c = 0; c < width; c++)
                        row[c] = float(acc[m * I8_PANEL + c] - I8_OFFSET * w_sums[col + c]) * x_scales[r + m] *
                                 w_scales[col + c];
                }
            }
    }
}

// From the bits: -ffast-math lets the compiler assume every float is finite.
inline bool finite(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return (bits & 0x7F800000u) != 0x7F800000u;
}

// The float32 products of row x with up to PANEL columns of W [N, K] (unpacked), gathered into a panel of their
// own (in k-pairs where the bf16 tile takes them) and run on the tile that computes every column of x W^T, so
// that each is bit-identical to linear<false>'s.
template <typename T>
void candidate_products(const T *x, const T *w, const int64_t *columns, int count, int64_t K, float *acc) {
    constexpr bool IN_PAIRS = PAIRS && std::is_same_v<T, BF16>;
    thread_local std::unique_ptr<T[]> panel;  // lanes past count keep earlier (finite) values, never read
    thread_local int64_t panel_k = 0;
    if (panel_k < K) panel.reset(new T[K * PANEL]()), panel_k = K;
    for (int c = 0; c < count; c++)
        for (int64_t k = 0; k < K; k++)
            panel[IN_PAIRS ? (k / 2 * PANEL + c) * 2 + k % 2 : k * PANEL + c] = w[columns[c] * K + k];
    tile(1, &x, panel.get(), K, acc);
}

// The logit as the full head stores it: float32, or rounded to bf16 (ties to even, as torch) and back.
inline float stored(float v, float) { return v; }
inline float stored(float v, BF16) {
    BF16 rounded;
    store(rounded, v);
    return to_float(rounded);
}

// How far below a lower bound on the largest product a product can be and still store the largest logit: 0 in
// float32; in bf16 the two roundings (2^-9 each of the value), doubled, and an absolute term for zero.
inline float tie_slack(float v, float) { return 0.0f; }
inline float tie_slack(float v, BF16) { return std::fabs(v) * 0x1p-7f + 0x1p-100f; }

// A row's bound on |approx[n] - the float32 product n|: scale * w_norms[n] + error_scale * w_errors[n].
struct Bound {
    const float *w_norms, *w_errors;
    float scale, error_scale;
    float operator()(int64_t n) const { return scale * w_norms[n] + error_scale * w_errors[n]; }
};

// The largest of approx[n] - bound(n): a lower bound on the largest float32 product.
float floor_of(const float *approx, const Bound &bound, int64_t N) {
    float floor = approx[0] - bound(0);
#pragma omp simd reduction(max : floor)
    for (int64_t n = 1; n < N; n++) floor = std::max(floor, approx[n] - bound(n));
    return floor;
}

// x . w in float32 in any order: like the tile's own sum, within K 2^-24 |x| |w| of the exact product.
template <typename T>
float any_order_dot(const T *x, const T *w, int64_t K) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < K; k++) sum += to_float(x[k]) * to_float(w[k]);
    return sum;
}

// The columns whose approx can still reach floor, each with its any-order product (dots); the largest lower
// bound of those products, dots[n] - fine * w_norms[n].
template <typename T>
float near_columns(const T *x, const T *w, const float *approx, const Bound &bound, float floor, float fine,
                   const Shape &s, std::vector<int64_t> &columns, std::vector<float> &dots) {
    const int64_t N = s.out_features, K = s.in_features;
    float finer = -INFINITY;
    for (int64_t j = 0; j < N; j += VLEN) {  // VLEN columns in one vector test, nearly all below the floor
        int reaches = 0;
#pragma omp simd reduction(| : reaches)
        for (int c = 0; c < VLEN; c++) reaches |= approx[j + c] + bound(j + c) >= floor;
        for (int64_t n = j; reaches && n < j + VLEN; n++)
            if (approx[n] + bound(n) >= floor) {
                columns.push_back(n), dots.push_back(any_order_dot(x, w + n * K, K));
                finer = std::max(finer, dots.back() - fine * bound.w_norms[n]);
            }
    }
    return finer;
}

// The first column of row x's largest logit (x W^T, W [N, K], as linear<false> stores it), found from approx
// (the row of x W^T from bf16 or int8 copies of x and W) and bound: no column's float32 product is further than
// bound(n) from its approx. The columns that can still reach the largest lower bound (a few dozen) get an
// any-order float32 product, and the few of those that can still be the largest their tile product.
// -1 where the row's bounds are not finite (the caller then takes the full logits).
template <typename T>
int64_t bounded_argmax_row(const T *x, const T *w, const float *approx, const Bound &bound, const Shape &s) {
    const int64_t K = s.in_features;
    const float lower = floor_of(approx, bound, s.out_features), floor = lower - tie_slack(lower, T{});
    if (!finite(floor) || !finite(bound.scale) || !finite(bound.error_scale)) return -1;
    double norm = 0.0;
    for (int64_t k = 0; k < K; k++) norm += double(to_float(x[k])) * to_float(x[k]);
    // twice K 2^-24 |x| |w| between the two float32 sums, with a quarter more for the roundings of the bounds
    const float fine = float(2.5 * double(K) * 0x1p-24 * std::sqrt(norm));
    thread_local std::vector<int64_t> columns;
    thread_local std::vector<float> dots;
    columns.clear(), dots.clear();
    const float finest = near_columns(x, w, approx, bound, floor, fine, s, columns, dots);
    const float finer = finest - tie_slack(finest, T{});
    if (!finite(finer) || !finite(fine)) return -1;
    int64_t batch[PANEL], best = -1;
    int count = 0;
    alignas(64) float acc[PANEL];
    float best_value = 0.0f;
    for (size_t i = 0; i < columns.size(); i++) {
        if (dots[i] + fine * bound.w_norms[columns[i]] >= finer) batch[count++] = columns[i];
        if (count == 0 || (count < PANEL && i + 1 < columns.size())) continue;
        candidate_products(x, w, batch, count, K, acc);
        for (int c = 0; c < count; c++) {
            const float value = stored(acc[c], T{});
            if (best < 0 || value > best_value) best = batch[c], best_value = value;
        }
        count = 0;
    }
    return finite(best_value) ? best : -1;
}

// w: the weight [N, K] as the model holds it; scales and error_scales: per row of x, its Bound's.
template <typename T>
void bounded_argmax(const T *x, const T *w, const float *approx, const float *w_norms, const float *w_errors,
                    const float *scales, const float *error_scales, int64_t *out, const Shape &s, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t r = 0; r < s.rows; r++) {
        const Bound bound{w_norms, w_errors, scales[r], error_scales[r]};
        out[r] = bounded_argmax_row(x + r * s.in_features, w, approx + r * s.out_features, bound, s);
    }
}

}  // namespace

#define BOUNDED_ARGMAX(NAME, T)                                                                               \
    extern "C" void NAME(const T *x, const T *w, const float *approx, const float *w_norms,                  \
                         const float *w_errors, const float *scales, const float *error_scales, int64_t *out, \
                         Shape s, int num_threads) {                                                          \
        bounded_argmax(x, w, approx, w_norms, w_errors, scales, error_scales, out, s, num_threads);          \
    }
BOUNDED_ARGMAX(bounded_argmax_f32, float)
BOUNDED_ARGMAX(bounded_argmax_bf16, BF16)
#undef BOUNDED_ARGMAX

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

// The greedy head's int8 approximate logits (linear_i8); 0 where the build has no int8 dot products.
extern "C" void linear_i8_to_f32(const uint8_t *x, const int8_t *w, const int32_t *w_sums, const float *x_scales,
                                 const float *w_scales, float *out, Shape shape, int num_threads) {
    linear_i8(x, w, w_sums, x_scales, w_scales, out, shape, num_threads);
}
extern "C" int linear_i8_panel() { return HAS_I8 ? I8_PANEL : 0; }
extern "C" int linear_i8_offset() { return I8_OFFSET; }

EXPORT(linear_f32, float, false)
EXPORT(linear_bf16, BF16, false)
EXPORT(linear_amx_bf16, BF16, true)
