"""`pagedmoe bench offload --model DIR`: the all-resident engine, then the same model with its routed experts
offloaded (`--expert-cache-memory`) at each --budgets fraction of its expert bytes, with and without the
next-layer prefetch (each --prefetch mode), one after another in one process: decode tokens/s at each batch size (best of --iters),
the expert cache's hit rate, the prefetch's accuracy and the bytes read from the checkpoint per generated token
(prefill steps included). Prompts: random token ids, or with --text FILE, passages of that text (for the
bundled model: its own routing on the corpus it was trained on)."""
import argparse
import gc
import json
import random

import torch
from transformers import AutoTokenizer

from pagedmoe.bench.latency import batch_figures, run_batch
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.cpu_info import describe_cpu
from pagedmoe.layers.moe.offload.store import expert_refs
from pagedmoe.llm import LLM
from pagedmoe.worker.model_loader import weight_files


def total_expert_bytes(model_dir: str, dtype: torch.dtype) -> int:
    """The routed experts' bytes in the engine's dtype, from the checkpoint's headers."""
    return sum(ref.numel() for path in weight_files(model_dir) for ref in expert_refs(path).values()) * dtype.itemsize


class Prompts:
    """Seeded prompts of --input-len tokens: random ids, or passages of --text."""

    def __init__(self, args, vocab_size: int):
        self.args, self.vocab_size = args, vocab_size
        self.ids = None
        if args.text:
            with open(args.text) as f:
                self.ids = AutoTokenizer.from_pretrained(args.model, model_max_length=1 << 30)(f.read())["input_ids"]

    def batch(self, batch_size: int, seed: int) -> list[BenchRequest]:
        rng, n = random.Random(seed), self.args.input_len
        if self.ids is None:
            return [BenchRequest([rng.randrange(1, self.vocab_size) for _ in range(n)], self.args.output_len)
                    for _ in range(batch_size)]
        starts = [rng.randrange(0, len(self.ids) - n) for _ in range(batch_size)]
        return [BenchRequest(self.ids[s:s + n], self.args.output_len) for s in starts]


def decode_tok_s(llm: LLM, prompts: Prompts, batch_size: int, iters: int) -> float:
    best = 0.0
    for i in range(iters):
        figures = batch_figures(*run_batch(llm, prompts.batch(batch_size, 1000 * batch_size + i), None))
        best = max(best, batch_size * figures["num_decode_steps"] / figures["decode_s"])
    return best


def cache_counters(llm: LLM) -> tuple:
    stats = llm.engine.get_stats()
    cache = stats.expert_cache
    if cache is None:
        return 0, 0, 0, 0, 0, stats.num_generation_tokens
    return (cache.hits, cache.misses, cache.bytes_loaded, cache.prefetch_predicted, cache.prefetch_correct,
            stats.num_generation_tokens)


def bench_config(args, prompts: Prompts, fraction: float | None, prefetch: str, expert_bytes: int) -> dict:
    budget = None if fraction is None else int(fraction * expert_bytes)
    llm = LLM(args.model, dtype=args.dtype, expert_cache_memory=budget, expert_prefetch=prefetch)
    run_batch(llm, prompts.batch(2, 99)[:2], None)  # warm-up
    before = cache_counters(llm)
    decode = {b: decode_tok_s(llm, prompts, b, args.iters) for b in args.batch_sizes}
    hits, misses, loaded, predicted, correct, tokens = (a - b for a, b in zip(cache_counters(llm), before))
    row = {"budget_fraction": fraction, "budget_bytes": budget, "prefetch": prefetch, "decode_tok_s": decode,
           "hit_rate": hits / max(hits + misses, 1), "prefetch_accuracy": correct / max(predicted, 1),
           "bytes_read_per_token": loaded / max(tokens, 1)}
    del llm
    gc.collect()
    return row


def format_lines(result: dict) -> list[str]:
    sizes, rows = result["batch_sizes"], result["rows"]
    resident = next((r for r in rows if r["budget_fraction"] is None), None)
    lines = [f"machine: {result['machine']}, {result['threads']} threads; {result['model']} ({result['dtype']}), "
             f"experts {result['expert_bytes'] / 2**20:.1f} MiB",
             f"{'budget':<16}" + "".join(f"{'decode b' + str(b):>20}" for b in sizes)
             + f"{'hit rate':>10}{'prefetch ok':>12}{'MiB read/tok':>14}"]
    for row in rows:
        name = "all resident" if row["budget_fraction"] is None else \
            f"{row['budget_fraction']:g} {row['prefetch']}"
        cells = "".join(f"{row['decode_tok_s'][b]:>10.1f} ({row['decode_tok_s'][b] / resident['decode_tok_s'][b]:.2f}x)"
                        if resident else f"{row['decode_tok_s'][b]:>20.1f}" for b in sizes)
        lines.append(f"{name:<16}{cells}{row['hit_rate']:>10.3f}{row['prefetch_accuracy']:>12.3f}"
                     f"{row['bytes_read_per_token'] / 2**20:>14.2f}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedmoe bench offload", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25, 0.5],
                        help="fractions of the routed experts' bytes the cache may hold")
    parser.add_argument("--prefetch", nargs="+", choices=["off", "readahead", "slots"],
                        default=["off", "readahead", "slots"], help="prefetch modes to run at each budget")
    parser.add_argument("--no-resident", action="store_true", help="skip the all-resident engine (too large)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--text", default=None, help="prompts: passages of this text file (default: random ids)")
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    probe = LLM(args.model, dtype=args.dtype, expert_cache_memory=1 << 62)  # every expert fits: nothing read yet
    dtype, vocab_size = probe.engine.config.torch_dtype, probe.engine.config.hf_config.vocab_size
    del probe
    expert_bytes, prompts = total_expert_bytes(args.model, dtype), Prompts(args, vocab_size)
    configs = ([] if args.no_resident else [(None, "off")]) + [(f, p) for f in args.budgets for p in args.prefetch]
    result = {"machine": describe_cpu(), "threads": torch.get_num_threads(), "model": args.model,
              "dtype": str(dtype).removeprefix("torch."), "expert_bytes": expert_bytes,
              "batch_sizes": args.batch_sizes, "text": args.text,
              "rows": [bench_config(args, prompts, f, p, expert_bytes) for f, p in configs]}
    print("\n".join(format_lines(result)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
