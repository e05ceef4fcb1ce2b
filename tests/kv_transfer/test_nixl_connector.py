"""NixlConnector between two engines in one process (each with its own NIXL agent, UCX over loopback): the decode
engine reads the prefill engine's blocks and gives one instance's greedy tokens, computing only each prompt's
last token; the prefill engine's lease ends with the read's notification, or after abort_request_timeout when
no one reads; an abort mid-read frees both sides; an unreachable prefill engine fails that request alone."""
import time

import pytest

from conftest import assert_all_blocks_free, make_prompts
from pagedmoe import SamplingParams
from pagedmoe.engine.llm_engine import LLMEngine
from pagedmoe.engine.sequence import SequenceStatus

pytest.importorskip("nixl_cu12")
OUTPUT_LEN = 8


def nixl_engine(path: str, role: str, **extra) -> LLMEngine:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}
    return LLMEngine.from_engine_args(path, dtype="float32", num_kv_blocks=64, kv_transfer_config=config)


@pytest.fixture(scope="module")
def pair(text_model):
    producer = nixl_engine(text_model[0], "kv_producer", abort_request_timeout=30)
    consumer = nixl_engine(text_model[0], "kv_consumer", handshake_timeout=2)
    yield producer, consumer
    consumer.shutdown()
    producer.shutdown()


def params(kv_transfer_params: dict | None = None, max_tokens: int = OUTPUT_LEN) -> SamplingParams:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra)


def run(engines: list[LLMEngine], until, timeout: float = 20) -> dict:
    """Steps every engine until until(finished outputs by request id) holds."""
    finished, deadline = {}, time.monotonic() + timeout
    while not until(finished):
        assert time.monotonic() < deadline, f"not done; finished: {sorted(finished)}"
        for engine in engines:
            finished |= {out.request_id: out for out in engine.step() if out.finished}
    return finished


def prefill(producer: LLMEngine, request_id: str, prompt: list[int]) -> dict:
    producer.add_request(request_id, {"prompt_token_ids": prompt}, params({"do_remote_decode": True}, 1))
    out = run([producer], lambda done: request_id in done)[request_id]
    assert out.kv_transfer_params["do_remote_prefill"] and out.kv_transfer_params["remote_block_ids"]
    return out.kv_transfer_params


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(f"ref-{index}", {"prompt_token_ids": prompt}, params())
    done = run([engine], lambda done: len(done) == len(prompts))
    return [done[f"ref-{index}"].outputs[0].token_ids for index in range(len(prompts))]


def wait_free(engines: list[LLMEngine], timeout: float = 10):
    deadline = time.monotonic() + timeout
    while any(e.connector.num_leases or e.kv.pool.num_free_blocks < e.kv.pool.num_blocks for e in engines):
        assert time.monotonic() < deadline, [e.kv.pool.num_used_blocks for e in engines]
        for engine in engines:
            engine.step()
    for engine in engines:
        assert_all_blocks_free(engine)


def test_decode_reads_the_prefill_blocks_and_matches_one_instance(pair):
    producer, consumer = pair
    prompts = make_prompts(8, seed=21, min_len=3, max_len=70)
    expected = greedy(producer, prompts)
    handed = [prefill(producer, f"p-{i}", prompt) for i, prompt in enumerate(prompts)]
    assert producer.connector.num_leases == len(prompts)  # the blocks wait for the decode engine
    before = consumer.num_prompt_tokens
    for index, (prompt, kv_params) in enumerate(zip(prompts, handed)):
        consumer.add_request(f"d-{index}", {"prompt_token_ids": prompt}, params(kv_params))
    done = run([consumer, producer], lambda done: len(done) == len(prompts))
    assert [done[f"d-{i}"].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert consumer.num_prompt_tokens - before == len(prompts)  # only each prompt's last token
    assert consumer.runner.kv_connector.worker.bytes_read > 0
    wait_free([producer, consumer])


def test_an_unread_lease_ends_after_the_timeout(text_model):
    producer = nixl_engine(text_model[0], "kv_producer", abort_request_timeout=0.5)
    try:
        prefill(producer, "never-read", make_prompts(1, seed=3, min_len=40, max_len=40)[0])
        assert producer.kv.pool.num_used_blocks > 0 and producer.connector.num_leases == 1
        time.sleep(0.6)
        producer.step()
        assert producer.connector.num_leases == 0
        assert_all_blocks_free(producer)
    finally:
        producer.shutdown()


def test_an_abort_mid_read_frees_both_sides(pair, monkeypatch):
    """The read is held in flight (its state stays PROC) while the request is aborted: the decode engine keeps
    the blocks the read writes into until it ends; another request decodes meanwhile and matches."""
    producer, consumer = pair
    prompts = make_prompts(2, seed=31, min_len=30, max_len=60)
    expected = greedy(producer, prompts[1:])
    worker = consumer.runner.kv_connector.worker
    check, held = worker.agent.check_xfer_state, {"on": True}
    monkeypatch.setattr(worker.agent, "check_xfer_state", lambda h: "PROC" if held["on"] else check(h))
    consumer.add_request("aborted", {"prompt_token_ids": prompts[0]}, params(prefill(producer, "pa", prompts[0])))
    consumer.add_request("other", {"prompt_token_ids": prompts[1]}, params())
    while not worker.reads or worker.reads["aborted"].handle is None:
        consumer.step()
    assert consumer.requests["aborted"].seqs[0].status == SequenceStatus.WAITING_FOR_REMOTE_KVS
    consumer.abort_request("aborted")
    assert consumer.connector.num_leases == 1  # the read still writes into its blocks
    done = run([consumer], lambda done: "other" in done)
    assert done["other"].outputs[0].token_ids == expected[0]
    held["on"] = False
    wait_free([producer, consumer])


def test_an_abort_before_the_read_releases_the_prefill_lease(pair):
    producer, consumer = pair
    prompt = make_prompts(1, seed=41, min_len=20, max_len=20)[0]
    consumer.add_request("early", {"prompt_token_ids": prompt}, params(prefill(producer, "pe", prompt)))
    consumer.abort_request("early")  # still waiting: never admitted, never read
    assert producer.connector.num_leases == 1
    wait_free([producer, consumer])


def test_an_unreachable_prefill_fails_that_request_alone(pair):
    producer, consumer = pair
    prompts = make_prompts(2, seed=51, min_len=10, max_len=30)
    expected = greedy(consumer, prompts[1:])
    gone = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_host": "127.0.0.1", "remote_port": 9,
            "remote_block_ids": [0, 1, 2], "remote_request_id": "x"}
    consumer.add_request("lost", {"prompt_token_ids": prompts[0]}, params(gone))
    consumer.add_request("fine", {"prompt_token_ids": prompts[1]}, params())
    done = run([consumer], lambda done: {"lost", "fine"} <= done.keys())
    assert done["lost"].outputs[0].finish_reason == "error" and "did not answer" in done["lost"].error
    assert done["fine"].outputs[0].token_ids == expected[0]
    wait_free([producer, consumer])


def test_bad_extra_config_names_the_field(text_model):
    for extra, name in (({"abort_request_timeout": 0}, "abort_request_timeout"),
                        ({"side_channel_port": "x"}, "side_channel_port")):
        with pytest.raises(ValueError, match=name):
            nixl_engine(text_model[0], "kv_producer", **extra)


def test_an_aborted_prefill_request_takes_no_lease(text_model):
    """Aborted mid-prefill (chunked, blocks allocated), the request hands nothing off: its blocks are freed."""
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    producer = LLMEngine.from_engine_args(text_model[0], dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                                          kv_transfer_config=config)
    try:
        prompt = make_prompts(1, seed=61, min_len=60, max_len=60)[0]
        producer.add_request("cut", {"prompt_token_ids": prompt}, params({"do_remote_decode": True}, 1))
        producer.step()
        assert producer.kv.pool.num_used_blocks > 0
        producer.abort_request("cut")
        producer.step()
        assert producer.connector.num_leases == 0
        assert_all_blocks_free(producer)
    finally:
        producer.shutdown()
