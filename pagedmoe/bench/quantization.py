"""`pagedmoe bench quantization --model DIR`: one checkpoint in float32, bfloat16 and its 4-bit forms (written
by `pagedmoe quantize` into a temporary directory: MXFP4 experts, as gpt-oss ships them, and NVFP4 linears and
experts), side by side in one process: resident weight bytes (every tensor the loaded model holds, packed
copies included, each storage counted once), decode tokens/s at each batch size (the decode steps of a batch of
--input-len prompts generating --output-len tokens, best of --iters) and prefill tokens/s (--prefill-prompts
prompts of --prefill-len tokens, one output token). 4-bit forms run the rest of the model in --packed-dtype."""
import argparse
import gc
import json
import random
import tempfile
from pathlib import Path

import torch

from pagedmoe.bench.latency import batch_figures, run_batch
from pagedmoe.bench.workload import BenchRequest
from pagedmoe.cpu_info import describe_cpu
from pagedmoe.layers.quantization.quantize import quantize_checkpoint
from pagedmoe.llm import LLM

FORMS = ("float32", "bfloat16", "mxfp4", "nvfp4")


def storages(value, seen: dict[int, int], depth: int = 0):
    """Adds every tensor's storage reachable from value (containers and plain objects, a few levels deep)."""
    if isinstance(value, torch.Tensor) and value.is_mkldnn:  # oneDNN's packed copies: no storage to share
        seen[id(value)] = value.numel() * value.element_size()
    elif isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            storages(item, seen, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            storages(item, seen, depth + 1)
    elif depth < 4 and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        storages(vars(value), seen, depth + 1)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for module in model.modules():
        storages({k: v for k, v in vars(module).items() if not isinstance(v, torch.nn.Module)}, seen)
    return sum(seen.values())


def requests(vocab_size: int, count: int, prompt_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(1, vocab_size) for _ in range(prompt_len)], output_len) for _ in range(count)]


def decode_tok_s(llm: LLM, batch_size: int, args) -> float:
    best = 0.0
    for i in range(args.iters):
        batch = requests(llm.engine.config.hf_config.vocab_size, batch_size, args.input_len, args.output_len, i)
        figures = batch_figures(*run_batch(llm, batch, None))
        best = max(best, batch_size * figures["num_decode_steps"] / figures["decode_s"])
    return best


def prefill_tok_s(llm: LLM, args) -> float:
    best = 0.0
    for i in range(args.iters):
        batch = requests(llm.engine.config.hf_config.vocab_size, args.prefill_prompts, args.prefill_len, 1, 100 + i)
        figures = batch_figures(*run_batch(llm, batch, None))
        best = max(best, args.prefill_prompts * args.prefill_len / figures["prefill_s"])
    return best


def load_form(form: str, args, tmp: str) -> LLM:
    if form in ("float32", "bfloat16"):
        return LLM(args.model, dtype=form, skip_tokenizer_init=True)
    path = str(Path(tmp, form))
    quantize_checkpoint(args.model, path, form)
    return LLM(path, dtype=args.packed_dtype, quantization_mode="packed", skip_tokenizer_init=True)


def bench_form(form: str, args, tmp: str) -> dict:
    llm = load_form(form, args, tmp)
    run_batch(llm, requests(llm.engine.config.hf_config.vocab_size, 2, args.input_len, 4, 99), None)  # warm-up
    result = {"form": form, "weight_bytes": resident_weight_bytes(llm.engine.runner.model),
              "decode_tok_s": {b: decode_tok_s(llm, b, args) for b in args.batch_sizes},
              "prefill_tok_s": prefill_tok_s(llm, args)}
    del llm
    gc.collect()
    return result


def format_lines(result: dict) -> list[str]:
    sizes = result["batch_sizes"]
    lines = [f"machine: {result['machine']}, {result['threads']} threads; {result['model']}",
             f"{'form':<10} {'weight MiB':>10} " + " ".join(f"{'decode b' + str(b):>11}" for b in sizes)
             + f" {'prefill':>9}  (tok/s)"]
    for row in result["forms"]:
        lines.append(f"{row['form']:<10} {row['weight_bytes'] / 2**20:>10.1f} "
                     + " ".join(f"{row['decode_tok_s'][b]:>11.1f}" for b in sizes) + f" {row['prefill_tok_s']:>9.1f}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedmoe bench quantization", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--packed-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {"machine": describe_cpu(), "threads": torch.get_num_threads(), "model": args.model,
              "batch_sizes": args.batch_sizes, "packed_dtype": args.packed_dtype, "forms": []}
    with tempfile.TemporaryDirectory() as tmp:
        result["forms"] = [bench_form(form, args, tmp) for form in args.forms]
    print("\n".join(format_lines(result)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
