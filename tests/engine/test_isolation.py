"""One request's failure inside a step fails that request alone; an error no request explains is raised."""
import pytest

from conftest import assert_all_blocks_free, hf_greedy, make_prompts
from pagedmoe import LLM, SamplingParams
from pagedmoe.engine.isolation import EngineStepError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _fail_for(monkeypatch, target, name: str, request_id: str, error=RuntimeError):
    """Wraps target.name(first argument = sequences) to raise while `request_id` is among them."""
    original = getattr(target, name)

    def failing(*args, **kwargs):
        seqs = args[0] if isinstance(args[0], list) else [args[0]]
        if any(seq.request.request_id == request_id for seq in seqs):
            raise error(f"injected failure for {request_id}")
        return original(*args, **kwargs)
    monkeypatch.setattr(target, name, failing)


def _run(llm: LLM, prompts: list[list[int]]) -> dict:
    for index, prompt in enumerate(prompts):
        llm.engine.add_request(str(index), prompt, GREEDY)
    finals = {}
    while llm.engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in llm.engine.step() if o.finished})
    return finals


def test_a_failing_request_in_the_sampler_fails_alone(dense_model, monkeypatch, caplog):
    path, hf_model = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    prompts = make_prompts(4, seed=3)
    _fail_for(monkeypatch, llm.engine.runner, "_sampling_batch", "2")
    finals = _run(llm, prompts)
    assert finals["2"].outputs[0].finish_reason == "error" and "injected failure" in finals["2"].error
    for index in ("0", "1", "3"):
        assert finals[index].error is None
        assert finals[index].outputs[0].token_ids == hf_greedy(hf_model, prompts[int(index)], 8)
    assert "request 2 failed" in caplog.text and "Traceback" in caplog.text
    assert_all_blocks_free(llm.engine)
    out = llm.generate({"prompt_token_ids": prompts[2]}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompts[2], 8)


def test_a_failure_while_appending_tokens_fails_that_request_only(dense_model, monkeypatch):
    path, hf_model = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    prompts = make_prompts(3, seed=4)
    _fail_for(monkeypatch, llm.engine.detokenizer, "append", "1", ValueError)
    finals = _run(llm, prompts)
    assert finals["1"].outputs[0].finish_reason == "error"
    assert [finals[i].outputs[0].token_ids for i in ("0", "2")] == [hf_greedy(hf_model, prompts[i], 8)
                                                                    for i in (0, 2)]
    assert_all_blocks_free(llm.engine)


def test_failed_prompt_blocks_do_not_poison_the_prefix_cache(dense_model, monkeypatch):
    """The failed step's blocks were hashed at allocation but never written: a later request with the same
    prompt must compute them, not hit them."""
    path, hf_model = dense_model
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    prompt = make_prompts(1, seed=5, min_len=40, max_len=40)[0]
    _fail_for(monkeypatch, llm.engine.runner, "_sampling_batch", "0")
    assert _run(llm, [prompt])["0"].outputs[0].finish_reason == "error"
    monkeypatch.undo()
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)
    assert_all_blocks_free(llm.engine)


def test_an_error_every_request_shares_is_raised(dense_model, monkeypatch):
    llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True)

    def broken(*args, **kwargs):
        raise RuntimeError("the model is broken")
    monkeypatch.setattr(llm.engine.runner, "_sampling_batch", broken)
    with pytest.raises(EngineStepError, match="every request"):
        _run(llm, make_prompts(2))


def test_out_of_memory_is_not_blamed_on_a_request(dense_model, monkeypatch):
    llm = LLM(dense_model[0], dtype="float32", skip_tokenizer_init=True)
    _fail_for(monkeypatch, llm.engine.runner, "_sampling_batch", "0", MemoryError)
    with pytest.raises(MemoryError):
        _run(llm, make_prompts(2))
