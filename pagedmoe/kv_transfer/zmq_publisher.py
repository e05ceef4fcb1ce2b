"""vLLM's ZMQ event publisher protocol: a PUB socket sends [topic, seq as 8 bytes big-endian, payload] per
batch; an optional ROUTER replay socket answers a subscriber's 8-byte start seq with every buffered batch
from it, then seq -1 and an empty payload. A thread owns the sockets; the engine only enqueues."""
import logging
import queue
import threading
from collections import deque

import zmq

from pagedmoe.kv_transfer.kv_events import KVEventsConfig, encode_batch

logger = logging.getLogger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig):
        self.config, self.seq = config, 0
        self.queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self.buffer: deque = deque(maxlen=config.buffer_steps)
        self.stopping, self.ready = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def publish(self, ts: float, events: list):
        if events:
            try:
                self.queue.put_nowait(encode_batch(ts, events))
            except queue.Full:
                logger.warning("kv events queue full: a batch of %d events was dropped", len(events))

    def shutdown(self):
        self.stopping.set()
        self.thread.join(5)

    def _run(self):
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.bind(self.config.endpoint)
        replay = self._replay_socket(context)
        self.ready.set()
        try:
            while not self.stopping.is_set() or not self.queue.empty():
                self._send_queued(pub)
                if replay is not None:
                    self._serve_replay(replay)
        finally:
            context.destroy(linger=0)

    def _replay_socket(self, context):
        if not self.config.replay_endpoint:
            return None
        socket = context.socket(zmq.ROUTER)
        socket.bind(self.config.replay_endpoint)
        return socket

    def _send_queued(self, pub):
        try:
            payload = self.queue.get(timeout=0.05)
        except queue.Empty:
            return
        seq = self.seq.to_bytes(8, "big", signed=True)
        self.seq += 1
        self.buffer.append((seq, payload))
        pub.send_multipart([self.config.topic.encode(), seq, payload])

    def _serve_replay(self, replay):
        while replay.poll(0):
            identity, _, start = replay.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self.buffer):
                if int.from_bytes(seq, "big", signed=True) >= first:
                    replay.send_multipart([identity, b"", seq, payload])
            replay.send_multipart([identity, b"", END_OF_REPLAY, b""])


def make_publisher(config: KVEventsConfig | None, kv) -> "ZmqEventPublisher | None":
    """vLLM's --kv-events-config: the KV manager records block events; the engine publishes them after every
    step ("null": recorded, not sent)."""
    if config is None:
        return None
    kv.enable_events()
    return ZmqEventPublisher(config) if config.publisher == "zmq" else None
