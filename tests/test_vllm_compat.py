"""A script written for vLLM's offline API runs with `from pagedmoe import ...`: its engine arguments, prompt
types, SamplingParams fields, chat / beam search / embed / metrics calls, with vLLM's meaning."""
import logging

import pytest
import torch
import transformers

from conftest import assert_all_blocks_free
from pagedmoe import (DEFAULT_MODEL, LLM, RequestOutputKind, SamplingParams, TextPrompt, TokensPrompt)
from pagedmoe.config import GIB
from pagedmoe.engine_args import engine_config
from pagedmoe.entrypoints.cli import build_parser, engine_kwargs
from pagedmoe.logprobs import Logprob
from pagedmoe.sampling_params import BeamSearchParams

PROMPT = "ROMEO: But soft, what light through yonder window breaks?"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, dtype="float32", seed=0, gpu_memory_utilization=0.3, enforce_eager=True,
               tensor_parallel_size=1, trust_remote_code=False, max_logprobs=5, tokenizer_mode="auto",
               disable_log_stats=True, swap_space=0.001, max_model_len=256)


@pytest.fixture(autouse=True)
def pool_free_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_all_blocks_free(request.getfixturevalue("llm").llm_engine)


def _greedy(llm, prompt, **changes):
    params = SamplingParams(**{**dict(temperature=0, max_tokens=8, ignore_eos=True), **changes})
    return llm.generate(prompt, params, use_tqdm=False)[0]


def test_engine_args_take_vllm_meaning(llm):
    engine = llm.llm_engine
    assert engine is llm.engine
    assert engine.config.kv_cache_memory_fraction == 0.3
    assert engine.config.max_model_len == 256
    assert engine.runner.num_host_blocks == round(0.001 * GIB) // engine.runner.block_bytes  # swap_space in GiB


def test_ignored_engine_args_log_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="pagedmoe.engine_args"):
        config = engine_config(DEFAULT_MODEL, enforce_eager=True, trust_remote_code=True, disable_log_stats=False)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "trust_remote_code is ignored" in messages[0]
    assert config.enforce_eager  # a field now: it turns CUDA graphs off


def test_gpu_path_flags_reach_the_config():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--gpu-memory-utilization", "0.5",
                                      "--attention-backend", "triton", "--moe-backend", "torch", "--enforce-eager"])
    kwargs = engine_kwargs(args)
    assert kwargs == dict(gpu_memory_utilization=0.5, attention_backend="triton", moe_backend="torch",
                          enforce_eager=True)
    config = engine_config(DEFAULT_MODEL, **kwargs)
    assert config.kv_cache_memory_fraction == 0.5  # on CPU vLLM's flag sizes the KV pool from free memory
    assert (config.attention_backend, config.moe_backend, config.enforce_eager) == ("triton", "torch", True)


@pytest.mark.parametrize("args, field", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(data_parallel_size=0), "data_parallel_size"),
    (dict(tokenizer_mode="mistral"), "tokenizer_mode"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=0, device="cuda"), "gpu_memory_utilization"),
    (dict(attention_backend="flash"), "attention_backend"),
    (dict(moe_backend="cutlass"), "moe_backend"),
    (dict(swap_space=-1), "swap_space"),
    (dict(pipeline_parallel_sise=1), "pipeline_parallel_sise"),
])
def test_bad_engine_args_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        engine_config(DEFAULT_MODEL, **args)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_max_logprobs_enforced(llm, name):
    with pytest.raises(ValueError, match=f"{name} must be <= 5 \\(max_logprobs\\)"):
        llm.generate(PROMPT, SamplingParams(**{name: 6}), use_tqdm=False)
    assert _greedy(llm, PROMPT, **{name: 5}).outputs[0].token_ids


def test_text_and_tokens_prompts(llm):
    ids = llm.get_tokenizer()(PROMPT).input_ids
    plain = _greedy(llm, PROMPT)
    text = _greedy(llm, TextPrompt(prompt=PROMPT))
    tokens = _greedy(llm, TokensPrompt(prompt_token_ids=ids))
    assert text.prompt == PROMPT and text.prompt_token_ids == tokens.prompt_token_ids == ids
    assert plain.outputs[0].token_ids == text.outputs[0].token_ids == tokens.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    ids = llm.get_tokenizer()(PROMPT).input_ids
    out = _greedy(llm, PROMPT, truncate_prompt_tokens=4)
    assert out.prompt_token_ids == ids[-4:]
    assert out.outputs[0].token_ids == _greedy(llm, TokensPrompt(prompt_token_ids=ids[-4:])).outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        _greedy(llm, PROMPT, truncate_prompt_tokens=257)


def test_detokenize_false_gives_token_ids_only(llm):
    text = _greedy(llm, PROMPT, logprobs=1).outputs[0]
    ids_only = _greedy(llm, PROMPT, logprobs=1, detokenize=False).outputs[0]
    assert text.text and ids_only.text == ""
    assert ids_only.token_ids == text.token_ids
    assert all(lp.decoded_token is None for entry in ids_only.logprobs for lp in entry.values())
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["\n"], detokenize=False)


def test_cumulative_logprob_only_with_logprobs(llm):
    assert _greedy(llm, PROMPT).outputs[0].cumulative_logprob is None
    out = _greedy(llm, PROMPT, logprobs=0).outputs[0]
    assert isinstance(out.logprobs[0][out.token_ids[0]], Logprob)
    chosen = sum(entry[t].logprob for entry, t in zip(out.logprobs, out.token_ids))
    assert out.cumulative_logprob == pytest.approx(chosen, abs=1e-5) and out.cumulative_logprob < 0


def test_skip_special_tokens_false_keeps_them_in_text(llm):
    from pagedmoe.engine.sequence import Request, Sequence
    tokenizer = llm.get_tokenizer()
    prompt_ids, word = tokenizer(PROMPT).input_ids, tokenizer(" soft").input_ids
    texts = {}
    for skip in (True, False):
        request = Request("r", PROMPT, prompt_ids, SamplingParams(skip_special_tokens=skip))
        seq = Sequence(0, request, list(prompt_ids))
        for token_id in word + [tokenizer.eos_token_id] + word:
            seq.token_ids.append(token_id)
            llm.llm_engine.detokenizer.append(seq, token_id)
        texts[skip] = seq.output_text
    assert texts[True] == " soft soft"
    assert texts[False] == f" soft{tokenizer.eos_token} soft"


def test_output_kinds_for_streaming(llm):
    engine, outputs = llm.llm_engine, {}
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, output_kind=kind)
        engine.add_request(kind.name, PROMPT, params)
        outputs[kind] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[RequestOutputKind[out.request_id]].append(out)
    cumulative, delta, final = (outputs[k] for k in RequestOutputKind)
    assert len(cumulative) == len(delta) == 6 and len(final) == 1 and final[0].finished
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    whole = cumulative[-1].outputs[0]
    assert sum((o.outputs[0].token_ids for o in delta), []) == whole.token_ids == final[0].outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in delta) == whole.text
    assert sum((o.outputs[0].logprobs for o in delta), []) == whole.logprobs


def test_chat_template_arguments(llm):
    conversation = [{"role": "user", "content": "Speak, friend."}]
    params = SamplingParams(temperature=0, max_tokens=2)
    custom = llm.chat(conversation, params, use_tqdm=False, chat_template="{{ messages[0]['content'] }}|{{ tag }}",
                      chat_template_kwargs={"tag": "enter"})[0]
    assert custom.prompt == "Speak, friend.|enter"
    romeo = llm.chat(conversation, params, use_tqdm=False, chat_template_kwargs={"speaker": "romeo"})[0]
    assert romeo.prompt.endswith("ROMEO:\n")
    opened = conversation + [{"role": "assistant", "content": "Well met"}]
    continued = llm.chat(opened, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert continued[0].prompt.endswith("ASSISTANT:\nWell met")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(opened, params, use_tqdm=False, continue_final_message=True)


def test_beam_search_text_includes_the_prompt(llm):
    prompt_ids = llm.get_tokenizer()(PROMPT).input_ids
    out = llm.beam_search([{"prompt": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=6))[0]
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert seq.tokens[:len(prompt_ids)] == prompt_ids and len(seq.tokens) > len(prompt_ids)
        assert seq.text.startswith(PROMPT) and len(seq.text) > len(PROMPT)


def test_reset_prefix_cache_drops_cached_blocks(llm):
    prompt = PROMPT * 3  # several full blocks
    _greedy(llm, prompt)
    assert _greedy(llm, prompt).num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert not llm.llm_engine.kv.pool.cached
    assert _greedy(llm, prompt).num_cached_tokens == 0


def test_reset_prefix_cache_false_while_blocks_in_use(llm):
    engine = llm.llm_engine
    engine.add_request("busy", PROMPT * 3, GREEDY)
    engine.step()
    assert llm.reset_prefix_cache() is False
    engine.abort_request("busy")


def test_get_metrics_counts_tokens(llm):
    def values():
        return {m.name: m.value for m in llm.get_metrics()}
    before = values()
    out = _greedy(llm, PROMPT)
    after = values()
    assert after["vllm:generation_tokens"] - before["vllm:generation_tokens"] == len(out.outputs[0].token_ids)
    assert after["vllm:prompt_tokens"] - before["vllm:prompt_tokens"] == len(out.prompt_token_ids)
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:prefix_cache_queries"] >= after["vllm:prefix_cache_hits"]
    assert {"vllm:kv_cache_usage_perc", "vllm:num_preemptions"} <= set(after)


def test_embed_matches_hf_last_hidden_state(dense_model):
    path, causal_lm = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    prompts = [[5, 17, 33, 2, 9, 41, 7], list(range(1, 40))]
    embeddings = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
    pooled = llm.encode([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
    base = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, emb, pool in zip(prompts, embeddings, pooled):
        with torch.no_grad():
            expected = torch.nn.functional.normalize(base(torch.tensor([prompt])).last_hidden_state[0, -1], dim=-1)
        assert emb.prompt_token_ids == prompt
        assert torch.allclose(torch.tensor(emb.outputs.embedding), expected, atol=1e-4)
        assert torch.equal(pool.outputs.data, torch.tensor(emb.outputs.embedding))
    truncated = llm.embed(TokensPrompt(prompt_token_ids=prompts[1]), truncate_prompt_tokens=7, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == prompts[1][-7:]
    assert_all_blocks_free(llm.llm_engine)
    assert llm.llm_engine.get_stats().num_prompt_tokens == 0  # the engine's pool never saw those prompts


def test_beam_search_params_import_path():
    import pagedmoe
    assert BeamSearchParams is pagedmoe.BeamSearchParams
    from pagedmoe.outputs import Logprob as OutputsLogprob
    assert Logprob is OutputsLogprob
