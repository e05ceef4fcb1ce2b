"""Model FLOPs of a workload, the measured matmul peak, and the run's place under that roofline.

FLOP count (multiply-add = 2 FLOPs), per token that goes through the model at position p (0-based):

    2 * M                            matmuls: M = non-embedding matmul weights a token meets
    + 2 * L * H * (d_qk + d_v) * (p + 1)   attention scores (q.k) and values (p.v) over the causal context
    + 2 * V * D                      the LM head, only at positions that sample a token

M counts every weight of 2 or more dimensions except the token embedding and the LM head. For MoE layers
it counts the ACTIVE experts only: top_k x (one expert's w13 + w2), plus (as ordinary weights) the router,
the shared experts and their gate. Norms, biases, rotary and activations are not counted. L is the number
of layers, H the query heads, d_qk / d_v the per-head score and value widths (head_dim, or for MLA, which
attends in latent space: kv_lora_rank + qk_rope_head_dim and kv_lora_rank).

A request with P prompt tokens and O output tokens feeds N = P + O - 1 tokens (the last sampled token is
never fed), at positions 0..N-1, and samples O times:

    FLOPs = 2 * M * N + 2 * L * H * (d_qk + d_v) * N * (N + 1) / 2 + 2 * V * D * O

Prefix-cache hits, recompute preemption and the last layer's skipped rows (its o_proj and MLP run only on the
rows that sample: 6-7% of a prompt's FLOPs at 12 layers) change what the engine actually runs, not these model
FLOPs: the same count for every engine, so a roofline percentage compares engines on the same work.

Bytes of a decode step (the memory side of its roofline): every weight the step touches is read once,
(dense + LM head + E_active x one expert) x weight bytes, with E_active the distinct experts the step routed
to, summed over MoE layers; and every decoding sequence reads its whole KV context, context x KV values per
token (all layers) x KV bytes. Activations and the new KV writes are not counted.
"""
import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from pagedmoe.bench.workload import BenchRequest
from pagedmoe.cpu_info import bf16_is_emulated
from pagedmoe.layers.moe.layer import FusedMoE


@dataclass
class ModelFlops:
    dense_params: int  # non-embedding matmul weights outside routed experts (attention, dense MLP, router, shared)
    active_expert_params: int  # top_k x one expert's weights, summed over MoE layers
    total_expert_params: int  # every routed expert's weights (not counted in FLOPs)
    lm_head_params: int
    num_layers: int
    num_heads: int
    qk_dim: int
    v_dim: int
    expert_params: int = 0  # one routed expert's weights (w13 + w2) in one MoE layer
    kv_values_per_token: int = 0  # cached K/V values of one token over all layers
    packed_params: int = 0  # of dense_params, those held packed in 4 bits (NVFP4 attention) ...
    packed_bytes: int = 0  # ... and their bytes as held; the others read at the run's dtype
    expert_bytes: int = 0  # one routed expert's bytes where the experts are held packed (0: at the run's dtype)

    @property
    def matmul_params(self) -> int:
        return self.dense_params + self.active_expert_params

    def token_flops(self, position: int, samples: bool) -> int:
        """FLOPs of one token at `position` (0-based), plus the LM head if it samples."""
        attention = 2 * self.num_layers * self.num_heads * (self.qk_dim + self.v_dim) * (position + 1)
        return 2 * self.matmul_params + attention + (2 * self.lm_head_params if samples else 0)

    def chunk_flops(self, start: int, num_tokens: int, samples: bool) -> int:
        """FLOPs of tokens at positions start..start+num_tokens-1 (closed form of summing token_flops)."""
        context_sum = (start + num_tokens) * (start + num_tokens + 1) // 2 - start * (start + 1) // 2
        attention = 2 * self.num_layers * self.num_heads * (self.qk_dim + self.v_dim) * context_sum
        return 2 * self.matmul_params * num_tokens + attention + (2 * self.lm_head_params if samples else 0)

    def request_flops(self, prompt_len: int, output_len: int) -> int:
        fed = prompt_len + output_len - 1
        return self.chunk_flops(0, fed, False) + 2 * self.lm_head_params * output_len

    def workload_flops(self, workload: list[BenchRequest]) -> int:
        return sum(self.request_flops(len(r.prompt_token_ids), r.output_len) for r in workload)

    def decode_bytes(self, num_steps: int, active_experts: int, context_tokens: int, element_size: int) -> dict:
        """Bytes read by num_steps decode steps that routed to active_experts experts (summed over layers and
        steps) and attended over context_tokens positions (summed over sequences and steps)."""
        dense = (self.dense_params - self.packed_params) * element_size + self.packed_bytes
        expert = self.expert_bytes or self.expert_params * element_size
        weights = (dense + self.lm_head_params * element_size) * num_steps + expert * active_experts
        kv = self.kv_values_per_token * context_tokens * element_size
        return {"weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv}


def model_flops(model: nn.Module, hf_config) -> ModelFlops:
    """Counts the weights of a pagedmoe model (a meta-device model is enough) by the rules above."""
    excluded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    excluded.add(id(model.lm_head.weight))
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    excluded |= {id(m.w13) for m in experts} | {id(m.w2) for m in experts}
    matrices = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in excluded]
    packed = [m.fp4 for m in model.modules() if getattr(m, "fp4", None) is not None]
    packed_params, packed_bytes = sum(w.numel() for w in packed), sum(w.nbytes for w in packed)
    dense = sum(p.numel() for p in matrices) + packed_params
    active = sum(m.router.top_k * expert_params(m) for m in experts)
    total = sum(m.num_experts * expert_params(m) for m in experts)
    qk_dim, v_dim = attention_dims(hf_config)
    expert = expert_params(experts[0]) if experts else 0
    num_kv_tensors, token_shape = model.kv_cache_token_shape()
    kv_values = hf_config.num_hidden_layers * num_kv_tensors * math.prod(token_shape)
    return ModelFlops(dense, active, total, model.lm_head.weight.numel(), hf_config.num_hidden_layers,
                      hf_config.num_attention_heads, qk_dim, v_dim, expert, kv_values, packed_params, packed_bytes,
                      packed_expert_bytes(experts[0]) if experts else 0)


def expert_params(moe: FusedMoE) -> int:
    """One routed expert's weights (gate, up and down), from the layer's sizes: packed 4-bit experts keep no
    dense w13 / w2 to count."""
    return 3 * moe.intermediate_size * moe.gate.in_features


def packed_expert_bytes(moe: FusedMoE) -> int:
    """One routed expert's bytes where the layer holds its experts packed in 4 bits, else 0."""
    if moe.fp4_experts is None:
        return 0
    w13, w2 = moe.fp4_experts
    return w13[0].nbytes + w2[0].nbytes


def attention_dims(hf_config) -> tuple[int, int]:
    """Per-head widths of the score and value products as the engine runs them."""
    if getattr(hf_config, "kv_lora_rank", None):
        return hf_config.kv_lora_rank + hf_config.qk_rope_head_dim, hf_config.kv_lora_rank
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return head_dim, head_dim


def synchronize(device: torch.device | str):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device: torch.device, repeats: int) -> float:
    """Shortest of `repeats` timed calls of fn after one warm-up call (first-call allocation, kernel choice)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def peak_dtype(dtype: torch.dtype, device: str) -> torch.dtype:
    """The dtype whose matmul peak bounds a model computed in dtype: float32 for bf16 on a CPU without native
    bf16, where the kernels widen bf16 to float32 (torch's own bf16 matmul, emulated, runs ~100x slower)."""
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and bf16_is_emulated():
        return torch.float32
    return dtype


def matmul_peak(dtype: torch.dtype, device: str = "cpu", size: int = 1024, repeats: int = 5) -> dict:
    """Best-of-`repeats` FLOP/s of one size^3 matmul in `dtype` (as peak_dtype bounds it) on `device`, at the
    current torch threads."""
    dtype, device = peak_dtype(dtype, device), torch.device(device)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(device, dtype) for _ in range(2))
    best = best_time(lambda: torch.mm(a, b), device, repeats)
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "threads": torch.get_num_threads(), "repeats": repeats, "best_s": best,
            "peak_flop_s": 2 * size ** 3 / best}


def read_bandwidth(device: str = "cpu", nbytes: int = 1 << 28, repeats: int = 5) -> dict:
    """Best-of-`repeats` bytes/s of one full read (a float32 sum) of an nbytes tensor, at the current threads."""
    device = torch.device(device)
    x = torch.ones(nbytes // 4, device=device)
    best = best_time(x.sum, device, repeats)
    return {"bytes": x.numel() * 4, "device": str(device), "threads": torch.get_num_threads(), "repeats": repeats,
            "best_s": best, "peak_bytes_s": x.numel() * 4 / best}


def bandwidth(moved: dict, elapsed_s: float, peak_bytes_s: float) -> dict:
    return moved | {"elapsed_s": elapsed_s, "achieved_bytes_s": moved["bytes"] / elapsed_s,
                    "bandwidth_pct": 100 * moved["bytes"] / elapsed_s / peak_bytes_s}


def roofline(flops: float, elapsed_s: float, output_tokens: int, peak_flop_s: float) -> dict:
    """The run against the peak: achieved FLOP/s, % of peak, time and output tok/s if it ran at the peak."""
    roofline_time = flops / peak_flop_s
    return {"flops": flops, "elapsed_s": elapsed_s, "achieved_flop_s": flops / elapsed_s,
            "roofline_pct": 100 * flops / elapsed_s / peak_flop_s, "roofline_time_s": roofline_time,
            "roofline_output_tok_s": output_tokens / roofline_time, "output_tok_s": output_tokens / elapsed_s}


def flops_summary(counts: ModelFlops) -> dict:
    return asdict(counts) | {"matmul_params": counts.matmul_params}
