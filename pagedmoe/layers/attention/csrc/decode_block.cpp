// A decoder layer's attention half for a step of decodes, in one call: input RMSNorm, the qkv projection,
// q/k norms, neox rotary, the KV write, paged decode attention, the o projection, the residual add and the
// post-attention RMSNorm. At one token a layer's Python and dispatch between these kernels took longer than
// the kernels (about 100 us against 60 on gpt-oss-200m); here they run back to back. Each step is the very
// kernel the layer's modules call one by one, in the same order, so the result is bit-identical to theirs.
// decode_stack runs every layer of a model so, its MLP (dense, or sparse: router and fused experts) and residual
// add included, in one call.
// Built and loaded by pagedmoe/layers/attention/decode_block.py (and layers/decode_stack.py).
#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include <omp.h>

#include "../../csrc/amx_tile.h"
#include "../../csrc/int8_tile.h"

// The kernels' sources, each in its own namespace: their file-local helpers and shapes share names. Their
// system headers are included above, outside the namespaces.
namespace linear_kernel {
#include "../../csrc/linear.cpp"
}
#undef EXPORT
namespace pointwise_kernel {
#include "../../csrc/pointwise.cpp"
}
#undef EXPORT
namespace decode_kernel {
#include "paged_decode.cpp"
}
#undef EXPORT
namespace fp4_kernel {
#include "../../quantization/csrc/fp4_gemm.cpp"
}
#undef EXPORT
namespace router_kernel {
#include "../../moe/csrc/router.cpp"
}
#undef EXPORT
namespace moe_kernel {
#include "../../moe/csrc/fused_moe.cpp"
}
#undef EXPORT

namespace {

using tile_gemm::BF16;
using tile_gemm::store;
using tile_gemm::to_float;

// A projection's weight: the tile kernel's packed panels (kind 0, or 1 on AMX tiles), or packed 4-bit codes
// (kind 2) with a scale byte per block of 32 (MXFP4) or 16 (NVFP4, whose scale_2 is row_scale).
struct Proj {
    const void *weight, *bias;
    const uint8_t *scales;
    const float *row_scale;
    int64_t kind, block;
};

// One layer's weights and sizes, fixed once its kernels are attached. qk_norm: 0 none, 1 per head (Qwen3),
// 2 over all heads (OLMoE). Pointers are to the model's dtype unless named float.
struct Layer {
    Proj qkv, o;
    const void *input_norm, *post_norm, *q_norm, *k_norm;
    const float *cos, *sin, *sinks;
    int64_t hidden, num_heads, num_kv_heads, head_dim, qk_norm, window;
    float eps, scale;
};

// One step's inputs to a layer's attention (its own tables and slots where sliding-window layers keep theirs).
struct Step {
    const int64_t *positions, *slots, *block_tables, *seq_lens;
    int64_t tokens, max_blocks, num_blocks, block_size;
};

// As fp4_linear.py: the int8-dot kernel on float32 rows, the result rounded to T, then the bias added in T.
template <typename T>
void project_fp4(const Proj &p, const T *x, T *out, float *scratch, int64_t rows, int64_t n, int64_t k,
                 int num_threads) {
    float *xf = scratch, *of = scratch + rows * k;
    for (int64_t i = 0; i < rows * k; i++) xf[i] = to_float(x[i]);
    const fp4_kernel::Shape shape{rows, n, k, p.block, p.block == 32 ? 0 : 1};
    fp4_kernel::fp4_gemm_impl(xf, (const uint8_t *)p.weight, p.scales, p.row_scale, of, shape, num_threads);
    const T *bias = (const T *)p.bias;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) {
            store(out[r * n + c], of[r * n + c]);
            if (bias) store(out[r * n + c], to_float(out[r * n + c]) + to_float(bias[c]));
        }
}

template <typename T>
void project(const Proj &p, const T *x, T *out, float *scratch, int64_t rows, int64_t n, int64_t k,
             int num_threads) {
    const linear_kernel::Shape shape{rows, n, k};
    const T *w = (const T *)p.weight, *bias = (const T *)p.bias;
    if (p.kind == 2) return project_fp4(p, x, out, scratch, rows, n, k, num_threads);
    if (p.kind == 1) return linear_kernel::linear<true>(x, w, bias, out, shape, num_threads);
    linear_kernel::linear<false>(x, w, bias, out, shape, num_threads);
}

// out = a + b in T, shared by the threads from a few dozen tokens.
template <typename T>
void add(T *out, const T *a, const T *b, int64_t n, int num_threads) {
#pragma omp parallel for simd num_threads(num_threads) if (n > 32768)
    for (int64_t i = 0; i < n; i++) store(out[i], to_float(a[i]) + to_float(b[i]));
}

// RMSNorm of rows of dim in place.
template <typename T>
void norm_rows(T *x, const void *weight, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++)
        pointwise_kernel::rms_norm_row(x + r * dim, (const T *)weight, x + r * dim, dim, eps);
}

// One token's q and k RMSNorm in place: every head's row (qk_norm 1, per head), or its q and its k (over all heads).
template <typename T>
void qk_norm_token(const Layer &l, T *q, T *k) {
    const bool per_head = l.qk_norm == 1;
    norm_rows(q, l.q_norm, per_head ? l.num_heads : 1, per_head ? l.head_dim : l.num_heads * l.head_dim, l.eps);
    norm_rows(k, l.k_norm, per_head ? l.num_kv_heads : 1, per_head ? l.head_dim : l.num_kv_heads * l.head_dim, l.eps);
}

// Between the qkv projection and the attention, a token at a time in one parallel loop (each was a kernel of
// its own, most too small to share between threads): q and k norms, neox rotary, the KV write, q into its own
// rows.
template <typename T>
void prepare_qkv(const Layer &l, const Step &s, T *qkv, T *q, T *cache, int num_threads) {
    const int64_t q_size = l.num_heads * l.head_dim, kv_size = l.num_kv_heads * l.head_dim;
    const int64_t width = q_size + 2 * kv_size, head_slots = s.num_blocks * s.block_size;
#pragma omp parallel for num_threads(num_threads) if (s.tokens * width > 8192)
    for (int64_t t = 0; t < s.tokens; t++) {
        T *row = qkv + t * width, *k = row + q_size;
        const float *cos = l.cos + s.positions[t] * l.head_dim, *sin = l.sin + s.positions[t] * l.head_dim;
        if (l.qk_norm) qk_norm_token(l, row, k);
        pointwise_kernel::rotary_token(row, cos, sin, l.num_heads, l.head_dim);
        pointwise_kernel::rotary_token(k, cos, sin, l.num_kv_heads, l.head_dim);
        pointwise_kernel::write_kv_token(k, k + kv_size, s.slots[t], cache, l.num_kv_heads, l.head_dim, head_slots);
        std::memcpy(q + t * q_size, row, sizeof(T) * q_size);
    }
}

template <typename T>
void attend(const Layer &l, const Step &s, T *qkv, T *q, T *cache, T *out, int num_threads) {
    prepare_qkv(l, s, qkv, q, cache, num_threads);
    const decode_kernel::Shape shape{s.tokens, s.max_blocks, l.num_kv_heads, l.num_heads / l.num_kv_heads,
                                     s.num_blocks, s.block_size, l.head_dim, l.window};
    decode_kernel::paged_decode_any(q, cache, s.block_tables, s.seq_lens, out, shape, l.scale, l.sinks, num_threads);
}

// out = x + attention(norm(x)); normed = post_norm(out). scratch: tokens * (hidden + 2 * q_size + 2 * kv_size
// + q_size) elements; float_scratch (4-bit projections): tokens * (2 * hidden + q_size + 2 * kv_size) floats.
template <typename T>
void decode_block(const Layer &l, const Step &s, const T *x, T *cache, T *out, T *normed, T *scratch,
                  float *float_scratch, int num_threads) {
    const int64_t n = s.tokens, q_size = l.num_heads * l.head_dim, width = q_size + 2 * l.num_kv_heads * l.head_dim;
    T *h = scratch, *qkv = h + n * l.hidden, *q = qkv + n * width, *attn = q + n * q_size;
    pointwise_kernel::rms_norm(x, (const T *)l.input_norm, h, n, l.hidden, l.eps, num_threads);
    project(l.qkv, h, qkv, float_scratch, n, width, l.hidden, num_threads);
    attend(l, s, qkv, q, cache, attn, num_threads);
    project(l.o, (const T *)attn, out, float_scratch, n, l.hidden, q_size, num_threads);
    add(out, x, (const T *)out, n * l.hidden, num_threads);
    pointwise_kernel::rms_norm(out, (const T *)l.post_norm, normed, n, l.hidden, l.eps, num_threads);
}

// A sparse MLP: its router and its experts, packed as layers/moe/cpu_kernel.py packs them (amx: on AMX tiles).
struct Moe {
    router_kernel::Router router;
    const void *w13, *w2;
    moe_kernel::Epilogue epilogue;
    int64_t num_experts, inter, amx;
};

// A gated MLP: dense on the tile kernel (gated: silu(gate) * up on the float32 tile), then down; or sparse
// (moe not null).
struct Mlp {
    Proj gate_up, down;
    int64_t intermediate;
    const Moe *moe;
};

// x += down(silu(normed G^T) * (normed U^T)): the MLP module, then the layer's residual add in T.
// scratch: tokens * (intermediate + hidden) elements.
template <typename T>
void mlp_block(const Mlp &m, const T *normed, T *x, T *scratch, int64_t n, int64_t hidden, int num_threads) {
    T *gated = scratch, *down = scratch + n * m.intermediate;
    const linear_kernel::Shape shape{n, m.intermediate, hidden};
    const T *gate_up = (const T *)m.gate_up.weight;
    if (m.gate_up.kind == 1)
        linear_kernel::gated_linear<true>(normed, gate_up, gated, shape, num_threads);
    else
        linear_kernel::gated_linear<false>(normed, gate_up, gated, shape, num_threads);
    project(m.down, (const T *)gated, down, nullptr, n, hidden, m.intermediate, num_threads);
    add(x, (const T *)x, (const T *)down, n * hidden, num_threads);
}

// x += experts(normed): the MoE module's route (counts: the layer's expert load, added to, or null) and its
// fused experts in float32, rounded to T, then the layer's residual add in T.
template <typename T>
void moe_block(const Moe &m, const T *normed, T *x, int64_t *counts, int64_t n, int64_t hidden, int num_threads) {
    const int64_t k = m.router.top_k;
    std::vector<float> weights(n * k), out(n * hidden);
    std::vector<int64_t> ids(n * k);
    router_kernel::route(m.router, normed, n, weights.data(), ids.data(), counts, num_threads);
    const moe_kernel::Shape shape{n, k, m.num_experts, hidden, m.inter};
    const T *w13 = (const T *)m.w13, *w2 = (const T *)m.w2;
    if constexpr (std::is_same_v<T, BF16>)
        if (m.amx)
            moe_kernel::fused_moe_on_amx(normed, ids.data(), weights.data(), w13, w2, out.data(), shape,
                                         m.epilogue, num_threads);
    if (!m.amx)
        moe_kernel::fused_moe(normed, ids.data(), weights.data(), w13, w2, out.data(), shape, m.epilogue,
                              num_threads);
    for (int64_t i = 0; i < n * hidden; i++) {
        T routed;
        store(routed, out[i]);
        store(x[i], to_float(x[i]) + to_float(routed));
    }
}

// Every layer of a decoder, each its decode_block then its mlp_block or moe_block; out: the last layer's output.
// caches: each layer's KV cache; loads: each layer's expert load (null, or null where none is counted).
// scratch: tokens * (2 * hidden + block_width + intermediate + hidden) elements, block_width being
// decode_block's scratch per token; float_scratch as decode_block's.
template <typename T>
void decode_stack(const Layer *layers, const Mlp *mlps, T *const *caches, int64_t *const *loads, int64_t num_layers,
                  const Step &s, const T *x, T *out, T *scratch, int64_t block_width, float *float_scratch,
                  int num_threads) {
    const int64_t n = s.tokens, hidden = layers[0].hidden;
    T *current = out, *next = scratch, *normed = next + n * hidden, *block_scratch = normed + n * hidden;
    T *mlp_scratch = block_scratch + n * block_width;
    std::memcpy(current, x, sizeof(T) * n * hidden);
    for (int64_t l = 0; l < num_layers; l++) {
        decode_block(layers[l], s, current, caches[l], next, normed, block_scratch, float_scratch, num_threads);
        if (mlps[l].moe)
            moe_block(*mlps[l].moe, normed, next, loads ? loads[l] : nullptr, n, hidden, num_threads);
        else
            mlp_block(mlps[l], normed, next, mlp_scratch, n, hidden, num_threads);
        std::swap(current, next);
    }
    if (current != out) std::memcpy(out, current, sizeof(T) * n * hidden);
}

// Per-token scratch sizes, as decode_stack.py allocates them: decode_block's, decode_stack's (elements of T, the
// block's included) and the float scratch's.
struct Widths {
    int64_t block, scratch, float_scratch;
};

// decode_stack for a dense model on 2 threads, with the step's sequences in two halves, each through every layer
// on a thread of its own: one half's attention, bound by memory, runs beside the other half's projections, bound
// by arithmetic: 0.92-1.0x a decode step at 40-64 decodes (qwen3-100m, float32 and bf16, Zen 4; 1.01x at 32).
// Both halves read the same weights at about the same time. Not for MoE layers: each half's experts read their
// weights again (1.05-1.1x slower). Every kernel computes each row on its own, so the output is bit-identical.
template <typename T>
void decode_stack_halves(const Layer *layers, const Mlp *mlps, T *const *caches, int64_t num_layers, const Step &s,
                         const T *x, T *out, T *scratch, const Widths &w, float *float_scratch, int64_t split) {
    const int64_t n = s.tokens, hidden = layers[0].hidden;
#pragma omp parallel num_threads(2)
    {
        const int64_t first = omp_get_thread_num() ? split : 0, end = omp_get_thread_num() ? n : split;
        Step half = s;
        half.positions += first, half.slots += first, half.seq_lens += first, half.tokens = end - first;
        half.block_tables += first * s.max_blocks;
        decode_stack(layers, mlps, caches, nullptr, num_layers, half, x + first * hidden, out + first * hidden,
                     scratch + first * w.scratch, w.block, float_scratch + first * w.float_scratch, 1);
    }
}

}  // namespace

// halves: 0, or run decode_stack_halves (a dense model, 2 threads) with the second half from row `halves`.
#define EXPORT(SUFFIX, T)                                                                                    \
    extern "C" void decode_block_##SUFFIX(const Layer *layer, const Step *step, const T *x, T *cache, T *out, \
                                         T *normed, T *scratch, float *float_scratch, int num_threads) {     \
        decode_block(*layer, *step, x, cache, out, normed, scratch, float_scratch, num_threads);             \
    }                                                                                                         \
    extern "C" void decode_stack_##SUFFIX(const Layer *layers, const Mlp *mlps, T *const *caches,              \
                                         int64_t *const *loads, int64_t num_layers, const Step *step,         \
                                         const T *x, T *out, T *scratch, const Widths *widths,                \
                                         float *float_scratch, int num_threads, int halves) {                 \
        if (halves)                                                                                           \
            return decode_stack_halves(layers, mlps, caches, num_layers, *step, x, out, scratch, *widths,     \
                                       float_scratch, halves);                                                \
        decode_stack(layers, mlps, caches, loads, num_layers, *step, x, out, scratch, widths->block,         \
                     float_scratch, num_threads);                                                          \
    }
EXPORT(f32, float)
EXPORT(bf16, BF16)
