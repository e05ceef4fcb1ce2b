import pytest
import torch

from conftest import VOCAB, assert_all_blocks_free, make_prompts
from pagedmoe import LLM, SamplingParams
from pagedmoe.layers.sampler import SamplingBatch, apply_penalties, filter_top_k_top_p_min_p


@pytest.fixture(scope="module")
def llm(dense_model):
    return LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_seeded_sampling_same_alone_and_in_batch_of_16(llm):
    prompts = make_prompts(16, seed=11)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate(_ids(prompts[:1]), params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=n, seed=None, ignore_eos=True) for n in range(5, 20)]
    batch = llm.generate(_ids(prompts), [params] + others, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    assert len(set(tuple(o.outputs[0].token_ids) for o in batch)) > 1
    assert_all_blocks_free(llm.engine)


def test_different_seeds_differ_and_top_k_1_is_greedy(llm):
    prompt = _ids(make_prompts(1, seed=2))
    a = llm.generate(prompt, SamplingParams(temperature=1.5, max_tokens=24, seed=1, ignore_eos=True), use_tqdm=False)
    b = llm.generate(prompt, SamplingParams(temperature=1.5, max_tokens=24, seed=2, ignore_eos=True), use_tqdm=False)
    assert a[0].outputs[0].token_ids != b[0].outputs[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompt, SamplingParams(temperature=2.0, top_k=1, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.engine
    prompt = make_prompts(1, seed=4, min_len=40, max_len=40)[0]
    engine.add_request("n4", {"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7))
    engine.step()
    request = engine.requests["n4"]
    assert len(request.seqs) == 4
    tables = [seq.block_table for seq in request.seqs]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert engine.kv.pool.num_used_blocks == 3
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and [o.index for o in final.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in final.outputs)
    assert len(set(tuple(o.token_ids) for o in final.outputs)) > 1
    assert_all_blocks_free(engine)


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    prompt = _ids(make_prompts(1, seed=9))
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    tokens = greedy[0].outputs[0].token_ids
    stop = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[3]]),
                        use_tqdm=False)[0].outputs[0]
    first = tokens.index(tokens[3])
    assert stop.token_ids == tokens[:first + 1] and stop.finish_reason == "stop" and stop.stop_reason == tokens[3]
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                               stop_token_ids=[tokens[first]]), use_tqdm=False)[0].outputs[0]
    assert tokens[first] not in held.token_ids[:first + 2]
    length = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert length.token_ids == tokens[:5] and length.finish_reason == "length"


def test_repetition_penalty_matches_hf(dense_model, llm):
    _, model = dense_model
    prompt = make_prompts(1, seed=6)[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                         pad_token_id=0)[0, len(prompt):].tolist()
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5,
                                                      ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref


def _batch(rows, **kw):
    base = dict(temperature=torch.ones(rows), top_p=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.long),
                min_p=torch.zeros(rows), repetition_penalty=torch.ones(rows), presence_penalty=torch.zeros(rows),
                frequency_penalty=torch.zeros(rows), output_counts=None, prompt_mask=None, banned=None,
                generators=[None] * rows, max_num_logprobs=-1)
    return SamplingBatch(**{**base, **kw})


def _filter(logits, batch):
    return filter_top_k_top_p_min_p(logits, batch.top_k, batch.top_p, batch.min_p)


def test_penalties_and_filters_hand_computed():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    batch = _batch(1, output_counts=counts, prompt_mask=torch.tensor([[False, True, False, False]]),
                   repetition_penalty=torch.tensor([2.0]), presence_penalty=torch.tensor([0.5]),
                   frequency_penalty=torch.tensor([0.25]))
    out = apply_penalties(logits, batch)
    assert torch.allclose(out, torch.tensor([[2.0 / 2 - 0.5 - 0.5, 0.5, -2.0 - 0.25 - 0.5, 0.5]]))
    probs_logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(_filter(probs_logits, _batch(1, **kw)))[0].tolist()
    assert kept(top_k=torch.tensor([2])) == [True, True, False, False]
    assert kept(top_p=torch.tensor([0.7])) == [True, True, False, False]
    assert kept(top_p=torch.tensor([0.1])) == [True, False, False, False]
    assert kept(min_p=torch.tensor([0.5])) == [True, True, False, False]


def test_only_rows_with_a_filter_are_filtered():
    """sampling_probs sorts only the rows with top-k, top-p or min-p: the others are softmax(logits / T)."""
    from pagedmoe.layers.sampler import sampling_probs
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    temperature = torch.tensor([0.5, 1.0, 0.0, 2.0])
    top_k, top_p, min_p = torch.tensor([0, 5, 0, 0]), torch.tensor([1.0, 1.0, 1.0, 0.5]), torch.zeros(4)
    probs = sampling_probs(logits.clone(), temperature, top_k, top_p, min_p)
    scaled = logits / torch.tensor([0.5, 1.0, 1.0, 2.0])[:, None]
    assert torch.equal(probs[[0, 2]], scaled[[0, 2]].softmax(-1))
    expected = filter_top_k_top_p_min_p(scaled[[1, 3]], top_k[[1, 3]], top_p[[1, 3]], min_p[[1, 3]]).softmax(-1)
    assert torch.equal(probs[[1, 3]], expected)
    assert (probs[1] > 0).sum() == 5 and (probs[3] > 0).sum() < 50


def test_inverse_cdf_draws_the_distribution_and_never_a_zero():
    from pagedmoe.layers.sampler import inverse_cdf
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]] * 20000)
    uniform = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(inverse_cdf(probs, uniform), minlength=6) / 20000
    assert counts[[0, 2, 5]].sum() == 0 and (counts - probs[0]).abs().sum() / 2 < 0.02
    edges = torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(probs[:2], edges).tolist() == [1, 4]
