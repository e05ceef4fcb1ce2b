"""`pagedmoe bench offload --model DIR`: the all-resident engine, then the same model with its routed experts
offloaded (`--expert-cache-memory`) at each --budgets fraction of its expert bytes, with each next-layer
prefetch mode (--prefetch), all loaded in one process and run in rounds (each round: the same batch on every
engine in turn, so drift hits all alike): decode tokens/s at each batch size (best of --iters rounds),
the expert cache's hit rate, the prefetch's accuracy and the bytes read from the checkpoint per generated token
(prefill steps included). Prompts: random token ids, or with --text FILE, passages of that text (for the
bundled model: its own routing on the corpus it was trained on)."""
import argparse
import json
import random

import torch
from transformers import AutoTokenizer

from pagedmoe.bench.latency import batch_figures, run_batch
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.config import EngineConfig
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


def decode_tok_s(llm: LLM, batch: list[BenchRequest]) -> float:
    figures = batch_figures(*run_batch(llm, batch, None))
    return len(batch) * figures["num_decode_steps"] / figures["decode_s"]


def cache_counters(llm: LLM) -> tuple:
    stats = llm.engine.get_stats()
    cache = stats.expert_cache
    if cache is None:
        return 0, 0, 0, 0, 0, stats.num_generation_tokens
    return (cache.hits, cache.misses, cache.bytes_loaded, cache.prefetch_predicted, cache.prefetch_correct,
            stats.num_generation_tokens)


def load_engine(args, prompts: "Prompts", budget: int | None, prefetch: str) -> LLM:
    num_blocks = max(args.batch_sizes) * -(-(args.input_len + args.output_len) // 16) + 16
    llm = LLM(args.model, dtype=args.dtype, expert_cache_memory=budget, expert_prefetch=prefetch,
              num_kv_blocks=num_blocks)
    run_batch(llm, prompts.batch(2, 99), None)  # warm-up
    return llm


def bench_rounds(engines: dict, prompts: "Prompts", args) -> dict:
    """Each round runs the same batch on every engine in turn, so a host whose speed drifts slows all alike;
    each engine's best round per batch size, and its counters over all rounds."""
    before = {name: cache_counters(llm) for name, llm in engines.items()}
    best = {name: dict.fromkeys(args.batch_sizes, 0.0) for name in engines}
    for i in range(args.iters):
        for size in args.batch_sizes:
            batch = prompts.batch(size, 1000 * size + i)
            for name, llm in engines.items():
                best[name][size] = max(best[name][size], decode_tok_s(llm, batch))
    return {name: row_of(best[name], before[name], cache_counters(llm)) for name, llm in engines.items()}


def row_of(decode: dict, before: tuple, after: tuple) -> dict:
    hits, misses, loaded, predicted, correct, tokens = (a - b for a, b in zip(after, before))
    return {"decode_tok_s": decode, "hit_rate": hits / max(hits + misses, 1),
            "prefetch_accuracy": correct / max(predicted, 1), "bytes_read_per_token": loaded / max(tokens, 1)}


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
    config = EngineConfig(args.model, dtype=args.dtype)
    dtype, vocab_size = config.torch_dtype, config.hf_config.vocab_size
    expert_bytes, prompts = total_expert_bytes(args.model, dtype), Prompts(args, vocab_size)
    configs = ([] if args.no_resident else [(None, "off")]) + [(f, p) for f in args.budgets for p in args.prefetch]
    engines = {config: load_engine(args, prompts, None if config[0] is None else int(config[0] * expert_bytes),
                                   config[1]) for config in configs}
    rows = bench_rounds(engines, prompts, args)
    result = {"machine": describe_cpu(), "threads": torch.get_num_threads(), "model": args.model,
              "dtype": str(dtype).removeprefix("torch."), "expert_bytes": expert_bytes,
              "batch_sizes": args.batch_sizes, "text": args.text,
              "rows": [{"budget_fraction": f, "budget_bytes": None if f is None else int(f * expert_bytes),
                        "prefetch": p} | rows[(f, p)] for f, p in configs]}
    print("\n".join(format_lines(result)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
