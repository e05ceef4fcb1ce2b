"""The adaptive switch: per batch-size bucket, the faster of speculating and not, by measured seconds per
emitted token, with the slower mode probed now and then; and through the engine, outputs unchanged."""
import random

import pytest

from conftest import assert_all_blocks_free, hf_greedy, make_prompts
from pagedmoe import LLM, SamplingParams
from pagedmoe.spec_decode.adaptive import (DECAY, MARGIN, MAX_PROBE_GAP, OUTLIER, PROBE_EVERY, SPEC_PROBE_STEPS,
                                           AdaptiveSwitch, bucket_of)


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 7, 8, 64)] == [1, 2, 2, 3, 3, 4, 7]


def run_steps(switch: AdaptiveSwitch, batch_size: int, seconds: dict[bool, float], num_steps: int) -> list[bool]:
    """num_steps decode steps, each emitting batch_size tokens in seconds[mode]; the modes chosen."""
    chosen = []
    for _ in range(num_steps):
        mode = switch.should_speculate(batch_size)
        chosen.append(mode)
        switch.record(batch_size, mode, seconds[mode], batch_size)
    return chosen


FIRST = SPEC_PROBE_STEPS + 1  # the steps that measure both modes first, at batch 1


def probe_steps(chosen: list[bool], mode: bool) -> list[int]:
    """Where probes of `mode` start, after the steps that measure both."""
    return [i for i in range(FIRST, len(chosen)) if chosen[i] == mode and chosen[i - 1] != mode]


def test_measures_both_then_keeps_the_faster_and_probes_the_other_ever_less():
    """Speculation is measured over a probe's worth of steps (at batch 1, SPEC_PROBE_STEPS: one step emits 1 to
    k + 1 tokens), plain over one; then the faster runs and the other is probed at doubling gaps."""
    switch = AdaptiveSwitch()
    chosen = run_steps(switch, 1, {True: 0.01, False: 0.02}, 4 * MAX_PROBE_GAP)
    assert chosen[:FIRST] == [True] * SPEC_PROBE_STEPS + [False]
    probes = probe_steps(chosen, False)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == FIRST + PROBE_EVERY and gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_GAP
    assert all(chosen[i + 1] for i in probes)  # a probe of plain decoding is one step
    assert run_steps(switch, 1, {True: 0.01, False: 0.02}, 4)[-1]  # bucket 1 kept what it learned


def test_a_new_bucket_starts_from_its_neighbours_choice():
    """At batch 64 drafts cost more than they give; the bucket first keeps bucket 1's choice, probes plain
    decoding PROBE_EVERY steps on, then keeps it and probes speculation ever less, one step at a time (64
    sequences' drafts say enough)."""
    switch = AdaptiveSwitch()
    run_steps(switch, 1, {True: 0.01, False: 0.02}, 64)
    slow = run_steps(switch, 64, {True: 0.05, False: 0.02}, 512)
    assert slow[:PROBE_EVERY] == [True] * PROBE_EVERY and not slow[PROBE_EVERY]
    spec_probes = [i for i in range(PROBE_EVERY + 1, len(slow)) if slow[i] and not slow[i - 1]]
    assert all(slow[i:i + 2] == [True, False] for i in spec_probes)
    assert 0 < len(spec_probes) < 512 // 50


def test_speculation_must_be_cheaper_by_the_margin():
    switch = AdaptiveSwitch()
    close = run_steps(switch, 8, {True: 0.02 * (MARGIN + 1) / 2, False: 0.02}, 64)
    assert close[:3] == [True, True, False] and close[-PROBE_EVERY:].count(True) <= 2  # probes of 2 steps at 8


def test_follows_a_change_in_the_workload():
    switch = AdaptiveSwitch()
    run_steps(switch, 8, {True: 0.01, False: 0.02}, 2 * PROBE_EVERY)
    after = run_steps(switch, 8, {True: 0.05, False: 0.02}, 4 * PROBE_EVERY)
    assert after[-PROBE_EVERY:].count(True) <= SPEC_PROBE_STEPS  # at most one probe


def test_the_engine_output_is_the_same_with_the_switch(dense_model):
    path, model = dense_model
    prompts = [p + p for p in make_prompts(6, seed=11, min_len=4, max_len=16)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p, 24) for p in prompts]
    assert llm.engine.spec_switch is not None and llm.engine.spec_switch.buckets
    assert_all_blocks_free(llm.engine)


def test_drafting_time_is_charged_to_the_step_that_verifies_the_drafts():
    """A plain step that drafted for the next one keeps its own time; the step that verifies the drafts pays
    for them (the first after plain steps too: its drafts' catch-up is a cost of switching). Each mode's
    estimate is its decayed seconds over its decayed tokens."""
    switch = AdaptiveSwitch()
    switch.record(4, False, 0.05, 4, proposal_s=0.03)
    switch.record(4, True, 0.02, 8, proposal_s=0.01)
    bucket = switch.buckets[bucket_of(4)]
    assert bucket.seconds_per_token(False) == pytest.approx(0.02 / 4)
    assert bucket.seconds_per_token(True) == pytest.approx((0.02 - 0.01 + 0.03) / 8)
    switch.record(4, True, 0.005, 2)  # a step that emitted 2 tokens weighs a quarter of one that emitted 8
    want = (DECAY * 0.04 + 0.005 + 0.01) / (DECAY * 8 + 2)
    assert bucket.seconds_per_token(True) == pytest.approx(want)


def test_one_slow_step_counts_for_at_most_outlier_times_the_estimate():
    switch = AdaptiveSwitch()
    switch.record(64, False, 0.02, 64)
    switch.record(64, False, 0.5, 64)  # the host paused
    bucket = switch.buckets[bucket_of(64)]
    want = (DECAY * 0.02 + OUTLIER * 0.02) / (DECAY * 64 + 64)
    assert bucket.seconds_per_token(False) == pytest.approx(want)


def test_a_paused_plain_step_does_not_lock_in_speculation_at_batch_64():
    """Plain steps of 20 ms, speculating ones 60 ms for 2.5x the tokens (1.2x slower a token); the host pauses a
    plain step for 300 ms every 40 steps. The switch keeps plain decoding and speculates only in its probes."""
    switch = AdaptiveSwitch()
    run_steps(switch, 64, {True: 0.06, False: 0.02}, 64)
    chosen = []
    for step in range(2000):
        mode = switch.should_speculate(64)
        chosen.append(mode)
        seconds = 0.06 if mode else (0.3 if step % 40 == 0 else 0.02)
        switch.record(64, mode, seconds, 160 if mode else 64)
    probes = [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]
    assert chosen.count(True) == len(probes) < 20


def test_a_probe_measures_its_mode_afresh():
    """Speculation measured slow for a long while, then cheap: the first probe after the change decides,
    whatever the old sums held."""
    switch = AdaptiveSwitch()
    run_steps(switch, 8, {True: 0.05, False: 0.02}, 8 * PROBE_EVERY)
    after = run_steps(switch, 8, {True: 0.005, False: 0.02}, 8 * PROBE_EVERY)
    first_probe = after.index(True)
    assert all(after[first_probe:first_probe + 4 * PROBE_EVERY])


def test_unlucky_steps_at_batch_1_do_not_switch_a_faster_speculation_off():
    """Batch 1: a speculating step costs 2.4 ms and emits 1-4 tokens (the bundled head's acceptance: 1 token
    29% of the time, 4 tokens 38%), 0.92 ms a token against plain decoding's 1.5. Runs of short steps happen;
    the switch still speculates in at least 97% of the steps (at DECAY 0.7 it ran 22% of them plain)."""
    rng, switch, chosen = random.Random(0), AdaptiveSwitch(), []
    for _ in range(5000):
        mode = switch.should_speculate(1)
        chosen.append(mode)
        emitted = rng.choices([1, 2, 3, 4], [0.29, 0.20, 0.13, 0.38])[0] if mode else 1
        switch.record(1, mode, 0.0024 if mode else 0.0015, emitted)
    assert chosen.count(True) >= 0.97 * len(chosen)
