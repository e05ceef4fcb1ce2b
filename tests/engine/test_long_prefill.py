"""long_prefill_token_threshold, as vLLM's: a prompt's prefill takes at most that many tokens a step while
another request runs or waits, and the whole budget when it is alone."""
import argparse

import pytest

from conftest import assert_all_blocks_free, make_prompts
from pagedmoe import LLM, SamplingParams
from pagedmoe.entrypoints.cli import add_engine_args, engine_kwargs

THRESHOLD = 8


def scheduled_steps(llm: LLM) -> list[list[tuple[int, int]]]:
    """Every step's (request index, new tokens), recorded around the engine's scheduler."""
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        steps.append([(int(seq.request.request_id), n) for seq, n in zip(out.seqs, out.num_new_tokens)])
        return out
    scheduler.schedule = recording
    return steps


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 4):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_prefills_are_capped_while_others_run_or_wait(dense_model):
    path, _ = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, long_prefill_token_threshold=THRESHOLD)
    steps = scheduled_steps(llm)
    prompts = make_prompts(3, seed=11, min_len=30, max_len=40)
    generate(llm, prompts)
    assert all(n <= THRESHOLD for step in steps for _, n in step if len(step) > 1)
    assert steps[0] == [(i, THRESHOLD) for i in range(len(prompts))]  # all three prompts share the first step
    assert_all_blocks_free(llm.engine)


def test_a_request_alone_takes_the_whole_budget(dense_model):
    path, _ = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, long_prefill_token_threshold=THRESHOLD)
    steps = scheduled_steps(llm)
    prompt = make_prompts(1, seed=12, min_len=30, max_len=40)[0]
    generate(llm, [prompt])
    assert steps[0] == [(0, len(prompt))]
    assert_all_blocks_free(llm.engine)


def test_capped_and_uncapped_runs_generate_the_same_tokens(dense_model):
    path, _ = dense_model
    prompts = make_prompts(4, seed=13, min_len=20, max_len=50)
    capped, uncapped = [generate(LLM(path, dtype="float32", skip_tokenizer_init=True, long_prefill_token_threshold=t),
                                 prompts, max_tokens=6) for t in (5, 0)]
    assert [o.outputs[0].token_ids for o in capped] == [o.outputs[0].token_ids for o in uncapped]


def test_a_negative_threshold_is_a_clear_error(dense_model):
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True, long_prefill_token_threshold=-1)


def test_the_flag_is_vllms():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--long-prefill-token-threshold", "128"])
    assert engine_kwargs(args) == {"long_prefill_token_threshold": 128}
