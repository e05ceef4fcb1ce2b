"""/v1/completions parity with OpenAI and vLLM: echo, prompt_logprobs, logit_bias, use_beam_search and
the sampling extras, checked against the offline engine on the same model."""
import httpx
import pytest

from pagedmoe import LLM, BeamSearchParams, SamplingParams
from server_utils import HEADERS, MODEL, client, server  # noqa: F401  (fixtures)

PROMPT = "ROMEO: But soft, what light"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def offline(text_model) -> LLM:
    return LLM(text_model[0], dtype="float32", num_kv_blocks=64)


def test_echo_prepends_the_prompt_and_its_logprobs(client, text_model):
    tokenizer = text_model[2]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=2, echo=True, **GREEDY)
    choice, num_prompt = echoed.choices[0], len(tokenizer(PROMPT).input_ids)
    assert choice.text == PROMPT + plain.choices[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == num_prompt + 5 and "".join(logprobs.tokens[:num_prompt]) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    # echo computes every prompt row past the last layer, the plain request its last only: GEMMs of other row
    # counts (torch's, for this tiny model's small weights) may round the last bit apart (Zen 4 AVX-512: 2e-7)
    assert logprobs.token_logprobs[num_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    prompt_offsets = [sum(map(len, logprobs.tokens[:i])) for i in range(num_prompt)]
    output_offsets = [len(PROMPT) + offset for offset in plain.choices[0].logprobs.text_offset]
    assert logprobs.text_offset == prompt_offsets + output_offsets


def test_echo_streamed_and_for_token_prompts(client, text_model):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, echo=True, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, echo=True, stream=True, **GREEDY))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    ids = text_model[2](PROMPT).input_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, echo=True, **GREEDY)
    assert by_ids.choices[0].text == whole.choices[0].text


def test_prompt_logprobs_match_the_engine(server, text_model, offline):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, headers=HEADERS).json()["choices"][0]
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = text_model[2](PROMPT).input_ids
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    for token_id, entry, reference in zip(ids[1:], choice["prompt_logprobs"][1:], expected.prompt_logprobs[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert entry[str(token_id)]["logprob"] == pytest.approx(reference[token_id].logprob, abs=1e-4)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1, "prompt_logprobs": 0}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=HEADERS).json()
    assert answer["prompt_logprobs"][0] is None and answer["usage"]["prompt_tokens"] == len(answer["prompt_logprobs"])


def test_logit_bias_forces_a_token(client, text_model):
    token_id = text_model[2](" light").input_ids[-1]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={str(token_id): 100},
                                    **GREEDY)
    assert out.choices[0].text == text_model[2].decode([token_id]) * 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logit_bias={str(token_id): 100}, **GREEDY)
    assert chat.choices[0].message.content == text_model[2].decode([token_id]) * 3


def test_allowed_token_ids_and_bad_words(client, text_model):
    tokenizer = text_model[2]
    allowed = tokenizer(" soft light").input_ids[-2:]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=0, temperature=1.0,
                                    extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "seed": 3})
    assert set(out.choices[0].logprobs.tokens) <= {tokenizer.decode([t]) for t in allowed}
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=0, **GREEDY)
    first = greedy.choices[0].logprobs.tokens[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"bad_words": [first.strip() or first], "ignore_eos": True})
    assert banned.choices[0].text != first


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, text_model):
    ids = text_model[2](PROMPT).input_ids
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                    extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True}, temperature=0)
    tail = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=3, **GREEDY)
    assert out.usage.prompt_tokens == 3 and out.choices[0].text == tail.choices[0].text


def test_use_beam_search_matches_the_offline_beam_search(client, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=0,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    expected = offline.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    # offline beam text is prompt + output (as vLLM's LLM.beam_search); a completion's text is the output
    assert all(s.text.startswith(PROMPT) for s in expected.sequences)
    assert [c.text for c in out.choices] == [s.text[len(PROMPT):] for s in expected.sequences]


@pytest.mark.parametrize("body, param", [
    ({"suffix": "and so"}, "suffix"),
    ({"use_beam_search": True, "stream": True}, "use_beam_search"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_unsupported_or_bad_extras_are_400(server, body, param):
    response = httpx.post(f"{server.url}/v1/completions", headers=HEADERS,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
