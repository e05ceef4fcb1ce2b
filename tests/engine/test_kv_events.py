"""KV events over ZMQ in vLLM's format: a subscriber decodes BlockStored for a prompt's full blocks (chained
parent hashes, the blocks' tokens, medium GPU), BlockRemoved when they are evicted, AllBlocksCleared on
reset_prefix_cache, CPU-tier events with offloading, and a replay from a sequence number."""
import socket

import msgpack
import pytest
import zmq

from conftest import assert_all_blocks_free, save_random_model, tiny_dense_config
from pagedmoe import LLM, SamplingParams
from pagedmoe.kv_transfer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

TOPIC = "kv@test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    save_random_model(tiny_dense_config("llama"), path)
    return path


class Subscriber:
    def __init__(self, endpoint: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.socket.connect(endpoint)

    def events(self, timeout_ms: int = 3000) -> list:
        got = []
        while self.socket.poll(timeout_ms if not got else 300):
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == TOPIC.encode() and len(seq) == 8
            got += decode_batch(payload)[1]
        return got

    def close(self):
        self.context.destroy(linger=0)


def engine(path: str, port: int, replay_port: int | None = None, **args) -> LLM:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
              "topic": TOPIC, "replay_endpoint": f"tcp://127.0.0.1:{replay_port}" if replay_port else None}
    return LLM(path, dtype="float32", skip_tokenizer_init=True, kv_events_config=config, **args)


def run(llm: LLM, prompt: list[int]):
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)


def test_stored_removed_and_cleared(model_path):
    port = free_port()
    llm = engine(model_path, port, num_kv_blocks=8)
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        run(llm, [5] * 40)  # warm the subscription: PUB drops what is sent before a subscriber joins
        subscriber.events()
        prompt = list(range(10, 50))  # 40 tokens: blocks 0 and 1 full once computed
        run(llm, prompt)
        stored = [e for e in subscriber.events() if isinstance(e, BlockStored)]
        assert [e.token_ids for e in stored][:2] == [prompt[:16], prompt[16:32]]
        assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == stored[0].block_hashes[0]
        assert {e.medium for e in stored} == {"GPU"} and all(e.block_size == 16 for e in stored)
        for start in (100, 200):  # other prompts take the 8 blocks: the cached ones are evicted
            run(llm, list(range(start, start + 60)))
        removed = {h for e in subscriber.events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert {stored[0].block_hashes[0], stored[1].block_hashes[0]} <= removed
        assert llm.reset_prefix_cache()
        assert any(isinstance(e, AllBlocksCleared) for e in subscriber.events())
        assert_all_blocks_free(llm.engine)
    finally:
        subscriber.close()
        llm.engine.shutdown()


def test_offloaded_blocks_are_announced_in_the_cpu_tier_and_replayed(model_path):
    port, replay_port = free_port(), free_port()
    llm = engine(model_path, port, replay_port, num_kv_blocks=8, kv_offload=True, swap_space=1 / 1024)
    try:
        for start in (10, 100, 200):
            run(llm, list(range(start, start + 60)))
        context = zmq.Context()
        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert replay.poll(5000)
            _, seq, payload = replay.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            batches.append(decode_batch(payload)[1])
        context.destroy(linger=0)
        events = [e for batch in batches for e in batch]
        assert any(isinstance(e, BlockStored) and e.medium == "CPU" for e in events)
        assert any(isinstance(e, BlockRemoved) and e.medium == "GPU" for e in events)
        # vLLM 0.32's layout: the batch an array, each event a map tagged by "type" (extra keys ignored)
        raw = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [b"h"], "medium": "GPU", "group_idx": 0}], 0])
        assert decode_batch(raw)[1] == [BlockRemoved([b"h"], "GPU")]
    finally:
        llm.engine.shutdown()
