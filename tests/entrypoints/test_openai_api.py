import re
import time

import httpx
import pytest

from conftest import hf_greedy
from pagedmoe import LLM, SamplingParams
from pagedmoe.engine.async_engine import CACHED
from server_utils import HEADERS, MODEL, client, server, wait_all_blocks_free, wait_until  # noqa: F401  (fixtures)

PROMPT = "ROMEO: But soft, what light"
MESSAGES = [{"role": "user", "content": "wherefore art thou"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def offline(text_model) -> LLM:
    return LLM(text_model[0], dtype="float32", num_kv_blocks=64)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_is_the_greedy_continuation(text_model, client, offline):
    _, model, tokenizer = text_model
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY)
    ids = tokenizer(PROMPT).input_ids
    expected = offline.generate(PROMPT, greedy(10), use_tqdm=False)[0].outputs[0]
    assert expected.token_ids == hf_greedy(model, ids, 10)
    choice = out.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == "length" and out.object == "text_completion" and out.model == MODEL
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 10)


def test_chat_applies_the_template(server, text_model, client, offline):
    _, model, tokenizer = text_model
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, **GREEDY)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    expected = offline.chat(MESSAGES, greedy(6), use_tqdm=False)[0].outputs[0]
    assert expected.token_ids == hf_greedy(model, ids, 6)
    message = out.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert out.usage.prompt_tokens == len(ids)
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, headers=HEADERS).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)


def test_streaming_completion_with_usage_matches_whole(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert len(chunks) > 3, "tokens must arrive as they are produced, not in one chunk"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_chat(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True, **GREEDY))
    assert all(c.usage is None and c.choices for c in chunks)


def test_n_choices_and_batched_prompts(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) > 1, "n samples with temperature 1 should differ"
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "JULIET: O Romeo"], max_tokens=4, **GREEDY)
    single = client.completions.create(model=MODEL, prompt="JULIET: O Romeo", max_tokens=4, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == single.choices[0].text


def test_streaming_n_choices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=5, stream=True,
                                                 seed=3, temperature=1.0, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_seed_makes_sampling_reproducible(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11,
                extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3, **GREEDY)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4
        assert abs(value - max(top.values())) < 1e-4, "greedy picks the most likely token"
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                         top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-4
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_stop_strings_whole_and_streamed(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    stop = full[6:9]
    expected = full[:full.index(stop)]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop], **GREEDY).choices[0]
    assert cut.text == expected and cut.finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_best_of_and_cache_salt_are_accepted(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, best_of=4, temperature=1.0,
                                    seed=3, extra_body={"cache_salt": "tenant-a"})
    assert len(out.choices) == 2 and [c.index for c in out.choices] == [0, 1]


def test_cache_salt_reaches_the_prefix_cache(server, client):
    prompt = list(range(10, 60))  # three full KV blocks

    def hits_after(salt: str) -> int:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        sent = time.time()
        wait_until(lambda: server.client.snapshot.time > sent, 5, "no fresh engine snapshot")
        return server.client.snapshot.stats.prefix_cache_hits
    first = hits_after("tenant-a")
    second = hits_after("tenant-a")
    assert second > first
    assert hits_after("tenant-b") == second, "another salt must not hit tenant-a's blocks"
    states = httpx.get(f"{server.url}/dashboard/stats", headers=HEADERS).json()["block_states"]
    assert CACHED in states, "freed blocks that keep their hash show as cached"


def test_tokenize_detokenize_round_trip(server, text_model):
    tokenizer = text_model[2]
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, headers=HEADERS).json()
    assert tokens["tokens"] == tokenizer(PROMPT).input_ids and tokens["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, headers=HEADERS).json()
    assert text["prompt"] == tokenizer.decode(tokens["tokens"])


def test_metrics_after_traffic(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, **GREEDY)
    wait_all_blocks_free(server)
    text = httpx.get(f"{server.url}/metrics", headers=HEADERS).text
    samples = _samples(text)
    assert samples[f'pagedmoe:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'] >= 1
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert samples[f'pagedmoe:{name}_count{{model_name="{MODEL}"}}'] >= 1
    assert samples[f'pagedmoe:generation_tokens_total{{model_name="{MODEL}"}}'] >= 5
    assert samples[f'pagedmoe:prompt_tokens_total{{model_name="{MODEL}"}}'] >= 5
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert f'pagedmoe:{name}{{model_name="{MODEL}"}}' in samples
    assert re.search(r"# TYPE pagedmoe:generation_tokens(_total)? counter", text)
    assert "pagedmoe:expert_tokens" not in text, "a dense model has no experts"


def _samples(text: str) -> dict[str, float]:
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in lines}
