import pytest

from conftest import VOCAB, assert_all_blocks_free, make_prompts
from pagedmoe import LLM, SamplingParams

SYSTEM = [(i * 7) % (VOCAB - 2) + 1 for i in range(64)]


def _prompts(num: int):
    return [{"prompt_token_ids": SYSTEM + suffix} for suffix in make_prompts(num, seed=21, max_len=20)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=5,
                                                   ignore_eos=True)])
def test_outputs_identical_with_caching_on_and_off(dense_model, params):
    results = []
    for enable in (True, False):
        llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=enable,
                  max_num_batched_tokens=96)
        first = llm.generate(_prompts(4), params, use_tqdm=False)
        second = llm.generate(_prompts(4), params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in first + second])
        assert_all_blocks_free(llm.engine)
        if enable:
            assert [o.num_cached_tokens for o in second] == [
                (len(o.prompt_token_ids) - 1) // 16 * 16 for o in second]
    assert results[0] == results[1]


def test_shared_system_prompt_computed_once(dense_model):
    llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True)
    prompts = _prompts(32)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.get_stats()
    total = sum(len(p["prompt_token_ids"]) for p in prompts)
    assert stats.prefix_cache_queries == total
    assert stats.prefix_cache_hits == 31 * len(SYSTEM)
    assert stats.num_prompt_tokens == total - 31 * len(SYSTEM)
    assert_all_blocks_free(llm.engine)


def test_cache_salt_isolates_tenants(dense_model):
    llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=2)
    prompt = SYSTEM + [3, 4, 5]
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, params, use_tqdm=False)
    bob = llm.generate({"prompt_token_ids": prompt, "cache_salt": "bob"}, params, use_tqdm=False)[0]
    alice = llm.generate({"prompt_token_ids": prompt, "cache_salt": "alice"}, params, use_tqdm=False)[0]
    assert bob.num_cached_tokens == 0 and alice.num_cached_tokens == 64
    assert bob.outputs[0].token_ids == alice.outputs[0].token_ids


def test_lru_eviction_drops_oldest_prefix(dense_model):
    llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True, num_kv_blocks=12)
    params = SamplingParams(temperature=0, max_tokens=1)
    old = {"prompt_token_ids": SYSTEM + [9]}
    llm.generate(old, params, use_tqdm=False)
    for seed in range(3):
        other = [(seed * 31 + i * 11) % (VOCAB - 2) + 1 for i in range(80)]
        llm.generate({"prompt_token_ids": other}, params, use_tqdm=False)
    assert llm.generate(old, params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.engine.kv.pool.num_evictions > 0
    assert_all_blocks_free(llm.engine)
