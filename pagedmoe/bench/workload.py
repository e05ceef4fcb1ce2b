import json
from dataclasses import dataclass

import torch


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def random_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                    seed: int = 0) -> list[BenchRequest]:
    """Uniform random lengths and token ids from a fixed seed: the same workload for every engine."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(input_len[0], input_len[1] + 1, (num_requests,), generator=g).tolist()
    outputs = torch.randint(output_len[0], output_len[1] + 1, (num_requests,), generator=g).tolist()
    return [BenchRequest(torch.randint(10, vocab_size - 10, (n,), generator=g).tolist(), m)
            for n, m in zip(inputs, outputs)]


def sharegpt_workload(path: str, tokenizer, num_requests: int, max_output_len: int = 2048) -> list[BenchRequest]:
    """ShareGPT format: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]."""
    with open(path) as f:
        rows = json.load(f)
    requests = []
    for row in rows:
        turns = row.get("conversations", [])
        if len(turns) >= 2:
            prompt, completion = tokenizer(turns[0]["value"]).input_ids, tokenizer(turns[1]["value"]).input_ids
            requests.append(BenchRequest(prompt, max(1, min(len(completion), max_output_len))))
        if len(requests) == num_requests:
            break
    return requests


def add_workload_args(parser, num_prompts: int = 64, input_len: str = "32-256", output_len: str = "16-256"):
    """The workload options every `pagedmoe bench` subcommand shares."""
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", default=input_len, help="prompt tokens: N or uniform range LOW-HIGH")
    parser.add_argument("--output-len", default=output_len, help="output tokens: N or uniform range LOW-HIGH")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--dataset", default=None, help="ShareGPT-format JSON instead of random prompts")
    parser.add_argument("--prompt-repeats", type=int, default=1, help="random prompts made of a segment "
                        "repeated N times (a copy-heavy workload, for n-gram speculation); 1: plain random")


def build_workload(args, vocab_size: int, tokenizer=None, num_prompts: int | None = None) -> list[BenchRequest]:
    """The workload the shared options describe: ShareGPT rows (needs the tokenizer) or seeded random ids."""
    num_prompts = args.num_prompts if num_prompts is None else num_prompts
    if args.dataset:
        if tokenizer is None:
            raise ValueError("--dataset needs the model's tokenizer")
        return sharegpt_workload(args.dataset, tokenizer, num_prompts)
    workload = random_workload(num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab_size,
                               args.workload_seed)
    return repeat_segments(workload, getattr(args, "prompt_repeats", 1))


def repeat_segments(workload: list[BenchRequest], repeats: int) -> list[BenchRequest]:
    """Each prompt rebuilt, at its length, from its first len / repeats tokens repeated."""
    if repeats < 1:
        raise ValueError(f"--prompt-repeats must be >= 1, got {repeats}")
    if repeats == 1:
        return workload
    out = []
    for r in workload:
        segment = r.prompt_token_ids[:max(len(r.prompt_token_ids) // repeats, 1)]
        out.append(BenchRequest((segment * repeats + segment)[:len(r.prompt_token_ids)], r.output_len))
    return out


def workload_summary(workload: list[BenchRequest]) -> dict:
    inputs, outputs = [len(r.prompt_token_ids) for r in workload], [r.output_len for r in workload]
    return {"num_requests": len(workload), "input_tokens": sum(inputs), "output_tokens": sum(outputs),
            "input_len_min_max": [min(inputs), max(inputs)], "output_len_min_max": [min(outputs), max(outputs)]}
