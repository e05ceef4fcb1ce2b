"""`pagedmoe bench router`: two pagedmoe replicas (subprocesses, --replica-threads each) behind `pagedmoe
router`, round robin against cache-aware on a shared-prefix workload: --num-prefixes system prompts of
--prefix-len tokens, each request one of them plus --suffix-len tokens of its own, streamed at
--request-rate. Each policy gets prefixes of its own (no hits carried over from the other) and the replicas'
pools hold --replica-kv-blocks blocks each: enough for half the prefixes, which is what cache-aware routing
asks of each replica and round robin asks twice over. Per policy: prefix-cache hit rate (the replicas'
counters), TTFT p50 / p99 and output tok/s."""
import argparse
import asyncio
import random
import re

import httpx

from pagedmoe.bench.report import print_and_save
from pagedmoe.bench.serve import sweep
from pagedmoe.bench.server import subprocess_server
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.cpu_info import describe_cpu
from pagedmoe.entrypoints.cli import DEFAULT_MODEL
from pagedmoe.entrypoints.router import Router, router_in_thread


def shared_prefix_workload(args, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    return [BenchRequest(prefixes[rng.randrange(args.num_prefixes)] + [rng.randrange(2, vocab)
                                                                       for _ in range(args.suffix_len)],
                         args.output_len) for _ in range(args.num_requests)]


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [sum(float(v) for v in re.findall(rf"^pagedmoe:prefix_cache_{name}_total{{.*}} (\S+)$", text, re.M))
              for name in ("queries", "hits")]
    return values[0], values[1]


def bench_policy(policy: str, replicas: list[str], workload: list[BenchRequest], args) -> dict:
    before = [prefix_counters(url) for url in replicas]
    router = Router(replicas, policy)
    with router_in_thread(router) as url:
        swept = asyncio.run(sweep(url, None, [workload], [args.request_rate], 0, None, None, 1800, 600))
        routed = list(router.routed)
    after = [prefix_counters(url) for url in replicas]
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    row = swept["rates"][0]
    return {"policy": policy, "routed": routed, "prefix_hit_rate": hits / queries if queries else 0.0,
            "ttft_p50_ms": row["ttft_p50_ms"], "ttft_p99_ms": row["ttft_p99_ms"], "output_tok_s": row["output_tok_s"],
            "completed": row["completed"], "failed": row["failed"]}


def run(args) -> dict:
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    engine = {"num_threads": args.replica_threads, "num_kv_blocks": args.replica_kv_blocks}
    with subprocess_server(args.model, engine) as a, subprocess_server(args.model, engine) as b:
        rows = [bench_policy(policy, [a, b], shared_prefix_workload(args, vocab, seed), args)
                for seed, policy in enumerate(args.policies)]
    return {"machine": describe_cpu(), "model": args.model, "args": vars(args), "policies": rows}


def format_lines(result: dict) -> list[str]:
    lines = [f"machine: {result['machine']}; {result['model']}",
             f"{'policy':<12} {'hit rate':>8} {'TTFT p50 ms':>11} {'p99 ms':>8} {'out tok/s':>9}  routed"]
    for r in result["policies"]:
        lines.append(f"{r['policy']:<12} {100 * r['prefix_hit_rate']:>7.1f}% {r['ttft_p50_ms']:>11.1f} "
                     f"{r['ttft_p99_ms']:>8.1f} {r['output_tok_s']:>9.1f}  {r['routed']} ({r['failed']} failed)")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedmoe bench router", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=8.0)
    parser.add_argument("--replica-threads", type=int, default=1)
    parser.add_argument("--replica-kv-blocks", type=int, default=160, help="per replica; 8 prefixes of 512 "
                        "tokens are 256 blocks")
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return print_and_save(run(args), format_lines, args.output_json)
