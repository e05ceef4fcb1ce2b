"""`pagedmoe bench parallel`: one process against tensor parallelism (TP=2) and expert parallelism (EP=2) on
the same batch in one invocation (--num-requests prompts of --input-len random tokens, --output-len greedy
tokens each): output tokens/s, time per step, and rank 0's time in collectives per step (all-reduce,
all-gather, and the plan's broadcast). The tokens of every configuration are checked equal. Then EPLB on the
bundled default model's real routing (--eplb-requests Shakespeare-style generations, EP=2 with
--num-redundant-experts, rebalanced every --eplb-step-interval steps): each rebalance's max/mean rank load,
measured on the window of load since the one before (out of sample) and on the window it was computed from."""
import argparse
import random
import time

import torch

from pagedmoe.bench.report import print_and_save
from pagedmoe.cpu_info import describe_cpu
from pagedmoe.distributed import parallel_state as ps
from pagedmoe.distributed.eplb import imbalance, initial_placement, rebalance
from pagedmoe.entrypoints.cli import DEFAULT_MODEL
from pagedmoe.llm import LLM
from pagedmoe.sampling_params import SamplingParams

CONFIGS = {"1 process": {}, "TP=2": {"tensor_parallel_size": 2},
           "EP=2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
           "DP=2+EP": {"data_parallel_size": 2, "enable_expert_parallel": True}}
SPEAKERS = ["ROMEO", "JULIET", "KING LEAR", "HAMLET", "PORTIA", "OTHELLO", "MACBETH", "PUCK", "FALSTAFF", "VIOLA"]


def run_steps(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[dict, dict[str, list[int]]]:
    comm_before, tokens, num_steps = dict(ps.COMM_SECONDS), {}, 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        llm.engine.add_request(str(i), prompt, p)
    start = time.perf_counter()
    while llm.engine.has_unfinished_requests():
        tokens |= {o.request_id: o.outputs[0].token_ids for o in llm.engine.step() if o.finished}
        num_steps += 1
    elapsed = time.perf_counter() - start
    comm = {k: (v - comm_before.get(k, 0.0)) / num_steps * 1e3 for k, v in ps.COMM_SECONDS.items()}
    figures = {"elapsed_s": elapsed, "num_steps": num_steps, "step_ms": elapsed / num_steps * 1e3,
               "output_tok_s": sum(map(len, tokens.values())) / elapsed, "comm_ms_per_step": comm}
    return figures, tokens


def bench_config(model: str, engine_args: dict, args) -> tuple[dict, dict]:
    llm = LLM(model, dtype=args.dtype, skip_tokenizer_init=True, **engine_args)
    try:
        vocab, rng = llm.engine.config.hf_config.vocab_size, random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(args.input_len)]}
                   for _ in range(args.num_requests)]
        params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)] * len(prompts)
        run_steps(llm, prompts[:2], params[:2])  # warm-up
        return run_steps(llm, prompts, params)
    finally:
        llm.engine.shutdown()


def bench_eplb(args) -> dict:
    llm = LLM(DEFAULT_MODEL, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              num_redundant_experts=args.num_redundant_experts, eplb_window_size=args.eplb_step_interval,
              eplb_step_interval=args.eplb_step_interval)
    try:
        prompts = [f"{SPEAKERS[i % len(SPEAKERS)]}:\n" for i in range(args.eplb_requests)]
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.eplb_output_len, ignore_eos=True)
                  for i in range(len(prompts))]
        figures, _ = run_steps(llm, prompts, params)
        history = [{"step": s, "current_placement": before, "new_placement": after}
                   for s, before, after in llm.engine.runner.eplb.history]
        return {"run": figures, "rebalances": history, "what_if": what_if(llm.engine.expert_load.double())}
    finally:
        llm.engine.shutdown()


def what_if(load: torch.Tensor) -> list[dict]:
    """The run's whole expert load [layers, E] placed on more ranks than this machine runs: contiguous
    experts (no EPLB) against EPLB with one redundant slot per rank, max/mean rank load averaged over layers."""
    rows = []
    for ranks in (2, 4, 8):
        if load.shape[1] % ranks == 0:
            before = initial_placement(len(load), load.shape[1], ranks, 0)
            after = rebalance(load, ranks, ranks)
            rows.append({"ranks": ranks, "contiguous": mean_imbalance(before, load),
                         "eplb_one_redundant_per_rank": mean_imbalance(after, load)})
    return rows


def mean_imbalance(placement: torch.Tensor, load: torch.Tensor) -> float:
    return sum(imbalance(p, row) for p, row in zip(placement, load)) / len(load)


def run(args) -> dict:
    result = {"machine": describe_cpu(), "threads": torch.get_num_threads(), "model": args.model, "configs": {}}
    reference = None
    for name in args.configs:
        figures, tokens = bench_config(args.model, CONFIGS[name], args)
        reference = reference or tokens
        if tokens != reference:
            raise RuntimeError(f"{name}: tokens differ from {args.configs[0]}'s")
        result["configs"][name] = figures
    if args.eplb_requests:
        result["eplb"] = bench_eplb(args)
    return result


def format_lines(result: dict) -> list[str]:
    lines = [f"machine: {result['machine']}; {result['model']}",
             f"{'config':<10} {'out tok/s':>10} {'ms/step':>8} {'comm ms/step (all_reduce, all_gather, broadcast)':>50}"]
    for name, r in result["configs"].items():
        comm = r["comm_ms_per_step"]
        parts = ", ".join(f"{comm.get(k, 0.0):.2f}" for k in ("all_reduce", "all_gather", "broadcast"))
        lines.append(f"{name:<10} {r['output_tok_s']:>10.1f} {r['step_ms']:>8.2f} {parts:>50}")
    for h in result.get("eplb", {}).get("rebalances", []):
        lines.append(f"EPLB at step {h['step']}: max/mean rank load {h['current_placement']:.3f} (placement in use, "
                     f"on the last window) -> {h['new_placement']:.3f} (new placement, same window)")
    for row in result.get("eplb", {}).get("what_if", []):
        lines.append(f"whole run's load on {row['ranks']} ranks: max/mean {row['contiguous']:.3f} contiguous, "
                     f"{row['eplb_one_redundant_per_rank']:.3f} with EPLB and {row['ranks']} redundant slots")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedmoe bench parallel", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--eplb-requests", type=int, default=32, help="0: no EPLB run")
    parser.add_argument("--eplb-output-len", type=int, default=128)
    parser.add_argument("--num-redundant-experts", type=int, default=2)
    parser.add_argument("--eplb-step-interval", type=int, default=32)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return print_and_save(run(args), format_lines, args.output_json)
