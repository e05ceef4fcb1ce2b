"""kv_load_failure_policy with the SharedStorageConnector, two engines in one process sharing a directory: a
stored KV that is unreadable, or gone by the time it is loaded, fails its request under "fail" (vLLM's default)
and is computed by the decode engine under "recompute", with one instance's greedy tokens. Either way the
pool ends free and the blocks the load was to fill never serve a prefix-cache hit."""
import contextlib
import os

import pytest

from conftest import assert_all_blocks_free, make_prompts
from pagedmoe import SamplingParams
from pagedmoe.engine.llm_engine import LLMEngine

OUTPUT_LEN = 6


def storage_engine(path: str, store, role: str, **config) -> LLMEngine:
    config |= {"kv_connector": "SharedStorageConnector", "kv_role": role,
               "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return LLMEngine.from_engine_args(path, dtype="float32", num_kv_blocks=64, kv_transfer_config=config)


@contextlib.contextmanager
def decode_engine(path: str, store, **config):
    engine = storage_engine(path, store, "kv_consumer", **config)
    try:
        yield engine
    finally:
        engine.shutdown()


def params(kv_transfer_params: dict | None = None, max_tokens: int = OUTPUT_LEN) -> SamplingParams:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra)


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], sampling: SamplingParams):
    engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                return out
    raise AssertionError(f"{request_id} gave no final output")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def producer(text_model, store):
    engine = storage_engine(text_model[0], store, "kv_producer")
    yield engine
    engine.shutdown()


def stored_kv_file(producer: LLMEngine, prompt: list[int]):
    """The prefill engine saves prompt's KV; the path of its file."""
    out = run_one(producer, f"p-{len(prompt)}-{prompt[0]}", prompt, params({"do_remote_decode": True}, 1))
    assert out.kv_transfer_params["do_remote_prefill"]
    return producer.connector.file(producer.connector.key_of(type("S", (), {"token_ids": prompt})(), len(prompt) - 1))


def corrupt(path: str, consumer: LLMEngine):
    with open(path, "wb") as file:
        file.write(b"not a safetensors file")


def remove_at_load(path: str, consumer: LLMEngine):
    """The file is there when the request is admitted and gone when the worker loads it (another process
    cleaned the directory in between)."""
    admit = consumer.connector.update_state_after_alloc

    def admit_then_remove(seq, num_external_tokens):
        admit(seq, num_external_tokens)
        os.remove(path)
    consumer.connector.update_state_after_alloc = admit_then_remove


@pytest.mark.parametrize("break_kv", [corrupt, remove_at_load])
def test_recompute_computes_the_prompt_when_the_stored_kv_does_not_load(text_model, store, producer, break_kv):
    prompt = make_prompts(1, seed=71, min_len=45, max_len=45)[0]
    expected = run_one(producer, "ref", prompt, params()).outputs[0].token_ids
    with decode_engine(text_model[0], store, kv_load_failure_policy="recompute") as consumer:
        break_kv(stored_kv_file(producer, prompt), consumer)
        before = consumer.num_prompt_tokens
        out = run_one(consumer, "d", prompt, params({"do_remote_prefill": True}))
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == expected
        assert out.num_cached_tokens == 0  # no hit on the blocks the failed load was to fill
        assert consumer.num_prompt_tokens - before == len(prompt)  # the whole prompt computed here
        assert_all_blocks_free(consumer)


def test_fail_fails_the_request_and_caches_none_of_its_blocks(text_model, store, producer):
    prompt = make_prompts(1, seed=73, min_len=50, max_len=50)[0]
    expected = run_one(producer, "ref", prompt, params()).outputs[0].token_ids
    with decode_engine(text_model[0], store) as consumer:
        corrupt(stored_kv_file(producer, prompt), consumer)
        failed = run_one(consumer, "d", prompt, params({"do_remote_prefill": True}))
        assert failed.outputs[0].finish_reason == "error" and "SafetensorError" in failed.error
        assert_all_blocks_free(consumer)
        again = run_one(consumer, "again", prompt, params())
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == expected


def test_a_loaded_kv_is_cached_once_it_is_there(text_model, store, producer):
    """delay_cache does not lose the loaded blocks: a later request with the same prompt hits them."""
    prompt = make_prompts(1, seed=75, min_len=50, max_len=50)[0]
    stored_kv_file(producer, prompt)
    with decode_engine(text_model[0], store) as consumer:
        first = run_one(consumer, "d", prompt, params({"do_remote_prefill": True}))
        again = run_one(consumer, "again", prompt, params())
        assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_bad_policy_names_the_field(text_model, store):
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        storage_engine(text_model[0], store, "kv_consumer", kv_load_failure_policy="retry")
