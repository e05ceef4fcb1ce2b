// A MoE layer's router for decode-sized batches in one call: the gate's logits in float32 (rounded to bf16 for
// a bf16 model, whose router outputs bf16 logits), each token's top-k experts and their weights, and the
// step's routed-token counts per expert. Eager PyTorch takes six ops for it (about 45 us a layer at one token
// on gpt-oss-200m). The PyTorch routers (routers.py) stay the reference: the sums here run in another order,
// so weights agree to float rounding; equal scores are ordered as torch.topk orders them.
// Built and loaded by pagedmoe/layers/moe/cpu_router.py.
#include <algorithm>
#include <utility>
#include <vector>

#include "../../csrc/tile_gemm.h"

namespace {

using tile_gemm::BF16;
using tile_gemm::store;
using tile_gemm::to_float;

// kind 0: softmax over all experts, then the top k (renormalised where asked); kind 1 (gpt-oss): the top k
// logits, then a softmax over those k. Weights are times scaling.
struct Router {
    const float *gate, *bias;  // [experts, hidden], [experts] or null
    int64_t hidden, experts, top_k, kind, renormalize, round_bf16;
    float scaling;
};

float rounded_to_bf16(float v) {
    BF16 b;
    store(b, v);
    return to_float(b);
}

// ids[0..k) = the k largest scores, largest first, as torch.topk computes them on CPU (ATen's TopKImpl.h):
// the same std algorithms and comparator, so that equal scores come out in the same order.
using Scored = std::pair<double, int64_t>;
void top_k(const float *scores, int64_t n, int64_t k, int64_t *ids, std::vector<Scored> &queue) {
    queue.resize(n);
    for (int64_t e = 0; e < n; e++) queue[e] = {scores[e], e};
    const auto greater = [](const Scored &x, const Scored &y) {
        return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
    };
    if (k * 64 <= n) {
        std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), greater);
    } else {
        std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), greater);
        std::sort(queue.begin(), queue.begin() + k - 1, greater);
    }
    for (int64_t j = 0; j < k; j++) ids[j] = queue[j].second;
}

void softmax(float *v, int64_t n) {
    float max = v[0], sum = 0.0f;
    for (int64_t i = 1; i < n; i++) max = std::max(max, v[i]);
    for (int64_t i = 0; i < n; i++) sum += v[i] = std::exp(v[i] - max);
    for (int64_t i = 0; i < n; i++) v[i] /= sum;
}

// One token's experts and weights from its logits (overwritten).
void select(const Router &r, float *logits, float *weights, int64_t *ids, std::vector<Scored> &queue) {
    if (r.kind == 1) {
        top_k(logits, r.experts, r.top_k, ids, queue);
        for (int64_t j = 0; j < r.top_k; j++) weights[j] = logits[ids[j]];
        softmax(weights, r.top_k);
    } else {
        softmax(logits, r.experts);
        top_k(logits, r.experts, r.top_k, ids, queue);
        float sum = 0.0f;
        for (int64_t j = 0; j < r.top_k; j++) sum += weights[j] = logits[ids[j]];
        for (int64_t j = 0; j < r.top_k && r.renormalize; j++) weights[j] /= sum;
    }
    for (int64_t j = 0; j < r.top_k; j++) weights[j] *= r.scaling;
}

template <typename T>
void route(const Router &r, const T *x, int64_t tokens, float *weights, int64_t *ids, int64_t *counts,
           int num_threads) {
#pragma omp parallel num_threads(num_threads) if (tokens * r.experts * r.hidden >= (1 << 20))
    {
        std::vector<float> logits(r.experts), row(r.hidden);
        std::vector<Scored> queue;
#pragma omp for
        for (int64_t t = 0; t < tokens; t++) {
            for (int64_t i = 0; i < r.hidden; i++) row[i] = to_float(x[t * r.hidden + i]);
            for (int64_t e = 0; e < r.experts; e++) {
                const float *w = r.gate + e * r.hidden;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < r.hidden; i++) sum += row[i] * w[i];
                logits[e] = r.bias ? sum + r.bias[e] : sum;
                if (r.round_bf16) logits[e] = rounded_to_bf16(logits[e]);
            }
            select(r, logits.data(), weights + t * r.top_k, ids + t * r.top_k, queue);
        }
    }
    for (int64_t p = 0; counts && p < tokens * r.top_k; p++) counts[ids[p]]++;
}

}  // namespace

// weights float32 [tokens, top_k], ids int64 [tokens, top_k]; counts int64 [experts] (added to) or null.
#define EXPORT(SUFFIX, T)                                                                                 \
    extern "C" void route_##SUFFIX(const Router *router, const T *x, int64_t tokens, float *weights,      \
                                   int64_t *ids, int64_t *counts, int num_threads) {                      \
        route(*router, x, tokens, weights, ids, counts, num_threads);                                     \
    }
EXPORT(f32, float)
EXPORT(bf16, BF16)
