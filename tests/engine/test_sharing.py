"""Block sharing: beam search as forks of one sequence, best_of, and n samples holding the prompt once."""
import torch

from conftest import assert_all_blocks_free, make_prompts
from pagedmoe import LLM, BeamSearchParams, SamplingParams


def _hf_beam(model, prompt, width, max_tokens):
    out = model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=max_tokens,
                         num_return_sequences=width, pad_token_id=0, early_stopping=False)
    return [row[len(prompt):].tolist() for row in out]


def test_beam_search_matches_hf(dense_model):
    path, model = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    prompts = make_prompts(3, seed=31, max_len=30)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=4,
                                                                                             max_tokens=12))
    for prompt, out in zip(prompts, outputs):
        expected = _hf_beam(model, prompt, 4, 12)
        assert out.sequences[0].tokens == prompt + expected[0]
        assert [s.tokens[len(prompt):] for s in out.sequences] == expected
    assert_all_blocks_free(llm.engine)


def test_beams_share_prefix_blocks(dense_model):
    llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True)
    engine = llm.engine
    prompt = make_prompts(1, seed=8, min_len=48, max_len=48)[0]
    engine.add_request("beam", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=20))
    peak_used, peak_private = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.requests.get("beam")
        if request and len(request.seqs) == 4:
            tables = [s.block_table for s in request.seqs]
            assert len({t[0] for t in tables}) == 1 and engine.kv.pool.ref_counts[tables[0][0]] == 4
            peak_used = max(peak_used, engine.kv.pool.num_used_blocks)
            peak_private = max(peak_private, sum(len(t) for t in tables))
    assert 0 < peak_used < peak_private
    assert_all_blocks_free(engine)


def test_best_of_returns_highest_logprob_samples(dense_model):
    llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": make_prompts(1, seed=12)[0]}
    params = SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    best = llm.generate(prompt, params, use_tqdm=False)[0].outputs
    every = llm.generate(prompt, SamplingParams(n=5, temperature=1.0, max_tokens=8, seed=3, ignore_eos=True,
                                                logprobs=0), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]
    assert_all_blocks_free(llm.engine)


def test_n4_holds_prompt_blocks_once(dense_model):
    prompt = make_prompts(1, seed=13, min_len=64, max_len=64)[0]
    peaks = []
    for n, copies in ((4, 1), (1, 4)):
        llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
        for i in range(copies):
            llm.engine.add_request(str(i), {"prompt_token_ids": prompt},
                                   SamplingParams(n=n, temperature=1.0, max_tokens=10, seed=i, ignore_eos=True))
        peak = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            peak = max(peak, llm.engine.kv.pool.num_used_blocks)
        peaks.append(peak)
        assert_all_blocks_free(llm.engine)
    assert peaks == [4 + 4, 4 * 5]
