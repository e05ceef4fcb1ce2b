"""The NIXL connector's side channel, as vLLM's: a prefill engine answers GET_META on a ZMQ socket at
(side_channel_host, side_channel_port) with its NIXL agent's metadata and its KV cache's layout (msgpack); a
decode engine asks once per remote engine before its first read. Only metadata goes over it: the KV bytes move
by NIXL reads."""
import threading

import msgpack
import zmq

GET_META = b"get_meta_msg"  # vLLM's request name


class SideChannel:
    """A REP socket in a daemon thread serving one fixed payload."""

    def __init__(self, host: str, port: int, metadata: dict):
        self.payload = msgpack.packb(metadata, use_bin_type=True)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self._bind(host, port)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="nixl-side-channel", daemon=True)
        self.thread.start()

    def _bind(self, host: str, port: int) -> int:
        try:
            if port == 0:
                return self.socket.bind_to_random_port(f"tcp://{host}")
            self.socket.bind(f"tcp://{host}:{port}")
            return port
        except zmq.ZMQError as error:
            self.context.destroy(linger=0)
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.side_channel_host/port: cannot "
                             f"listen on {host}:{port}: {error}") from None

    def _serve(self):
        while not self.stopping.is_set():
            if self.socket.poll(100):
                request = self.socket.recv()
                self.socket.send(self.payload if request == GET_META else b"")

    def close(self):
        self.stopping.set()
        self.thread.join(2)
        self.context.destroy(linger=0)


def fetch_metadata(host: str, port: int, timeout_s: float) -> dict:
    """The peer's metadata, or TimeoutError when it does not answer within timeout_s."""
    context = zmq.Context()
    try:
        socket = context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://{host}:{port}")
        socket.send(GET_META)
        if not socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"kv_transfer: the prefill engine's side channel {host}:{port} did not answer "
                               f"within {timeout_s:g} s")
        return msgpack.unpackb(socket.recv(), raw=False)
    finally:
        context.destroy(linger=0)
