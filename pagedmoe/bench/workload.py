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
