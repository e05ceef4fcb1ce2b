"""--speculative-config on the CLI, and speculation behind the OpenAI server: the same text as without it,
stop strings included, and vLLM's spec-decode counters on /metrics."""
import json

import httpx

from pagedmoe.entrypoints.cli import build_parser, engine_kwargs
from server_utils import HEADERS, MODEL, serve, wait_all_blocks_free

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
PROMPT = "ROMEO: But soft, what light through yonder window breaks? ROMEO: But soft, what light"


def test_the_cli_flag_takes_vllm_json():
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])
    assert json.loads(engine_kwargs(args)["speculative_config"]) == SPEC


def completion(server, **extra) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=HEADERS, timeout=60).json()


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=HEADERS).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"pagedmoe:{name}"))


def test_server_text_and_metrics(text_model):
    with serve(text_model[0], num_kv_blocks=256) as plain:
        expected = completion(plain)["choices"][0]["text"]
        stop = expected[len(expected) // 2:len(expected) // 2 + 3]
        expected_stopped = completion(plain, stop=[stop])["choices"][0]["text"]
    with serve(text_model[0], num_kv_blocks=256, speculative_config=json.dumps(SPEC)) as server:
        assert completion(server)["choices"][0]["text"] == expected
        assert completion(server, stop=[stop])["choices"][0]["text"] == expected_stopped
        wait_all_blocks_free(server)
        assert metric(server, "spec_decode_num_drafts_total") > 0
        assert metric(server, "spec_decode_num_draft_tokens_total") >= metric(server, "spec_decode_num_accepted_tokens")
        assert metric(server, "spec_decode_num_accepted_tokens_per_pos") == \
            metric(server, "spec_decode_num_accepted_tokens_total")
