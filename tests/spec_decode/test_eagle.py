"""The EAGLE-3 head (spec_decode/eagle.py) against its training module (train/eagle_head.py): every draft the
engine proposes is the training head's prediction on the same tokens at the same unrolled step, through
chunked prefill, preemption (both modes) and prefix-cache hits, so the head's paged KV, the aux hidden states
and the training-time-test attention agree; greedy output stays HF's. Training runs end to end and its
export loads; the bundled head drafts for the bundled model."""
from pathlib import Path

import pytest
import torch

from conftest import (CORPUS, assert_all_blocks_free, hf_greedy, make_prompts, save_random_model, tiny_dense_config,
                      x86_targets)
from pagedmoe import LLM, SamplingParams
from pagedmoe.layers.attention.metadata import Workspace
from pagedmoe.spec_decode import eagle, fused_drafters
from pagedmoe.spec_decode.fused_drafters import FusedEagleStep
from pagedmoe.train.eagle_train import EagleConfig, build_head, export, load_target, target_features, train_eagle3
from test_draft_model import record_proposals
from test_mtp import SCENARIOS
from test_spec_decode_engine import greedy_tokens
from pagedmoe.worker.inputs import prepare_inputs

K, NUM_NEW = 3, 20
BUNDLED = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """A four-layer target and a random EAGLE-3 head for it, exported as training exports it."""
    target_dir = tmp_path_factory.mktemp("target")
    save_random_model(tiny_dense_config("qwen3", num_hidden_layers=4, layer_types=["full_attention"] * 4),
                      target_dir, seed=5)
    cfg = EagleConfig(target=str(target_dir), out_dir=str(tmp_path_factory.mktemp("head")), intermediate_size=96)
    target = load_target(cfg.target)
    head, aux = build_head(cfg, target)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0, 0.2) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    export(cfg, head, aux, target, {})
    return str(target_dir), cfg.out_dir, target, head, aux


def eagle_llm(target_dir: str, head: str, **engine_args) -> LLM:
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": K, "adaptive": False}
    return LLM(target_dir, dtype="float32", skip_tokenizer_init=True, speculative_config=spec, **engine_args)


@torch.no_grad()
def training_head_drafts(target, head, aux, token_ids: list[int], drafts: list[int]) -> list[int]:
    """The training head's argmax at each unrolled step, the engine's drafts fed as the tokens."""
    tokens = torch.tensor([token_ids + drafts])
    fused, _ = target_features(target, tokens, aux)
    outputs = head.unroll(target.get_input_embeddings()(tokens[:, 1:]), fused[:, :-1], len(drafts))
    rows = [outputs[step][0, len(token_ids) - 2 + step] for step in range(len(drafts))]
    return [int(target.get_output_embeddings()(head.norm(row)).argmax()) for row in rows]


@pytest.fixture
def whole_catch_up(monkeypatch):
    """The head catches up over every position (as the training head attends), however far behind."""
    monkeypatch.setattr(eagle, "CATCH_UP_ROWS", 1 << 30)


@pytest.mark.parametrize("scenario", [*SCENARIOS, "prefix_hits"])
def test_drafts_are_the_training_heads(head_dir, scenario, whole_catch_up):
    target_dir, head_path, target, head, aux = head_dir
    prompts = make_prompts(5, seed=4, min_len=34, max_len=60)
    llm = eagle_llm(target_dir, head_path, **SCENARIOS.get(scenario, {}))
    if scenario == "prefix_hits":
        greedy_tokens(llm, prompts, NUM_NEW)
    calls = record_proposals(llm)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    assert calls and all(training_head_drafts(target, head, aux, t, d) == d for t, d in calls[::4])
    if scenario == "prefix_hits":
        assert llm.engine.get_stats().prefix_cache_hits > 0
    if scenario in ("recompute", "swap"):
        assert getattr(llm.engine.get_stats(), f"num_preemptions_{scenario}") > 0
    assert_all_blocks_free(llm.engine)


def test_drafts_through_the_heads_modules_where_the_fused_step_is_off(head_dir, monkeypatch, whole_catch_up):
    """The fallback: the same drafts (the training head's) through the head's PyTorch modules."""
    target_dir, head_path, target, head, aux = head_dir
    monkeypatch.setattr(fused_drafters, "enabled", False)
    llm = eagle_llm(target_dir, head_path)
    kernel_calls = []
    monkeypatch.setattr(llm.engine.runner.drafter.fused, "fn", lambda *args: kernel_calls.append(args))
    calls, prompts = record_proposals(llm), make_prompts(3, seed=7, min_len=34, max_len=60)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    assert calls and not kernel_calls
    assert all(training_head_drafts(target, head, aux, t, d) == d for t, d in calls[::3])
    assert_all_blocks_free(llm.engine)


def fused_step_problem(drafter, seed: int):
    """Rows of three sequences (several rows each where the first draft step catches up), distinct blocks,
    random earlier KV and random fused target states."""
    torch.manual_seed(seed)
    drafter.kv_cache.device_cache.normal_()
    token_lists, starts = [[3, 9, 4], [7], [1, 2, 11, 5]], [37, 5, 14]
    tables = torch.tensor([[4, 9, 2], [0, 1, 3], [8, 6, 5]])
    hidden = torch.randn(8, len(drafter.aux_layers) * drafter.model.hidden_size)
    return token_lists, starts, tables, hidden


@pytest.mark.parametrize("target", x86_targets())
def test_the_fused_step_is_the_heads_modules(head_dir, target):
    """Hidden states, logits and the K/V written, as the head's modules compute them (causal over a
    sequence's rows: each row's KV is in before the next row attends)."""
    llm = eagle_llm(*head_dir[:2])
    drafter = llm.engine.runner.drafter
    fused = FusedEagleStep.of(drafter.model, fused_drafters.load_library(march=target))
    token_lists, starts, tables, hidden = fused_step_problem(drafter, seed=1)
    cache = drafter.kv_cache.device_cache
    want_cache = cache.clone()
    ids, positions, meta = prepare_inputs(token_lists, starts, tables.tolist(), 16, want_cache,
                                          Workspace(torch.float32, torch.device("cpu")))
    with torch.inference_mode():
        rows = drafter.model(ids, hidden, positions, meta)[torch.tensor([2, 3, 7])]
        want_logits = drafter.model.compute_logits(rows)
        got_hidden, got_logits, _ = fused(cache[0], token_lists, starts, hidden, tables)
    torch.testing.assert_close(got_hidden, rows, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, want_cache, atol=1e-5, rtol=1e-5)


def test_fused_drafting_feeds_each_argmax_back(head_dir):
    """Several greedy steps in one call are the same steps one call each, the argmax and the head's own
    hidden state fed back at the next position."""
    drafter = eagle_llm(*head_dir[:2]).engine.runner.drafter
    token_lists, starts, tables, hidden = fused_step_problem(drafter, seed=3)
    cache, ks = drafter.kv_cache.device_cache, [3, 2, 1]
    saved = cache.clone()
    _, _, chained = drafter.fused(cache[0], token_lists, starts, hidden, tables, ks)
    first_row = [0, 3, 4]
    for i, k in enumerate(ks):
        cache.copy_(saved)
        rows = hidden[first_row[i]:first_row[i] + len(token_lists[i])]
        out, _, drafts = drafter.fused(cache[0], [token_lists[i]], [starts[i]], rows, tables[i:i + 1])
        for position in range(starts[i] + len(token_lists[i]), starts[i] + len(token_lists[i]) + k - 1):
            out, _, step = drafter.fused(cache[0], [[drafts[0][-1]]], [position], out, tables[i:i + 1])
            drafts[0] += step[0]
        assert drafts[0] == chained[i] and len(chained[i]) == k


def test_sampled_drafts_take_the_fused_step_one_step_a_call(head_dir, monkeypatch):
    target_dir, head_path = head_dir[:2]
    spec = {"method": "eagle3", "model": head_path, "num_speculative_tokens": K, "adaptive": False,
            "draft_sample_method": "probabilistic"}
    llm = LLM(target_dir, dtype="float32", skip_tokenizer_init=True, speculative_config=spec)
    fused, calls = llm.engine.runner.drafter.fused, []
    kernel = fused.fn
    monkeypatch.setattr(fused, "fn", lambda *args: calls.append(args[12].value) or kernel(*args))  # max_drafts
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=NUM_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in make_prompts(2, seed=8)], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [NUM_NEW] * 2
    assert calls and set(calls) == {1} and llm.engine.get_stats().spec_decode.num_draft_tokens > 0
    assert_all_blocks_free(llm.engine)


def test_positions_before_a_sequences_first_are_not_attended(head_dir):
    """Each sequence attending from its first row on: whatever the head's KV holds before it, the result is
    the head's modules' over the same rows at positions from 0 (RoPE attention sees only relative
    positions); attending from 0 instead reads those positions (the check is not vacuous)."""
    drafter = eagle_llm(*head_dir[:2]).engine.runner.drafter
    token_lists, starts, tables, hidden = fused_step_problem(drafter, seed=4)
    cache = drafter.kv_cache.device_cache
    for table, start in zip(tables, starts):  # positions 0 .. start - 1 of each sequence: anything
        for position in range(start):
            cache[0, :, table[position // 16], position % 16].normal_(0, 3)
    shifted = torch.zeros_like(cache)
    ids, positions, meta = prepare_inputs(token_lists, [0, 0, 0], tables.tolist(), 16, shifted,
                                          Workspace(torch.float32, torch.device("cpu")))
    with torch.inference_mode():
        rows = drafter.model(ids, hidden, positions, meta)[torch.tensor([2, 3, 7])]
        got_hidden, got_logits, _ = drafter.fused(cache[0], token_lists, starts, hidden, tables, firsts=starts)
        from_0, _, _ = drafter.fused(cache[0], token_lists, starts, hidden, tables)
    torch.testing.assert_close(got_hidden, rows, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_logits, drafter.model.compute_logits(rows), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(from_0[0], rows, atol=1e-2)


def test_a_head_far_behind_catches_up_over_its_last_positions(head_dir, monkeypatch):
    """Prompts longer than the catch-up allowance: the head attends from their last positions on, the
    output is still exactly the target's greedy one, the drafts still get accepted, no block leaks."""
    target_dir, head_path, target = head_dir[:3]
    monkeypatch.setattr(eagle, "CATCH_UP_ROWS", 8)
    llm = eagle_llm(target_dir, head_path)
    firsts = []
    propose = llm.engine.proposer.propose
    monkeypatch.setattr(llm.engine.proposer, "propose", lambda seqs, ks: (
        result := propose(seqs, ks), firsts.extend(s.drafter_start for s in seqs))[0])
    prompts = make_prompts(3, seed=9, min_len=40, max_len=60)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(target, p, NUM_NEW) for p in prompts]
    assert max(firsts) >= 40 - 16 and llm.engine.get_stats().spec_decode.num_accepted_tokens > 0
    assert_all_blocks_free(llm.engine)


def test_a_sequence_that_does_not_draft_keeps_a_bounded_stash(head_dir, monkeypatch):
    """Speculation off for many steps (the batch is past disable_by_batch_size until sequences finish): each
    sequence's stashed hidden states stay within MAX_STASHED_STEPS chunks, and once the batch shrinks the
    head drafts from its last positions; the output is the target's greedy one and no block leaks."""
    target_dir, head_path, target = head_dir[:3]
    monkeypatch.setattr(eagle, "MAX_STASHED_STEPS", 6)
    spec = {"method": "eagle3", "model": head_path, "num_speculative_tokens": K, "adaptive": False,
            "disable_by_batch_size": 2}
    llm = LLM(target_dir, dtype="float32", skip_tokenizer_init=True, speculative_config=spec)
    longest, stash = [], llm.engine.proposer.stash_hidden
    monkeypatch.setattr(llm.engine.proposer, "stash_hidden", lambda seqs, num_new, hidden: (
        stash(seqs, num_new, hidden), longest.append(max(len(s.spec_hidden) for s in seqs)))[0])
    prompts = make_prompts(3, seed=4, min_len=8, max_len=20)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 30, 40)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(target, p, n) for p, n in zip(prompts, (12, 30, 40))]
    assert max(longest) <= 6 + 1 and llm.engine.get_stats().spec_decode.num_drafts > 0
    assert_all_blocks_free(llm.engine)


def test_the_fused_step_refuses_rows_past_the_block_tables(head_dir):
    drafter = eagle_llm(*head_dir[:2]).engine.runner.drafter
    token_lists, starts, tables, hidden = fused_step_problem(drafter, seed=2)
    with pytest.raises(ValueError, match="out of range"):
        drafter.fused(drafter.kv_cache.device_cache[0], token_lists, [37, 5, 60], hidden, tables)


def test_training_runs_and_its_export_drafts(text_model, tmp_path):
    path, model, tokenizer = text_model
    cfg = EagleConfig(target=path, out_dir=str(tmp_path / "head"), corpus=str(CORPUS), seq_len=32, batch_size=2,
                      max_steps=3, warmup_steps=1, intermediate_size=64, num_steps=2)
    out = train_eagle3(cfg)
    assert (out / "training.json").is_file() and len((out / "training.json").read_text()) > 0
    llm = eagle_llm(path, str(out))
    prompts = make_prompts(3, seed=6)
    assert greedy_tokens(llm, prompts, NUM_NEW) == [hf_greedy(model, p, NUM_NEW) for p in prompts]
    assert llm.engine.get_stats().spec_decode.num_draft_tokens > 0
    assert_all_blocks_free(llm.engine)


def test_bad_head_configs_are_value_errors(head_dir, tmp_path):
    target_dir = head_dir[0]
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(target_dir, skip_tokenizer_init=True, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    save_random_model(tiny_dense_config("qwen3"), tmp_path)
    with pytest.raises(ValueError, match="EAGLE-3"):
        eagle_llm(target_dir, str(tmp_path))


def test_the_bundled_head_drafts_for_the_bundled_model():
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun."
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = LLM(str(BUNDLED / "pagedmoe-moe-default"), dtype="float32")
    llm = LLM(str(BUNDLED / "pagedmoe-moe-default"), dtype="float32",
              speculative_config={"method": "eagle3", "model": str(BUNDLED / "pagedmoe-eagle3-default"),
                                  "num_speculative_tokens": 3, "adaptive": False})
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    stats = llm.engine.get_stats().spec_decode
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.3  # a trained head, not a random one
    assert_all_blocks_free(llm.engine)
