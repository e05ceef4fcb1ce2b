"""`pagedmoe bench disagg`: one instance (chunked prefill) against 1P1D (a prefill and a decode instance behind
`pagedmoe router --prefill --decode`, --connector SharedStorageConnector or NixlConnector) on the same mixed
workload at one request rate (--num-requests prompts of --long-len tokens with --short-output tokens, every
--long-every-th request, and --short-len prompts with --long-output tokens otherwise): TTFT and ITL p50 / p99,
output tok/s. Then the connector's transfer bandwidth: a --bandwidth-tokens prompt's KV in this model's cache
shape saved and loaded (shared storage), or read by one NIXL agent from another (MB/s, best of 3)."""
import argparse
import asyncio
import json
import random
import tempfile
import time
from types import SimpleNamespace

import torch

from pagedmoe.bench.report import print_and_save
from pagedmoe.bench.serve import sweep
from pagedmoe.bench.server import subprocess_server
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.cpu_info import describe_cpu
from pagedmoe.entrypoints.cli import DEFAULT_MODEL
from pagedmoe.entrypoints.router import DisaggregatedRouter, router_in_thread
from pagedmoe.kv_transfer.connector import KVLoad, KVTransferConfig
from pagedmoe.kv_transfer.nixl_connector import NixlConnector
from pagedmoe.kv_transfer.shared_storage import SharedStorageConnector


def mixed_workload(args, vocab: int) -> list[BenchRequest]:
    rng = random.Random(0)
    shape = lambda i: (args.long_len, args.short_output) if i % args.long_every == 0 else (args.short_len, args.long_output)
    return [BenchRequest([rng.randrange(2, vocab) for _ in range(n)], out)
            for n, out in (shape(i) for i in range(args.num_requests))]


def connector_json(connector: str, role: str, path: str) -> str:
    extra = {"shared_storage_path": path} if connector == "SharedStorageConnector" else {}
    return json.dumps({"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra})


def serve_figures(url: str, workload: list[BenchRequest], rate: float) -> dict:
    row = asyncio.run(sweep(url, None, [workload], [rate], 0, None, None, 1800, 600))["rates"][0]
    return {k: row[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s", "completed",
                                "failed")}


def bench_serving(args, workload: list[BenchRequest]) -> dict:
    engine = {"num_threads": args.instance_threads, "max_num_batched_tokens": args.max_num_batched_tokens}
    store = tempfile.mkdtemp(prefix="kv-store-")
    with subprocess_server(args.model, engine) as single:
        rows = {"1 instance": serve_figures(single, workload, args.request_rate)}
    producer, consumer = (connector_json(args.connector, role, store) for role in ("kv_producer", "kv_consumer"))
    with subprocess_server(args.model, engine | {"kv_transfer_config": producer}) as p, \
            subprocess_server(args.model, engine | {"kv_transfer_config": consumer}) as d, \
            router_in_thread(DisaggregatedRouter(p, d)) as url:
        rows["1P1D"] = serve_figures(url, workload, args.request_rate)
    return rows


def bandwidth(args) -> dict:
    """MB/s of the connector's transfer of one prompt's KV, in the model's float32 cache shape."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(args.model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_blocks = -(-args.bandwidth_tokens // 16)
    cache = torch.randn(cfg.num_hidden_layers, 2 * cfg.num_key_value_heads, num_blocks, 16, head_dim)
    load = KVLoad("bench", list(range(num_blocks)), args.bandwidth_tokens, "bench")
    nbytes = cache[:, :, 0, 0].numel() * cache.element_size() * args.bandwidth_tokens
    nixl = args.connector == "NixlConnector"
    figures = (nixl_bandwidth if nixl else storage_bandwidth)(cache, load)
    return {"connector": args.connector, "tokens": args.bandwidth_tokens, "bytes": nbytes,
            "over": "UCX on loopback" if nixl else f"files under {tempfile.gettempdir()}",
            **{name: nbytes / seconds / 1e6 for name, seconds in figures.items()}}


def storage_bandwidth(cache: torch.Tensor, load: KVLoad) -> dict:
    store = tempfile.mkdtemp(prefix="kv-bw-")
    connector = SharedStorageConnector(KVTransferConfig("SharedStorageConnector",
                                                        kv_connector_extra_config={"shared_storage_path": store}))
    return {"save_mb_s": best_time(lambda: connector.save_kv(load, cache, 16)),
            "load_mb_s": best_time(lambda: connector.start_load_kv(load, cache, 16))}


def nixl_bandwidth(cache: torch.Tensor, load: KVLoad) -> dict:
    """One agent reads the other's blocks (UCX, loopback) through the connector's own handshake and read path."""
    producer, consumer = (NixlConnector(KVTransferConfig("NixlConnector", role))
                          for role in ("kv_producer", "kv_consumer"))
    local = torch.zeros_like(cache)
    producer.register_kv_caches(cache, 16)
    consumer.register_kv_caches(local, 16)
    producer.set_xfer_handshake_metadata(producer.get_handshake_metadata())
    load.remote = {"remote_engine_id": producer.config.engine_id, "remote_host": producer.host,
                   "remote_port": producer.port, "remote_block_ids": load.block_ids, "remote_request_id": "bench"}
    try:
        read = lambda: nixl_read(consumer, load)
        read()  # the handshake, once per remote engine
        figures = {"read_mb_s": best_time(read)}
        assert torch.equal(local, cache), "the NIXL read did not copy the blocks"
        return figures
    finally:
        consumer.shutdown()
        producer.shutdown()


def nixl_read(consumer: NixlConnector, load: KVLoad):
    consumer.start_load_kv(load, None, 16)
    while True:
        done = consumer.get_finished()
        if load.request_id in done.failed_recving:
            raise done.failed_recving[load.request_id]
        if load.request_id in done.finished_recving:
            return


def best_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(args) -> dict:
    from transformers import AutoConfig
    workload = mixed_workload(args, AutoConfig.from_pretrained(args.model).vocab_size)
    return {"machine": describe_cpu(), "model": args.model, "args": vars(args),
            "serving": bench_serving(args, workload), "bandwidth": bandwidth(args)}


def format_lines(result: dict) -> list[str]:
    lines = [f"machine: {result['machine']}; {result['model']}",
             f"{'setup':<11} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'out tok/s':>9}  (ms)"]
    for name, r in result["serving"].items():
        lines.append(f"{name:<11} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>8.1f} {r['itl_p50_ms']:>8.1f} "
                     f"{r['itl_p99_ms']:>8.1f} {r['output_tok_s']:>9.1f}  ({r['failed']} failed)")
    bw = result["bandwidth"]
    rates = ", ".join(f"{name[:-5]} {value:.0f} MB/s" for name, value in bw.items() if name.endswith("_mb_s"))
    lines.append(f"{bw['connector']}, {bw['tokens']} tokens ({bw['bytes'] / 1e6:.1f} MB), {bw['over']}: {rates}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedmoe bench disagg", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--long-len", type=int, default=768)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--long-output", type=int, default=64)
    parser.add_argument("--short-output", type=int, default=8)
    parser.add_argument("--long-every", type=int, default=4)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--instance-threads", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="chunked prefill's step budget")
    parser.add_argument("--bandwidth-tokens", type=int, default=1024)
    parser.add_argument("--connector", choices=("SharedStorageConnector", "NixlConnector"),
                        default="SharedStorageConnector", help="the KV connector of 1P1D and of the bandwidth figure")
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return print_and_save(run(args), format_lines, args.output_json)
