"""`pagedmoe bench structured`: what constrained decoding costs. A batch of --num-requests json_schema
requests (temperature 1, seeded) and the same prompts unconstrained, each unconstrained request generating
exactly as many tokens as its constrained twin (ignore_eos, max_tokens = that length), alternating --iters
times in one process; output tokens/s of each (best run), and the schema's compile time cold (xgrammar's
tokenizer tables, then the first compile) and cached."""
import argparse
import time

import torch

from pagedmoe.bench.report import print_and_save
from pagedmoe.cpu_info import describe_cpu
from pagedmoe.entrypoints.cli import DEFAULT_MODEL
from pagedmoe.llm import LLM
from pagedmoe.sampling_params import SamplingParams
from pagedmoe.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["king", "queen", "fool", "ghost"]},
                         "lines": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                         "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                                   "walls": {"type": "number"}},
                                  "required": ["city"]}},
          "required": ["name", "age", "role", "lines", "home"]}
PROMPTS = ["ROMEO:\n", "JULIET:\n", "KING LEAR:\n", "HAMLET:\n", "PORTIA:\n", "OTHELLO:\n", "MACBETH:\n", "PUCK:\n"]


def compile_ms(llm: LLM) -> dict:
    """Milliseconds: the compiler's setup (importing xgrammar, its tokenizer tables), the schema's first
    compile, and a compile of the same schema again (xgrammar's cache)."""
    manager, figures = llm.engine.structured_output, {}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for name, step in (("setup_ms", manager.compiler_for_tokenizer), ("cold_ms", lambda: manager.grammar_for(params)),
                       ("cached_ms", lambda: manager.grammar_for(params))):
        start = time.perf_counter()
        step()
        figures[name] = (time.perf_counter() - start) * 1e3
    return figures


def constrained_params(num: int, max_tokens: int) -> list[SamplingParams]:
    grammar = StructuredOutputsParams(json=SCHEMA)
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=grammar)
            for i in range(num)]


def timed(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [len(o.outputs[0].token_ids) for o in outputs]


def run(args) -> dict:
    llm = LLM(args.model, dtype=args.dtype)
    result = {"machine": describe_cpu(), "threads": torch.get_num_threads(), "model": args.model,
              "num_requests": args.num_requests, "compile": compile_ms(llm), "runs": []}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
    constrained = constrained_params(args.num_requests, args.max_tokens)
    timed(llm, prompts[:2], constrained[:2])  # warm-up
    for _ in range(args.iters):
        json_s, lengths = timed(llm, prompts, constrained)
        plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
        plain_s, plain_lengths = timed(llm, prompts, plain)
        assert plain_lengths == lengths, "the unconstrained twins must generate as many tokens"
        result["runs"].append({"json_schema_s": json_s, "unconstrained_s": plain_s, "num_tokens": sum(lengths)})
    return result | summary(result["runs"])


def summary(runs: list[dict]) -> dict:
    json_tok_s = max(r["num_tokens"] / r["json_schema_s"] for r in runs)
    plain_tok_s = max(r["num_tokens"] / r["unconstrained_s"] for r in runs)
    return {"json_schema_tok_s": json_tok_s, "unconstrained_tok_s": plain_tok_s,
            "slowdown_per_token": plain_tok_s / json_tok_s - 1}


def format_lines(result: dict) -> list[str]:
    return [f"machine: {result['machine']}, {result['threads']} threads; {result['model']}",
            f"grammar setup {result['compile']['setup_ms']:.1f} ms (xgrammar import, tokenizer tables); schema compile "
            f"cold {result['compile']['cold_ms']:.1f} ms, cached {result['compile']['cached_ms']:.2f} ms",
            f"{result['num_requests']} requests, output tok/s (best of {len(result['runs'])}): json_schema "
            f"{result['json_schema_tok_s']:.1f}, unconstrained {result['unconstrained_tok_s']:.1f}, "
            f"{100 * result['slowdown_per_token']:+.1f}% time per token constrained"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedmoe bench structured", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model with a tokenizer")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return print_and_save(run(args), format_lines, args.output_json)
