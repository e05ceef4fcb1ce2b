// The greedy draft steps of a proposal in one call, in float32, every op of the drafter's layers fused: at
// hidden size 128 eager PyTorch spends ~0.6 ms a layer dispatching ~40 small ops, this ~50 us a row.
// Two drafters (spec_decode/fused_drafters.py):
// - an EAGLE-3 head (spec_decode/eagle.py): row r (token, position, input hidden state) does
//     a = [rms(embed[token]) * w_in ; rms(hidden) * w_hidden]; x = hidden + attention(a); x += mlp(x)
// - a small dense Llama / Qwen3 draft model: row r (token, position) does x = embed[token], then per layer
//     x += attention(rms(x) * w_in); x += mlp(x)
// where attention(a) = W_o attend(q, k, v) with q, k, v = W_qkv a (per-head q / k RMSNorm where the layer has
// them), neox RoPE, k and v into the row's KV slot, attention over the sequence's blocks from its first kept
// position to p; mlp(x) = W_down (silu(gate) * up) with [gate; up] = W_gate_up rms(x) * w_post.
// A sequence's rows run in order; the last gives the logits W_lm rms(x) * w_norm, whose argmax is the draft
// and the next step's one row (for EAGLE-3 with x as its hidden state), for as many drafts as asked.
// A layer's KV cache: [2 * num_kv_heads, num_blocks, block_size, head_dim], K heads then V heads.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "../../layers/csrc/tile_gemm.h"

namespace {

struct Weights {  // an EAGLE-3 head's
    const float *embed, *input_norm, *hidden_norm, *qkv, *o, *post_norm, *gate_up, *down, *norm, *lm_head;
    const float *cos, *sin;  // [max_positions, head_dim]
    const float *fc;         // [hidden, in_width]: the target's fused states -> hidden
};

struct Layer {  // a dense decoder layer's; q_norm and k_norm null where it has none
    const float *input_norm, *qkv, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down;
};

struct Model {  // a dense draft model's
    const Layer *layers;
    int64_t num_layers, layer_stride;  // layer_stride: floats between two layers' KV caches
    const float *embed, *norm, *lm_head, *cos, *sin;
};

struct Shape {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, num_blocks, block_size, max_blocks,
        max_positions;
    float eps, scale;
};

using tile_gemm::fvec;
using tile_gemm::load;
using tile_gemm::VLEN;

// The sum of v's lanes by shuffles (omp simd's reductions stored the vector and added its lanes one by one:
// ~100 cycles a dot product, more than the products themselves at these sizes).
inline float lane_sum(fvec v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)  // tile_gemm.h includes the intrinsics from AVX2 on
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
#else
    float sum = 0.0f;
    for (int i = 0; i < VLEN; i++) sum += v[i];
    return sum;
#endif
}

// out[0..R) = R weight rows (row-major, `in` long) dotted with x: R independent accumulator chains hide each
// other's FMA latency (one row's dot product is a chain of dependent FMAs).
template <int R>
inline void dot_rows(const float *__restrict w, const float *__restrict x, int64_t in, float *__restrict out) {
    fvec acc[R] = {};
    int64_t i = 0;
    for (; i + VLEN <= in; i += VLEN) {
        const fvec xv = load(x + i);
        for (int r = 0; r < R; r++) acc[r] += load(w + r * in + i) * xv;
    }
    for (int r = 0; r < R; r++) {
        float dot = lane_sum(acc[r]);
        for (int64_t j = i; j < in; j++) dot += w[r * in + j] * x[j];
        out[r] = dot;
    }
}

constexpr int GROUP = 8;
constexpr int64_t PARALLEL_MIN = 1 << 15;  // weights of at least this many floats split over threads

// Outputs [begin, end) of Y[r] = W X[r] for n rows of X ([n, in]) and a row-major [out, in] W, eight weight
// rows at a time, each group read once for all n rows (the rows a drafter catches up on share every weight:
// one GEMV a row streamed the head n times). noclone: GCC's clone of it for constant arguments had lost the
// vectorisation (4x slower).
__attribute__((noclone)) void gemm_range(const float *__restrict w, const float *__restrict x,
                                         float *__restrict y, int64_t n, int64_t out, int64_t in, int64_t begin,
                                         int64_t end) {
    int64_t o = begin;
    for (; o + GROUP <= end; o += GROUP)
        for (int64_t r = 0; r < n; r++) dot_rows<GROUP>(w + o * in, x + r * in, in, y + r * out + o);
    for (; o < end; o++)
        for (int64_t r = 0; r < n; r++) dot_rows<1>(w + o * in, x + r * in, in, y + r * out + o);
}

// All outputs; a large W split over `threads` (a sequence drafting alone: the head's ~2 MB of weights come
// from L3 at one core's bandwidth, and the other core was idle).
void gemm_rows(const float *w, const float *x, float *y, int64_t n, int64_t out, int64_t in, int threads = 1) {
    if (threads <= 1 || out * in < PARALLEL_MIN) return gemm_range(w, x, y, n, out, in, 0, out);
#pragma omp parallel num_threads(threads)
    {
        const int64_t groups = out / GROUP, t = omp_get_thread_num(), num = omp_get_num_threads();
        const int64_t begin = groups * t / num * GROUP, end = t + 1 == num ? out : groups * (t + 1) / num * GROUP;
        gemm_range(w, x, y, n, out, in, begin, end);
    }
}

// HF's RMSNorm in float32: x * rsqrt(mean(x^2) + eps) * weight.
void rms_norm(const float *x, const float *weight, float *out, int64_t dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; i++) sum += x[i] * x[i];
    const float inverse = 1.0f / std::sqrt(sum / float(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * inverse);
}

// Neox rotary of `heads` heads at one position, in place.
void rotate(float *x, int64_t heads, const float *cos, const float *sin, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (float *v = x; v < x + heads * head_dim; v += head_dim)
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
}

const float *row_at(const float *head, const int64_t *table, int64_t t, const Shape &s) {
    return head + (table[t / s.block_size] * s.block_size + t % s.block_size) * s.head_dim;
}

// out[h] = softmax(q[h] . K[first..len) * scale) V[first..len) for each query head, over one sequence's blocks.
void attend(const float *q, const float *cache, const int64_t *table, int64_t first, int64_t len, const Shape &s,
            float *scores, float *out) {
    const int64_t head_stride = s.num_blocks * s.block_size * s.head_dim, dim = s.head_dim;
    const int64_t group = s.num_heads / s.num_kv_heads;
    for (int64_t h = 0; h < s.num_heads; h++) {
        const float *k_head = cache + (h / group) * head_stride, *qh = q + h * dim;
        const float *v_head = cache + (s.num_kv_heads + h / group) * head_stride;
        float max = -INFINITY, sum = 0.0f, *acc = out + h * dim;
        for (int64_t t = first; t < len; t++) {
            const float *k = row_at(k_head, table, t, s);
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; d++) dot += qh[d] * k[d];
            scores[t] = dot * s.scale;
            max = std::fmax(max, scores[t]);
        }
        for (int64_t t = first; t < len; t++) sum += scores[t] = expf(scores[t] - max);
        std::memset(acc, 0, sizeof(float) * dim);
        for (int64_t t = first; t < len; t++) {
            const float *v = row_at(v_head, table, t, s), p = scores[t] / sum;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) acc[d] += p * v[d];
        }
    }
}

// The activations of up to `capacity` consecutive rows of one sequence, row after row.
struct Scratch {
    std::vector<float> a, qkv, attn, x, normed, gate_up, scores, carry, fused;
    int threads = 1;  // for the large GEMVs (gemm_rows)
    Scratch(const Shape &s, int64_t capacity)
        : a(capacity * 2 * s.hidden), qkv(capacity * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim),
          attn(capacity * s.num_heads * s.head_dim), x(capacity * s.hidden), normed(capacity * s.hidden),
          gate_up(capacity * 2 * s.intermediate), scores(s.max_positions), carry(s.hidden),
          fused(capacity * s.hidden) {}
};

// n rows at consecutive positions from `position`: q, k, v = W_qkv a (in_dim wide) for all of them, per-head
// q / k norms where the layer has them, RoPE, k and v into their slots of the layer's cache; then each row
// attends from first to its own position (the later rows' slots are not read); m.normed = W_o attn.
void attention(const Layer &l, const float *cos_table, const float *sin_table, const Shape &s, float *cache,
               const int64_t *table, int64_t first, int64_t position, const float *a, int64_t in_dim, int64_t n,
               Scratch &m) {
    const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
    const int64_t width = q_size + 2 * kv_size, head_stride = s.num_blocks * s.block_size * s.head_dim;
    gemm_rows(l.qkv, a, m.qkv.data(), n, width, in_dim, m.threads);
    for (int64_t r = 0, p = position; r < n; r++, p++) {
        float *q = m.qkv.data() + r * width, *k = q + q_size;
        for (int64_t head = 0; l.q_norm && head < s.num_heads + s.num_kv_heads; head++) {  // in place
            float *v = q + head * s.head_dim;
            rms_norm(v, head < s.num_heads ? l.q_norm : l.k_norm, v, s.head_dim, s.eps);
        }
        rotate(q, s.num_heads + s.num_kv_heads, cos_table + p * s.head_dim, sin_table + p * s.head_dim,
               s.head_dim);  // q heads then k heads
        const int64_t slot = table[p / s.block_size] * s.block_size + p % s.block_size;
        for (int64_t kv = 0; kv < 2 * s.num_kv_heads; kv++)
            std::memcpy(cache + kv * head_stride + slot * s.head_dim, k + kv * s.head_dim, sizeof(float) * s.head_dim);
    }
    for (int64_t r = 0; r < n; r++)
        attend(m.qkv.data() + r * width, cache, table, first, position + r + 1, s, m.scores.data(),
               m.attn.data() + r * q_size);
    gemm_rows(l.o, m.attn.data(), m.normed.data(), n, s.hidden, q_size, m.threads);
}

// x += W_down (silu(gate) * up) for n rows, in place.
void mlp(const Layer &l, const Shape &s, int64_t n, Scratch &m) {
    const int64_t h = s.hidden, inter = s.intermediate;
    for (int64_t r = 0; r < n; r++) rms_norm(m.x.data() + r * h, l.post_norm, m.normed.data() + r * h, h, s.eps);
    gemm_rows(l.gate_up, m.normed.data(), m.gate_up.data(), n, 2 * inter, h, m.threads);
    for (int64_t r = 0; r < n; r++) {
        float *gate = m.gate_up.data() + r * 2 * inter, *act = m.gate_up.data() + r * inter;  // act[i] <- gate[i]
        for (int64_t i = 0; i < inter; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * gate[inter + i];
    }
    gemm_rows(l.down, m.gate_up.data(), m.normed.data(), n, h, inter, m.threads);
    for (int64_t i = 0; i < n * h; i++) m.x[i] += m.normed[i];
}

Layer head_layer(const Weights &w) {
    return {w.input_norm, w.qkv, nullptr, nullptr, w.o, w.post_norm, w.gate_up, w.down};
}

// An EAGLE-3 head's n rows (tokens, input hidden states [n, hidden]) from `position` on: x = hidden +
// attention([rms(embed); rms(hidden)]), then the MLP.
void eagle_rows(const Weights &w, const Shape &s, float *cache, const int64_t *table, int64_t first,
                const int64_t *tokens, int64_t position, const float *hidden, int64_t n, Scratch &m) {
    const int64_t h = s.hidden;
    for (int64_t r = 0; r < n; r++) {
        rms_norm(w.embed + tokens[r] * h, w.input_norm, m.a.data() + r * 2 * h, h, s.eps);
        rms_norm(hidden + r * h, w.hidden_norm, m.a.data() + r * 2 * h + h, h, s.eps);
    }
    const Layer layer = head_layer(w);
    attention(layer, w.cos, w.sin, s, cache, table, first, position, m.a.data(), 2 * h, n, m);
    for (int64_t i = 0; i < n * h; i++) m.x[i] = hidden[i] + m.normed[i];
    mlp(layer, s, n, m);
}

// A dense draft model's n rows through all its layers, each with its own KV cache, attending from first.
void dense_rows(const Model &d, const Shape &s, float *cache, const int64_t *table, int64_t first,
                const int64_t *tokens, int64_t position, int64_t n, Scratch &m) {
    const int64_t h = s.hidden;
    for (int64_t r = 0; r < n; r++) std::memcpy(m.x.data() + r * h, d.embed + tokens[r] * h, sizeof(float) * h);
    for (int64_t l = 0; l < d.num_layers; l++) {
        for (int64_t r = 0; r < n; r++) rms_norm(m.x.data() + r * h, d.layers[l].input_norm, m.a.data() + r * h, h, s.eps);
        attention(d.layers[l], d.cos, d.sin, s, cache + l * d.layer_stride, table, first, position, m.a.data(), h,
                  n, m);
        for (int64_t i = 0; i < n * h; i++) m.x[i] += m.normed[i];
        mlp(d.layers[l], s, n, m);
    }
}

// Whether sequence seq's rows are at consecutive positions and, with `extra` positions past its last, stay
// within its block table, the cache and the rotary tables, and at or past its first attended position.
bool rows_fit(const Shape &s, const int64_t *row_start, const int64_t *positions, const int64_t *tokens,
              const int64_t *table, int64_t seq, int64_t extra, int64_t first) {
    if (row_start[seq] >= row_start[seq + 1] || first < 0) return false;
    for (int64_t r = row_start[seq]; r < row_start[seq + 1]; r++) {
        const int64_t p = positions[r] + (r + 1 == row_start[seq + 1] ? extra : 0);
        if (r > row_start[seq] && positions[r] != positions[r - 1] + 1) return false;  // consecutive
        if (positions[r] < first || p >= s.max_positions || p / s.block_size >= s.max_blocks) return false;
        if (tokens[r] < 0 || tokens[r] >= s.vocab) return false;
        for (int64_t b = 0; b <= p / s.block_size; b++)
            if (table[b] < 0 || table[b] >= s.num_blocks) return false;
    }
    return true;
}

void head_logits(const float *norm, const float *lm_head, const Shape &s, const float *x, Scratch &m,
                 float *logits) {
    rms_norm(x, norm, m.normed.data(), s.hidden, s.eps);
    gemm_rows(lm_head, m.normed.data(), logits, 1, s.vocab, s.hidden, m.threads);
}

int64_t argmax(const float *x, int64_t n) {  // the first maximum, as torch.argmax
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

// A sequence's rows [begin, end) through rows(tokens, first position, n, first row) at once, then num_drafts - 1
// more steps of one row, each feeding the last step's argmax back in at the next position (first row -1; the
// last step's x is in m.carry then). Returns the last step's x.
template <typename Rows>
const float *draft_seq(const float *norm, const float *lm_head, const Shape &s, const int64_t *tokens,
                       const int64_t *positions, int64_t begin, int64_t end, int64_t num_drafts, int64_t *drafts,
                       float *logits, Scratch &m, Rows rows) {
    rows(tokens + begin, positions[begin], end - begin, begin);
    const float *last = m.x.data() + (end - begin - 1) * s.hidden;
    head_logits(norm, lm_head, s, last, m, logits);
    for (int64_t j = 0; j < num_drafts; j++) {
        drafts[j] = argmax(logits, s.vocab);
        if (j + 1 == num_drafts) break;
        std::memcpy(m.carry.data(), last, sizeof(float) * s.hidden);
        rows(drafts + j, positions[end - 1] + 1 + j, 1, -1);
        last = m.x.data();
        head_logits(norm, lm_head, s, last, m, logits);
    }
    return last;
}

// Whether sequence seq's drafts can run: its draft count and rows fit.
bool seq_fits(const Shape &s, int64_t seq, const int64_t *row_start, const int64_t *tokens, const int64_t *positions,
              const int64_t *firsts, const int64_t *table, const int64_t *num_drafts, int64_t max_drafts) {
    return num_drafts[seq] >= 1 && num_drafts[seq] <= max_drafts &&
           rows_fit(s, row_start, positions, tokens, table, seq, num_drafts[seq] - 1, firsts[seq]);
}

// Runs fn(seq, table, scratch) for every sequence whose rows fit (1 if one does not), a sequence per thread;
// a sequence alone splits its large GEMVs over the threads instead.
template <typename Fn>
int each_seq(const Shape &s, int64_t num_seqs, const int64_t *row_start, const int64_t *tokens,
             const int64_t *positions, const int64_t *firsts, const int64_t *block_tables,
             const int64_t *num_drafts, int64_t max_drafts, int num_threads, Fn fn) {
    if (num_seqs == 1) {
        if (!seq_fits(s, 0, row_start, tokens, positions, firsts, block_tables, num_drafts, max_drafts)) return 1;
        Scratch m(s, row_start[1] - row_start[0]);
        m.threads = num_threads;
        fn(0, block_tables, m);
        return 0;
    }
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(max : status)
    for (int64_t seq = 0; seq < num_seqs; seq++) {
        const int64_t *table = block_tables + seq * s.max_blocks;
        if (!seq_fits(s, seq, row_start, tokens, positions, firsts, table, num_drafts, max_drafts)) {
            status = 1;
            continue;
        }
        Scratch m(s, row_start[seq + 1] - row_start[seq]);
        fn(seq, table, m);
    }
    return status;
}

}  // namespace

// num_drafts[seq] >= 1 steps for each sequence, attending its positions from firsts[seq] on (the head's KV
// before it is not kept): its greedy drafts in drafts[seq * max_drafts + j], the last step's hidden state and
// logits in hidden_out[seq] and logits[seq]. hidden: [rows, in_width], the head's own states (in_width ==
// hidden) or the target's fused ones, which fc maps first. Returns 0, or 1 (having written nothing for that
// sequence) where a sequence's positions do not fit.
extern "C" int eagle3_draft_f32(const Weights *w, const Shape *s, float *cache, int64_t num_seqs,
                                const int64_t *row_start, const int64_t *tokens, const int64_t *positions,
                                const int64_t *firsts, const float *hidden, int64_t in_width,
                                const int64_t *block_tables, const int64_t *num_drafts, int64_t max_drafts,
                                int64_t *drafts, float *hidden_out, float *logits, int num_threads) {
    return each_seq(*s, num_seqs, row_start, tokens, positions, firsts, block_tables, num_drafts, max_drafts,
                    num_threads, [&](int64_t seq, const int64_t *table, Scratch &m) {
        const auto rows = [&](const int64_t *row_tokens, int64_t position, int64_t n, int64_t first_row) {
            // a chained step's hidden state is the head's own last output
            const float *in = first_row < 0 ? m.carry.data() : hidden + first_row * in_width;
            if (first_row >= 0 && in_width != s->hidden) {
                gemm_rows(w->fc, in, m.fused.data(), n, s->hidden, in_width, m.threads);
                in = m.fused.data();
            }
            eagle_rows(*w, *s, cache, table, firsts[seq], row_tokens, position, in, n, m);
        };
        const float *last = draft_seq(w->norm, w->lm_head, *s, tokens, positions, row_start[seq], row_start[seq + 1],
                                      num_drafts[seq], drafts + seq * max_drafts, logits + seq * s->vocab, m, rows);
        std::memcpy(hidden_out + seq * s->hidden, last, sizeof(float) * s->hidden);
    });
}

// The same for a dense draft model, its caches layer_stride apart.
extern "C" int dense_draft_f32(const Model *d, const Shape *s, float *cache, int64_t num_seqs,
                               const int64_t *row_start, const int64_t *tokens, const int64_t *positions,
                               const int64_t *firsts, const int64_t *block_tables, const int64_t *num_drafts,
                               int64_t max_drafts, int64_t *drafts, float *logits, int num_threads) {
    return each_seq(*s, num_seqs, row_start, tokens, positions, firsts, block_tables, num_drafts, max_drafts,
                    num_threads, [&](int64_t seq, const int64_t *table, Scratch &m) {
        const auto rows = [&](const int64_t *row_tokens, int64_t position, int64_t n, int64_t) {
            dense_rows(*d, *s, cache, table, firsts[seq], row_tokens, position, n, m);
        };
        draft_seq(d->norm, d->lm_head, *s, tokens, positions, row_start[seq], row_start[seq + 1], num_drafts[seq],
                  drafts + seq * max_drafts, logits + seq * s->vocab, m, rows);
    });
}
