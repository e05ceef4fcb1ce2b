"""Sampling with speculation keeps the target's distribution: on a model with an 8-token vocabulary, the
empirical distribution of each output position over many seeded requests (temperature 1, top-p 0.95)
against the exact one, enumerated from HF's own model over every prefix, with n-gram drafts and with drafts
sampled from a draft model (verified by min(1, p/q)), whose own distribution the output is far from. The
prompt is the model's own greedy continuation, which it tends to repeat: most draws then run through
accepted drafts."""
import itertools

import torch

from conftest import hf_greedy, save_random_model, tiny_dense_config
from pagedmoe import LLM, SamplingParams

VOCAB, NUM_NEW, NUM_DRAWS = 8, 4, 3000
TV_BOUND = 0.05  # about 4 standard deviations of an 8-outcome empirical TV at 3000 draws


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    drop = (sorted_probs.cumsum(0) - sorted_probs) >= top_p
    drop[0] = False
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0))
    return kept / kept.sum()


def exact_marginals(model, prompt: list[int], top_p: float) -> torch.Tensor:
    """[NUM_NEW, VOCAB]: the probability of each token at each output position, over all continuations."""
    marginals = torch.zeros(NUM_NEW, VOCAB, dtype=torch.float64)
    for prefix in itertools.chain.from_iterable(itertools.product(range(VOCAB), repeat=n) for n in range(NUM_NEW)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
        marginals[len(prefix)] += prefix_probability(model, prompt, prefix, top_p) * nucleus(logits.softmax(0), top_p)
    return marginals


def prefix_probability(model, prompt: list[int], prefix: tuple, top_p: float) -> float:
    probability = 1.0
    for i, token in enumerate(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix[:i])])).logits[0, -1].double()
        probability *= float(nucleus(logits.softmax(0), top_p)[token])
    return probability


def sharp_model(path, seed: int):
    model = save_random_model(tiny_dense_config("qwen3", vocab_size=VOCAB), path, seed=seed)
    with torch.no_grad():  # sharper than the random init: a few likely continuations per prefix
        model.lm_head.weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


def sample_marginals(llm: LLM, prompt: list[int]) -> torch.Tensor:
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=NUM_NEW, ignore_eos=True, seed=i)
              for i in range(NUM_DRAWS)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_DRAWS, params, use_tqdm=False)
    counts = torch.zeros(NUM_NEW, VOCAB, dtype=torch.float64)
    for out in outputs:
        for pos, token in enumerate(out.outputs[0].token_ids):
            counts[pos, token] += 1
    return counts / NUM_DRAWS


def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 0.5 * (a - b).abs().sum(dim=1)


def test_each_position_has_the_target_distribution(tmp_path):
    model = sharp_model(tmp_path, seed=3)
    prompt = [1, 2] + hf_greedy(model, [1, 2], 12)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_num_seqs=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "adaptive": False})
    empirical = sample_marginals(llm, prompt)
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens > NUM_DRAWS // 2  # many positions came from accepted drafts
    tv = total_variation(empirical, exact_marginals(model, prompt, 0.95))
    assert (tv < TV_BOUND).all(), tv


def test_sampled_drafts_keep_the_target_distribution(tmp_path):
    model, draft = sharp_model(tmp_path / "target", seed=3), sharp_model(tmp_path / "draft", seed=11)
    prompt = [1, 2] + hf_greedy(model, [1, 2], 12)
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 2,
            "draft_sample_method": "probabilistic", "adaptive": False}
    llm = LLM(str(tmp_path / "target"), dtype="float32", skip_tokenizer_init=True, max_num_seqs=256,
              speculative_config=spec)
    empirical = sample_marginals(llm, prompt)
    stats = llm.engine.get_stats().spec_decode
    assert NUM_DRAWS // 2 < stats.num_accepted_tokens < stats.num_draft_tokens  # kept and rejected, both often
    tv = total_variation(empirical, exact_marginals(model, prompt, 0.95))
    assert (tv < TV_BOUND).all(), tv
    tv_draft = total_variation(empirical, exact_marginals(draft, prompt, 0.95))
    assert tv_draft[1:].min() > 4 * TV_BOUND, tv_draft  # the first position is the target's alone
