"""The draft model's own KV (spec_decode/draft_model.py): every draft it proposes is its own greedy
continuation of the sequence, as HF computes it from scratch, so its KV in the shared block tables is right
through chunked prefill, preemption (both modes, which move or drop the blocks), prefix-cache hits and forks;
drafts of another shape and an MoE target; bad configs are clear errors."""
import pytest
import torch
import transformers

from conftest import (VOCAB, assert_all_blocks_free, hf_greedy, make_prompts, save_random_model, tiny_dense_config,
                      tiny_moe_config, x86_targets)
from pagedmoe import LLM, SamplingParams
from pagedmoe.spec_decode import draft_model, fused_drafters
from pagedmoe.spec_decode.fused_drafters import FusedDraftModel
from pagedmoe.worker.kv_cache import KVCacheStorage
from test_spec_decode_engine import assert_drafts_accepted, copy_prompts, greedy_tokens, save_noisy_copy

K, NUM_NEW = 3, 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("target")
    target = save_random_model(tiny_dense_config("qwen3"), target_dir, seed=2)
    draft_dir = save_noisy_copy(target, tmp_path_factory.mktemp("draft"))
    draft = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return str(target_dir), target, draft_dir, draft


def draft_llm(target_dir: str, draft_dir: str, **engine_args) -> LLM:
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": K, "adaptive": False}
    return LLM(target_dir, dtype="float32", skip_tokenizer_init=True, speculative_config=spec, **engine_args)


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Every proposal the engine takes from the draft model: (the sequence's tokens, its drafts)."""
    proposer, calls = llm.engine.proposer, []
    propose = proposer.propose

    def recorded(seqs, ks):
        drafts = propose(seqs, ks)
        calls.extend((list(seq.token_ids), ids) for seq, (ids, _) in zip(seqs, drafts))
        return drafts
    proposer.propose = recorded
    return calls


def assert_drafts_are_greedy_continuations(draft, calls):
    assert calls
    for token_ids, drafts in calls[:60]:
        assert drafts == hf_greedy(draft, token_ids, len(drafts))


SCENARIOS = {
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "recompute": dict(num_kv_blocks=12, preemption_mode="recompute"),
    "swap": dict(num_kv_blocks=12, preemption_mode="swap"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_drafts_are_the_draft_models_own_continuation(models, scenario):
    target_dir, target, draft_dir, draft = models
    prompts = copy_prompts(6, seed=3)
    llm = draft_llm(target_dir, draft_dir, **SCENARIOS[scenario])
    calls = record_proposals(llm)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    assert_drafts_are_greedy_continuations(draft, calls)
    if scenario in ("recompute", "swap"):
        assert getattr(llm.engine.get_stats(), f"num_preemptions_{scenario}") > 0
    assert_drafts_accepted(llm)
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("target", [*x86_targets(), "off"])
def test_the_fused_draft_steps_and_their_fallback(models, monkeypatch, target):
    """Greedy drafts of every step in one kernel call (its AVX2 and AVX-512 builds), or with the kernel off
    through the draft's modules: the draft's own HF continuation either way."""
    target_dir, model, draft_dir, draft = models
    monkeypatch.setattr(fused_drafters, "enabled", target != "off")
    llm = draft_llm(target_dir, draft_dir)
    drafter = llm.engine.runner.drafter
    if target != "off":
        drafter.dense_step = FusedDraftModel.of(drafter.model, fused_drafters.load_library(march=target))
    kernel = drafter.dense_step.fn
    kernel_calls = []
    monkeypatch.setattr(drafter.dense_step, "fn", lambda *args: kernel_calls.append(1) or kernel(*args))
    calls, prompts = record_proposals(llm), copy_prompts(4, seed=5)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(model, p, NUM_NEW) for p in prompts]
    assert_drafts_are_greedy_continuations(draft, calls)
    assert bool(kernel_calls) == (target != "off")
    assert_all_blocks_free(llm.engine)


def test_prefix_cache_hits_and_forks(models):
    target_dir, target, draft_dir, draft = models
    prompts = copy_prompts(4, seed=4)
    llm = draft_llm(target_dir, draft_dir)
    greedy_tokens(llm, prompts, NUM_NEW)
    calls = record_proposals(llm)
    params = SamplingParams(temperature=0.8, n=3, seed=1, max_tokens=NUM_NEW, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert_drafts_are_greedy_continuations(draft, calls)
    assert_all_blocks_free(llm.engine)


def test_a_draft_of_another_shape(models, tmp_path):
    """A one-layer draft with other head and hidden sizes: its own KV shape in the same blocks."""
    target_dir, target, _, _ = models
    config = tiny_dense_config("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                               num_hidden_layers=1)
    draft = save_random_model(config, tmp_path, seed=7)
    prompts = make_prompts(4, seed=8)
    llm = draft_llm(target_dir, str(tmp_path))
    calls = record_proposals(llm)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    assert_drafts_are_greedy_continuations(draft, calls)
    assert_all_blocks_free(llm.engine)


def test_moe_target_with_a_draft(tmp_path):
    target = save_random_model(tiny_moe_config(), tmp_path / "target", seed=4)
    draft_dir = save_noisy_copy(target, tmp_path / "draft", num_layers=1)
    prompts = copy_prompts(4, seed=9)
    llm = draft_llm(str(tmp_path / "target"), draft_dir, max_num_batched_tokens=24)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    assert llm.engine.get_stats().spec_decode.num_draft_tokens > 0
    assert_all_blocks_free(llm.engine)


def test_bad_draft_configs_are_value_errors(models, tmp_path):
    target_dir = models[0]
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(target_dir, skip_tokenizer_init=True, speculative_config={"method": "draft_model",
                                                                      "num_speculative_tokens": 2})
    save_random_model(tiny_dense_config("qwen3", vocab_size=VOCAB + 8), tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        draft_llm(target_dir, str(tmp_path))
    with pytest.raises(ValueError, match="draft_sample_method"):
        LLM(target_dir, skip_tokenizer_init=True,
            speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2,
                                "draft_sample_method": "beam"})


def test_stop_strings_inside_accepted_runs(text_model, tmp_path):
    """Text prompts, a stop string taken from the middle of the output without speculation: the same text,
    cut at the same place, whether the string ends inside an accepted run or at its bonus token."""
    path, model, _ = text_model
    draft = save_noisy_copy(model, tmp_path)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K, "adaptive": False}
    plain, llm = LLM(path, dtype="float32"), LLM(path, dtype="float32", speculative_config=spec)
    prompts = ["ROMEO: But soft", "JULIET: O Romeo", "ROMEO: It is the east"]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for prompt, ref in zip(prompts, plain.generate(prompts, params, use_tqdm=False)):
        text = ref.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        stopped = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, stop=[stop])
        want = plain.generate(prompt, stopped, use_tqdm=False)[0].outputs[0]
        got = llm.generate(prompt, stopped, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert llm.engine.get_stats().spec_decode.num_accepted_tokens > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("scenario", ["batch", "recompute"])
def test_a_draft_model_kept_from_drafting_catches_up_over_its_last_positions(models, monkeypatch, scenario):
    """The batch is past disable_by_batch_size until sequences finish: once drafting resumes, a sequence far
    behind catches up over its last positions only and attends from there (the kernel); the output is the
    target's greedy one, drafts are accepted, no block leaks. A sequence never kept from drafting does not
    skip (seeded sampling stays the same alone and in a batch)."""
    target_dir, target, draft_dir = models[:3]
    monkeypatch.setattr(draft_model, "CATCH_UP_ROWS", 8)
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": K, "adaptive": False,
            "disable_by_batch_size": 2}
    llm = LLM(target_dir, dtype="float32", skip_tokenizer_init=True, speculative_config=spec,
              **SCENARIOS[scenario])
    firsts, propose = [], llm.engine.proposer.propose
    monkeypatch.setattr(llm.engine.proposer, "propose", lambda seqs, ks: (
        result := propose(seqs, ks), firsts.extend(s.drafter_start for s in seqs))[0])
    prompts = make_prompts(3, seed=6, min_len=10, max_len=20)
    lengths = (6, 30, 40)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(target, p, n) for p, n in zip(prompts, lengths)]
    assert max(firsts) > 0 and llm.engine.get_stats().spec_decode.num_accepted_tokens > 0
    assert_all_blocks_free(llm.engine)


def test_a_draft_model_never_kept_from_drafting_never_skips(models, monkeypatch):
    target_dir, target, draft_dir = models[:3]
    monkeypatch.setattr(draft_model, "CATCH_UP_ROWS", 1)
    llm = draft_llm(target_dir, draft_dir)
    firsts, propose = [], llm.engine.proposer.propose
    monkeypatch.setattr(llm.engine.proposer, "propose", lambda seqs, ks: (
        result := propose(seqs, ks), firsts.extend(s.drafter_start for s in seqs))[0])
    prompts = make_prompts(3, seed=6, min_len=10, max_len=20)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    assert firsts and not any(firsts)


@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 5, 6, 7])
def test_drop_rows_keeps_the_rows_after_the_first_num_rows_as_one_chunk(num_rows):
    rows = torch.arange(12.0).view(6, 2)
    chunks = [rows[:2], rows[2:3], rows[3:6]]
    kept = draft_model.drop_rows(chunks, num_rows)
    assert len(kept) <= 1
    assert torch.equal(torch.cat(kept) if kept else rows[6:], rows[num_rows:])


def test_the_draft_pool_is_faulted_in_like_the_targets(models, monkeypatch):
    """The drafter's KV holds the target's block ids block for block, so its pages are written at start too."""
    calls = []
    real = KVCacheStorage.prefault
    monkeypatch.setattr(KVCacheStorage, "prefault", lambda self, n=None: calls.append((self, n)) or real(self, n))
    llm = draft_llm(models[0], models[2], kv_prefault_memory=1 << 20)
    pools = {id(llm.engine.runner.kv_cache): "target", id(llm.engine.runner.drafter.kv_cache): "draft"}
    assert sorted((pools[id(pool)], n) for pool, n in calls) == [("draft", 1 << 20), ("target", 1 << 20)]
