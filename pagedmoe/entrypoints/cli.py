import argparse
import dataclasses
import os
import sys

from pagedmoe.config import EngineConfig

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "models", "pagedmoe-moe-default")


def add_engine_args(parser: argparse.ArgumentParser):
    """Every EngineConfig field becomes --flag-name with the field's type and default."""
    for field in dataclasses.fields(EngineConfig):
        if not field.init or field.name == "model":
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.type is bool or field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=_arg_type(field), default=field.default)


def _arg_type(field):
    text = str(field.type)
    return int if "int" in text else float if "float" in text else str


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The flags given other values than their field's default (so vLLM's mapped arguments, such as
    gpu_memory_utilization on CPU, meet no default of the field they map onto)."""
    fields = [f for f in dataclasses.fields(EngineConfig) if f.init and f.name != "model"]
    return {f.name: getattr(args, f.name) for f in fields if getattr(args, f.name) != f.default}


def cmd_generate(args):
    from pagedmoe import LLM, SamplingParams
    llm = LLM(args.model or DEFAULT_MODEL, **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    for output in llm.generate(args.prompt, params, use_tqdm=False):
        print(f"--- prompt: {output.prompt!r}\n{output.prompt}{output.outputs[0].text}")


def cmd_serve(args):
    from pagedmoe.entrypoints.openai.cli_args import main as serve_main
    serve_main(args)


def cmd_run(args):
    """pagedmoe's main job: a few offline generations, then the OpenAI server, on the bundled model."""
    from pagedmoe.entrypoints.demo import run_demo
    run_demo(DEFAULT_MODEL)
    if os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")):
        serve = build_parser().parse_args(["serve", "--dtype", "float32"])
        print(f"\nserving {DEFAULT_MODEL} on http://127.0.0.1:{serve.port} (dashboard: /dashboard); Ctrl-C stops")
        cmd_serve(serve)


def cmd_bench(args):
    from pagedmoe.bench.cli import main as bench_main
    bench_main(["-h"] if args.bench_help else args.bench_args)


def cmd_router(args):
    from pagedmoe.entrypoints.router import main as router_main
    router_main(args)


def cmd_quantize(args):
    from pagedmoe.layers.quantization.quantize import quantize_checkpoint
    stats = quantize_checkpoint(args.src, args.dst, args.format)
    print(f"{args.dst}: {stats['quantized']} tensors quantized to {args.format}, "
          f"{stats['bytes_before'] / 2**20:.1f} MiB -> {stats['bytes_after'] / 2**20:.1f} MiB")


def _add_router_parser(sub):
    from pagedmoe.entrypoints.routing_policies import add_router_args
    router = sub.add_parser("router", help="one address in front of several replicas (round robin, cache-aware)")
    add_router_args(router)
    router.set_defaults(func=cmd_router)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmoe", description="MoE + PagedAttention inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation for one or more prompts")
    gen.add_argument("--model", default=None, help="HF model directory (default: the bundled model)")
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    sub.add_parser("run", help="pagedmoe's main job on the bundled default model").set_defaults(func=cmd_run)
    from pagedmoe.entrypoints.openai.cli_args import add_serve_args
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a live /dashboard")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    quantize = sub.add_parser("quantize", help="write a checkpoint's weights as MXFP4, NVFP4 or FP8")
    quantize.add_argument("--format", required=True, choices=("mxfp4", "nvfp4", "fp8"),
                          help="mxfp4: gpt-oss's experts, as OpenAI ships them; nvfp4: NVIDIA ModelOpt's (weights "
                               "only); fp8: DeepSeek-V3's 128x128 blocks")
    quantize.add_argument("src", help="a float checkpoint directory (safetensors)")
    quantize.add_argument("dst", help="the directory to write")
    quantize.set_defaults(func=cmd_quantize)
    _add_router_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks (pagedmoe bench -h)", add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.add_argument("-h", "--help", dest="bench_help", action="store_true")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
