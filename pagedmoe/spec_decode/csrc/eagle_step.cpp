// The draft steps of an EAGLE-3 head (spec_decode/eagle.py) in float32, every op of its decoder layer in one
// call: at a head of hidden size 128 eager PyTorch spends ~0.6 ms a step dispatching ~40 small ops, this
// ~50 us a row. Each row r (token, position, input hidden state; a sequence's rows in order) does
//   a = [rms(embed[token]) * w_in ; rms(hidden) * w_hidden]; q, k, v = W_qkv a; neox RoPE of q, k;
//   k, v into the row's KV slot; attention over positions 0..p of the sequence's blocks;
//   x = hidden + W_o attn; x += W_down (silu(gate) * up) with [gate; up] = W_gate_up rms(x) * w_post
// and the last row of each sequence gives the logits W_lm rms(x) * w_norm; its argmax is the draft, which with
// its x as the hidden state is the next step's one row, for as many drafts as asked (greedy drafting).
// The KV cache is one layer's: [2 * num_kv_heads, num_blocks, block_size, head_dim], K heads then V heads.
// Built and loaded by spec_decode/fused_eagle.py, which falls back to the PyTorch modules where it cannot be.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Weights {
    const float *embed, *input_norm, *hidden_norm, *qkv, *o, *post_norm, *gate_up, *down, *norm, *lm_head;
    const float *cos, *sin;  // [max_positions, head_dim]
};

struct Shape {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab, num_blocks, block_size, max_blocks,
        max_positions;
    float eps, scale;
};

// y[o] = W[o] . x for a row-major [out, in] W. (Measured against an [in, out] axpy form with register
// accumulators: no faster, both stream the weights from L2.)
void gemv(const float *w, const float *x, float *y, int64_t out, int64_t in) {
    for (int64_t o = 0; o < out; o++) {
        const float *row = w + o * in;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < in; i++) dot += row[i] * x[i];
        y[o] = dot;
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

struct Scratch {
    std::vector<float> a, qkv, attn, x, normed, gate_up, scores, carry;
    explicit Scratch(const Shape &s)
        : a(2 * s.hidden), qkv((s.num_heads + 2 * s.num_kv_heads) * s.head_dim), attn(s.num_heads * s.head_dim),
          x(s.hidden), normed(s.hidden), gate_up(2 * s.intermediate), scores(s.max_positions), carry(s.hidden) {}
};

// The attention half of row (token, position, hidden): KV written into its slot, x = hidden + W_o attn.
void attention_row(const Weights &w, const Shape &s, float *cache, const int64_t *table, int64_t first,
                   int64_t token, int64_t position, const float *hidden, Scratch &m) {
    const int64_t h = s.hidden, q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
    rms_norm(w.embed + token * h, w.input_norm, m.a.data(), h, s.eps);
    rms_norm(hidden, w.hidden_norm, m.a.data() + h, h, s.eps);
    gemv(w.qkv, m.a.data(), m.qkv.data(), q_size + 2 * kv_size, 2 * h);
    const float *cos = w.cos + position * s.head_dim, *sin = w.sin + position * s.head_dim;
    rotate(m.qkv.data(), s.num_heads + s.num_kv_heads, cos, sin, s.head_dim);  // q heads then k heads
    const int64_t head_stride = s.num_blocks * s.block_size * s.head_dim;
    const int64_t slot = table[position / s.block_size] * s.block_size + position % s.block_size;
    for (int64_t kv = 0; kv < 2 * s.num_kv_heads; kv++)
        std::memcpy(cache + kv * head_stride + slot * s.head_dim, m.qkv.data() + q_size + kv * s.head_dim,
                    sizeof(float) * s.head_dim);
    attend(m.qkv.data(), cache, table, first, position + 1, s, m.scores.data(), m.attn.data());
    gemv(w.o, m.attn.data(), m.x.data(), h, q_size);
    for (int64_t i = 0; i < h; i++) m.x[i] += hidden[i];
}

// The MLP half, x += W_down (silu(gate) * up), in place.
void mlp_row(const Weights &w, const Shape &s, Scratch &m) {
    const int64_t h = s.hidden, inter = s.intermediate;
    rms_norm(m.x.data(), w.post_norm, m.normed.data(), h, s.eps);
    gemv(w.gate_up, m.normed.data(), m.gate_up.data(), 2 * inter, h);
    float *act = m.gate_up.data();
    for (int64_t i = 0; i < inter; i++) act[i] = act[i] / (1.0f + expf(-act[i])) * act[inter + i];
    gemv(w.down, act, m.normed.data(), h, inter);
    for (int64_t i = 0; i < h; i++) m.x[i] += m.normed[i];
}

// Whether sequence seq's rows, and `extra` positions past its last, stay within its block table, the cache
// and the rotary tables, and at or past its first attended position.
bool rows_fit(const Shape &s, const int64_t *row_start, const int64_t *positions, const int64_t *tokens,
              const int64_t *table, int64_t seq, int64_t extra, int64_t first) {
    if (row_start[seq] >= row_start[seq + 1] || first < 0) return false;
    for (int64_t r = row_start[seq]; r < row_start[seq + 1]; r++) {
        const int64_t p = positions[r] + (r + 1 == row_start[seq + 1] ? extra : 0);
        if (positions[r] < first || p >= s.max_positions || p / s.block_size >= s.max_blocks) return false;
        if (tokens[r] < 0 || tokens[r] >= s.vocab) return false;
        for (int64_t b = 0; b <= p / s.block_size; b++)
            if (table[b] < 0 || table[b] >= s.num_blocks) return false;
    }
    return true;
}

void head_logits(const Weights &w, const Shape &s, Scratch &m, float *logits) {
    rms_norm(m.x.data(), w.norm, m.normed.data(), s.hidden, s.eps);
    gemv(w.lm_head, m.normed.data(), logits, s.vocab, s.hidden);
}

int64_t argmax(const float *x, int64_t n) {  // the first maximum, as torch.argmax
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

// Sequence seq's rows, then num_drafts - 1 more steps, each feeding the last step's argmax back in at the
// next position with the head's own output as its hidden state.
void draft_seq(const Weights &w, const Shape &s, float *cache, const int64_t *table, int64_t first,
               const int64_t *tokens, const int64_t *positions, const float *hidden, int64_t begin, int64_t end,
               int64_t num_drafts, int64_t *drafts, float *logits, Scratch &m) {
    for (int64_t r = begin; r < end; r++) {
        attention_row(w, s, cache, table, first, tokens[r], positions[r], hidden + r * s.hidden, m);
        mlp_row(w, s, m);
    }
    head_logits(w, s, m, logits);
    for (int64_t j = 0; j < num_drafts; j++) {
        drafts[j] = argmax(logits, s.vocab);
        if (j + 1 == num_drafts) break;
        m.carry = m.x;
        attention_row(w, s, cache, table, first, drafts[j], positions[end - 1] + 1 + j, m.carry.data(), m);
        mlp_row(w, s, m);
        head_logits(w, s, m, logits);
    }
}

}  // namespace

// num_drafts[seq] >= 1 steps for each sequence, attending its positions from firsts[seq] on (the head's KV
// before it is not kept): its greedy drafts in drafts[seq * max_drafts + j], the last step's hidden state and
// logits in hidden_out[seq] and logits[seq]. Returns 0, or 1 (having written nothing for that sequence) where
// a sequence's positions do not fit.
extern "C" int eagle3_draft_f32(const Weights *w, const Shape *s, float *cache, int64_t num_seqs,
                                const int64_t *row_start, const int64_t *tokens, const int64_t *positions,
                                const int64_t *firsts, const float *hidden, const int64_t *block_tables,
                                const int64_t *num_drafts, int64_t max_drafts, int64_t *drafts, float *hidden_out,
                                float *logits, int num_threads) {
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(max : status)
    for (int64_t seq = 0; seq < num_seqs; seq++) {
        const int64_t *table = block_tables + seq * s->max_blocks;
        if (num_drafts[seq] < 1 || num_drafts[seq] > max_drafts ||
            !rows_fit(*s, row_start, positions, tokens, table, seq, num_drafts[seq] - 1, firsts[seq])) {
            status = 1;
            continue;
        }
        Scratch m(*s);
        draft_seq(*w, *s, cache, table, firsts[seq], tokens, positions, hidden, row_start[seq], row_start[seq + 1],
                  num_drafts[seq], drafts + seq * max_drafts, logits + seq * s->vocab, m);
        std::memcpy(hidden_out + seq * s->hidden, m.x.data(), sizeof(float) * s->hidden);
    }
    return status;
}
