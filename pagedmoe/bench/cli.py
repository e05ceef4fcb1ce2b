import argparse
import json
import platform

import torch
import transformers

from pagedmoe.entrypoints.cli import DEFAULT_MODEL, add_engine_args, engine_kwargs


def _throughput(args):
    from pagedmoe.bench.baselines import BASELINES
    from pagedmoe.bench.throughput import pagedmoe_throughput
    from pagedmoe.bench.workload import parse_range, random_workload, sharegpt_workload
    from pagedmoe.llm import LLM
    llm = LLM(args.model, **engine_kwargs(args) | {"skip_tokenizer_init": not args.dataset})
    vocab = llm.engine.config.hf_config.vocab_size
    workload = (sharegpt_workload(args.dataset, llm.get_tokenizer(), args.num_prompts) if args.dataset else
                random_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                                vocab, args.workload_seed))
    results = {"command": "pagedmoe bench throughput", "args": vars(args) | {"func": None}, "env": _env(),
               "pagedmoe": pagedmoe_throughput(llm, workload)}
    for name in args.baseline:
        results[name] = BASELINES[name](args.model, llm.engine.config.torch_dtype, workload)
        results[f"ratio_vs_{name}"] = results["pagedmoe"]["output_tok_s"] / results[name]["output_tok_s"]
    _report(results, args.output_json)


def _env() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}


def _report(results: dict, output_json: str | None):
    for key, value in results.items():
        if isinstance(value, dict) and "output_tok_s" in value:
            print(f"{value['engine']:>14}: {value['output_tok_s']:8.1f} output tok/s  {value['total_tok_s']:8.1f} "
                  f"total tok/s  {value['requests_s']:6.2f} req/s  ({value['elapsed_s']:.1f} s)")
        elif key.startswith("ratio"):
            print(f"{key}: {value:.2f}x")
    if output_json:
        with open(output_json, "w") as f:
            json.dump(results, f, indent=2, default=str)


def _moe(args):
    from pagedmoe.bench.moe import main as moe_main
    moe_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmoe bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    tp = sub.add_parser("throughput", help="offline throughput on a seeded workload")
    tp.add_argument("--model", default=DEFAULT_MODEL)
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", default="32-256", help="uniform range LOW-HIGH")
    tp.add_argument("--output-len", default="16-256", help="uniform range LOW-HIGH")
    tp.add_argument("--workload-seed", type=int, default=0)
    tp.add_argument("--dataset", default=None, help="ShareGPT-format JSON instead of random prompts")
    tp.add_argument("--baseline", action="append", default=[], choices=["hf-sequential"])
    tp.add_argument("--output-json", default=None)
    add_engine_args(tp)
    tp.set_defaults(func=_throughput)
    moe = sub.add_parser("moe", help="MoE layer: 8 vs 64 experts at equal active parameters", add_help=False)
    moe.add_argument("rest", nargs=argparse.REMAINDER)
    moe.set_defaults(func=_moe)
    return parser


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    args.func(args)
