"""Speculative decoding through the whole engine, float32, with each proposer (n-gram prompt lookup, a draft
model with argmax drafts, a draft model with sampled drafts): greedy tokens identical to HF's greedy (the
output without speculation) under chunked prefill, forced preemption (both modes), prefix-cache hits, n > 1,
stop tokens, max_tokens inside an accepted run and logprobs; every test with drafts actually accepted, and
the pool entirely free afterwards."""
import copy

import pytest
import torch
import transformers

from conftest import VOCAB, assert_all_blocks_free, hf_greedy, make_prompts, save_random_model, tiny_moe_config
from pagedmoe import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}  # every step that can speculate does (test_adaptive.py covers the switch)
NUM_NEW = 32


def save_noisy_copy(model, path, noise: float = 0.01, num_layers: int | None = None, seed: int = 0) -> str:
    """A draft model: the target's weights (its first num_layers layers) plus Gaussian noise, which
    agrees with the target on some tokens and not on others."""
    config = copy.deepcopy(model.config)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
    draft = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    draft.load_state_dict(model.state_dict(), strict=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * noise) if param.dim() > 1 else None
    draft.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module", params=["ngram", "draft_model", "draft_sampled"])
def spec(request, dense_model, tmp_path_factory) -> dict:
    if request.param == "ngram":
        return NGRAM
    draft = save_noisy_copy(dense_model[1], tmp_path_factory.mktemp("draft"))
    method = "probabilistic" if request.param == "draft_sampled" else "greedy"
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False,
            "draft_sample_method": method}


def copy_prompts(num: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so that prompt lookup finds what the output goes on to repeat."""
    return [p + p[:len(p) // 2] + p for p in make_prompts(num, seed=seed, min_len=4, max_len=20)]


@pytest.fixture(scope="module")
def reference(dense_model):
    path, model = dense_model
    prompts = copy_prompts(8, seed=5)
    return path, prompts, [hf_greedy(model, p, NUM_NEW) for p in prompts]


def spec_llm(path: str, spec: dict, **engine_args) -> LLM:
    return LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=spec, **engine_args)


def greedy_tokens(llm: LLM, prompts, max_tokens=NUM_NEW, **params) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_drafts_accepted(llm: LLM):
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)


def assert_no_draft_cached(llm: LLM, outputs: list[list[int]], prompts: list[list[int]]):
    """Every cached block holds committed tokens only: its hash is one of the finished sequences' blocks."""
    from pagedmoe.engine.block_hash import hash_block
    bs, allowed = llm.engine.kv.block_size, set()
    for prompt, out in zip(prompts, outputs):
        tokens, parent = prompt + out, None
        for index in range(len(tokens) // bs):
            parent = hash_block(parent, tokens[index * bs:(index + 1) * bs], None)
            allowed.add(parent)
    assert set(llm.engine.kv.pool.cached) <= allowed


SCENARIOS = {
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "recompute": dict(num_kv_blocks=12, preemption_mode="recompute"),
    "swap": dict(num_kv_blocks=12, preemption_mode="swap"),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "no_decode_kernel": dict(cpu_attention_kernel=False),  # the verify rows through the gather + matmul path
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_identical_to_greedy_without_speculation(reference, spec, scenario):
    path, prompts, expected = reference
    llm = spec_llm(path, spec, **SCENARIOS[scenario])
    got = greedy_tokens(llm, prompts)
    assert got == expected
    assert_drafts_accepted(llm)
    if scenario in ("recompute", "swap"):
        assert getattr(llm.engine.get_stats(), f"num_preemptions_{scenario}") > 0
    if scenario != "no_prefix_caching":
        assert_no_draft_cached(llm, got, prompts)
    assert_all_blocks_free(llm.engine)


def test_one_at_a_time_and_with_prefix_cache_hits(reference, spec):
    path, prompts, expected = reference
    llm = spec_llm(path, spec)
    alone = [greedy_tokens(llm, [p])[0] for p in prompts[:4]]
    again = greedy_tokens(llm, prompts[:4])  # every prompt's full blocks now come from the cache
    assert alone == again == expected[:4]
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert_drafts_accepted(llm)
    assert_all_blocks_free(llm.engine)


def test_max_tokens_and_stop_tokens_inside_an_accepted_run(reference, spec):
    """Each length from 1 to 12 trims the accepted run at max_tokens; a stop token taken from the expected
    output ends it there, whether it was a draft or the draw after them."""
    path, prompts, expected = reference
    llm = spec_llm(path, spec)
    for max_tokens in range(1, 13):
        assert greedy_tokens(llm, prompts, max_tokens=max_tokens) == [e[:max_tokens] for e in expected]
    for prompt, ref in zip(prompts, expected):
        stop = ref[5]
        params = SamplingParams(temperature=0, max_tokens=NUM_NEW, stop_token_ids=[stop])
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"
    assert_drafts_accepted(llm)
    assert_all_blocks_free(llm.engine)


def test_n_samples_and_logprobs_match_without_speculation(reference, spec):
    path, prompts, expected = reference
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, n=2, logprobs=2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(path, dtype="float32", skip_tokenizer_init=True).generate(inputs, params, use_tqdm=False)
    llm = spec_llm(path, spec)
    spec = llm.generate(inputs, params, use_tqdm=False)
    for ref, got, want in zip(plain, spec, expected):
        assert [o.token_ids for o in got.outputs] == [want, want]
        for ref_out, got_out in zip(ref.outputs, got.outputs):
            for ref_pos, got_pos in zip(ref_out.logprobs, got_out.logprobs):
                assert ref_pos.keys() == got_pos.keys()
                assert max(abs(ref_pos[t].logprob - got_pos[t].logprob) for t in ref_pos) < 1e-4
            assert abs(ref_out.cumulative_logprob - got_out.cumulative_logprob) < 1e-3
    assert_drafts_accepted(llm)
    assert_all_blocks_free(llm.engine)


def test_moe_greedy_identical(tmp_path):
    model = save_random_model(tiny_moe_config(), tmp_path, seed=4)
    prompts = copy_prompts(6, seed=9)
    llm = spec_llm(str(tmp_path), NGRAM, max_num_batched_tokens=24)
    assert greedy_tokens(llm, prompts) == [hf_greedy(model, p, NUM_NEW) for p in prompts]
    assert_drafts_accepted(llm)
    assert_all_blocks_free(llm.engine)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(reference, spec):
    path, prompts, _ = reference
    llm = spec_llm(path, spec)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=i) for i in range(16)]
    inputs = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(16)]
    batch = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    alone = [llm.generate(x, p, use_tqdm=False)[0].outputs[0].token_ids for x, p in zip(inputs[:4], params[:4])]
    assert alone == batch[:4]
    assert_all_blocks_free(llm.engine)


def test_disable_by_batch_size_turns_drafting_off(reference, spec):
    """Four copies of one prompt run in step to the end: more than 2 running the whole time, no drafts;
    alone, the same prompt speculates."""
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True,
              speculative_config={**spec, "disable_by_batch_size": 2})
    assert greedy_tokens(llm, prompts[:1] * 4) == expected[:1] * 4
    assert llm.engine.get_stats().spec_decode.num_drafts == 0
    assert greedy_tokens(llm, prompts[:1]) == expected[:1]
    assert_drafts_accepted(llm)
    assert_all_blocks_free(llm.engine)


def test_penalties_and_min_tokens_apply_at_every_draft_position(reference, spec):
    """Penalties count the drafts before each position and min_tokens bans stop tokens at the positions
    still under it: the same tokens as without speculation."""
    path, prompts, expected = reference
    penalties = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, repetition_penalty=1.2,
                               presence_penalty=0.3, frequency_penalty=0.2)
    stops = [SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=8, stop_token_ids=[ref[2]])
             for ref in expected]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain, llm = LLM(path, dtype="float32", skip_tokenizer_init=True), spec_llm(path, spec)
    for params in (penalties, stops):
        want = [o.outputs[0].token_ids for o in plain.generate(inputs, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)] == want
    assert all(len(o) >= 8 for o in want)  # without the ban each would stop at its third token
    assert_drafts_accepted(llm)
    assert_all_blocks_free(llm.engine)
