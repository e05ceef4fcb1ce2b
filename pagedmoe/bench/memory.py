"""`pagedmoe bench memory`: KV-cache utilization of paged vs static (pre-paged) allocation in one engine.

Workload: ShareGPT-like lognormal prompt and output lengths. Each request's sampled output length stands in
for its EOS (it is the request's max_tokens); the static allocator reserves prompt + `--max-tokens` (2048)
slots contiguously at admission, as a pre-paged server must for max_tokens=2048.
Utilization per step = slots holding real tokens / slots allocated; reported averaged over steps."""
import argparse
import json
import math
import os
import tempfile
import time

import torch
import transformers

from pagedmoe.bench.workload import BenchRequest
from pagedmoe.llm import LLM
from pagedmoe.sampling_params import SamplingParams


def lognormal_workload(num_requests: int, vocab_size: int, seed: int, prompt_median: float = 120,
                       output_median: float = 220, sigma: float = 0.9, max_tokens: int = 2048) -> list[BenchRequest]:
    g = torch.Generator().manual_seed(seed)
    draw = lambda median: torch.exp(math.log(median) + sigma * torch.randn(num_requests, generator=g))
    prompts = draw(prompt_median).clamp(4, 1024).long().tolist()
    outputs = draw(output_median).clamp(1, max_tokens).long().tolist()
    return [BenchRequest(torch.randint(10, vocab_size - 10, (n,), generator=g).tolist(), m)
            for n, m in zip(prompts, outputs)]


def tiny_model(path: str) -> str:
    """A small random Qwen3 (memory behaviour does not depend on the weights)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        cfg = transformers.Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=4096, eos_token_id=None)
        transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def run_mode(model: str, mode: str, workload: list[BenchRequest], num_kv_blocks: int, max_tokens: int) -> dict:
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=num_kv_blocks, kv_allocation=mode,
              static_reserve_tokens=max_tokens, max_num_seqs=256, max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    engine = llm.engine
    for i, req in enumerate(workload):
        engine.add_request(str(i), {"prompt_token_ids": req.prompt_token_ids},
                           SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True))
    utilization, peak, start = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        used = engine.kv.pool.num_used_blocks * engine.config.block_size
        if used:
            utilization.append(sum(s.num_computed_tokens for s in engine.scheduler.running) / used)
        peak = max(peak, len(engine.scheduler.running))
    elapsed, stats = time.perf_counter() - start, engine.get_stats()
    return {"mode": mode, "kv_utilization_mean": sum(utilization) / len(utilization), "utilization": utilization,
            "peak_concurrent_seqs": peak, "preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap,
            "output_tok_s": stats.num_generation_tokens / elapsed, "elapsed_s": elapsed, "num_steps": len(utilization)}


def plot(results: list[dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in results:
        ax.plot(r["utilization"], label=f"{r['mode']} (mean {r['kv_utilization_mean']:.1%})")
    ax.axhspan(0.204, 0.382, color="grey", alpha=0.2, label="vLLM paper: pre-paged systems 20.4-38.2%")
    ax.set(xlabel="engine step", ylabel="KV slots holding tokens / allocated", ylim=(0, 1.05))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="pagedmoe bench memory")
    parser.add_argument("--model", default=None, help="HF model dir (default: a tiny random Qwen3)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    model = args.model or tiny_model(os.path.join(tempfile.gettempdir(), "pagedmoe-memory-bench-model"))
    vocab = transformers.AutoConfig.from_pretrained(model).vocab_size
    workload = lognormal_workload(args.num_prompts, vocab, args.workload_seed, max_tokens=args.max_tokens)
    results = [run_mode(model, mode, workload, args.num_kv_blocks, args.max_tokens) for mode in ("static", "paged")]
    for r in results:
        print(f"{r['mode']:>7}: KV utilization {r['kv_utilization_mean']:.1%}  peak concurrent "
              f"{r['peak_concurrent_seqs']}  preemptions {r['preemptions']}  {r['output_tok_s']:.0f} output tok/s")
    if args.plot:
        plot(results, args.plot)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results
