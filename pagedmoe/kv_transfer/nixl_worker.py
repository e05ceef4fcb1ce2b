"""The NIXL connector's worker side: a NIXL agent (UCX backend) with this engine's KV cache registered. A
decode engine reads a prefill engine's blocks into its own with NIXL READs: one handshake per remote engine
(side channel, in a background thread so no step waits on it), then one read per request, posted and polled
each step; the read's notification tells the prefill engine that its blocks may be freed.

NIXL's own progress thread polls UCX without pause (its Python API sets no delay): on this 2-core machine it
took a whole core per engine (3.0 CPU-s in 3 s idle). So it is off, and a thread of ours drives progress
every PROGRESS_INTERVAL_S instead (UCX over TCP moves a read only while both agents progress); the agent is
used under one lock."""
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedmoe.kv_transfer.connector import KVLoad, KVTransferOutput
from pagedmoe.kv_transfer.nixl_side_channel import fetch_metadata

logger = logging.getLogger(__name__)
PROGRESS_INTERVAL_S = 0.0005


@dataclass
class KVLayout:
    """Where each (layer, kv tensor, block) region of a KV cache lies; what two engines must agree on."""
    base_addr: int
    num_blocks: int
    num_planes: int  # layers x kv tensors
    block_bytes: int
    block_shape: list  # [layers, kv_tensors, block_size, ...] (the cache's shape without its blocks)
    dtype: str

    @classmethod
    def of(cls, cache: torch.Tensor) -> "KVLayout":
        if not cache.is_contiguous():
            raise ValueError("kv_transfer: the NIXL connector needs a contiguous KV cache")
        return cls(cache.data_ptr(), cache.shape[2], cache.shape[0] * cache.shape[1], cache[0, 0, 0].nbytes,
                   [*cache.shape[:2], *cache.shape[3:]], str(cache.dtype))

    def descs(self, block_ids: list[int]) -> np.ndarray:
        """NIXL's Nx3 descriptors (address, length, device) of the blocks in every plane."""
        blocks = np.asarray(block_ids, dtype=np.uint64)
        planes = np.arange(self.num_planes, dtype=np.uint64)[:, None]
        addrs = self.base_addr + (planes * self.num_blocks + blocks) * self.block_bytes
        return np.stack([addrs.ravel(), np.full(addrs.size, self.block_bytes, np.uint64),
                         np.zeros(addrs.size, np.uint64)], axis=1)

    def check_peer(self, peer: "KVLayout"):
        if (peer.block_shape, peer.dtype) != (self.block_shape, self.dtype):
            raise ValueError(f"kv_transfer: the remote engine's KV blocks {peer.block_shape} {peer.dtype} do not "
                             f"fit this engine's {self.block_shape} {self.dtype} (another model, dtype or block size)")


@dataclass
class Remote:
    agent_name: str
    layout: KVLayout


@dataclass
class Read:
    load: KVLoad
    handle: object = None
    started: float = field(default_factory=time.perf_counter)


class NixlWorker:
    def __init__(self, engine_id: str, cache: torch.Tensor, backends: list[str], handshake_timeout: float):
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError as error:
            raise ValueError(f"kv_transfer_config: NixlConnector needs the nixl-cu12 package ({error})") from None
        self.engine_id, self.handshake_timeout = engine_id, handshake_timeout
        self.agent = nixl_agent(engine_id, nixl_agent_config(enable_prog_thread=False, backends=backends))
        self.registered = self.agent.register_memory(cache)
        self.layout = KVLayout.of(cache)
        self.remotes: dict[str, Remote] = {}
        self.handshakes: dict[str, Future] = {}
        self.reads: dict[str, Read] = {}
        self.notified: list[str] = []  # request ids peers have read (or released), from their notifications
        self.background = ThreadPoolExecutor(1, thread_name_prefix="nixl-handshake")
        self.bytes_read, self.read_seconds = 0, 0.0  # for the transfer bandwidth
        self.lock, self.stopping = threading.Lock(), threading.Event()
        self.progress = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self.progress.start()

    def _progress(self):
        while not self.stopping.wait(PROGRESS_INTERVAL_S):
            with self.lock:
                self._take_notifications()

    def _take_notifications(self):
        notifications = self.agent.get_new_notifs()
        self.notified += [message.decode() for messages in notifications.values() for message in messages]

    def handshake_metadata(self) -> dict:
        return {"engine_id": self.engine_id, "agent_metadata": self.agent.get_agent_metadata(),
                "layout": vars(self.layout)}

    def start_read(self, load: KVLoad):
        """Queues the read (or, with no blocks, the bare release notification) of load's remote blocks."""
        with self.lock:
            self.reads[load.request_id] = Read(load)
            self._remote(load.remote)

    def get_finished(self) -> KVTransferOutput:
        with self.lock:
            self._take_notifications()
            out = KVTransferOutput(finished_sending=self.notified)
            self.notified = []
            self._advance_reads(out)
        return out

    def _advance_reads(self, out: KVTransferOutput):
        for request_id, read in list(self.reads.items()):
            try:
                if self._advance(read):
                    out.finished_recving.add(request_id)
                    self._drop(request_id)
            except Exception as error:  # the peer gone, a refused handshake, a failed read: this request only
                out.failed_recving[request_id] = error
                self._drop(request_id)
        self.handshakes = {e: f for e, f in self.handshakes.items() if not (f.done() and f.exception())}

    def _advance(self, read: Read) -> bool:
        """Moves a read on; True once it is done."""
        if read.handle is None:
            remote = self._remote(read.load.remote)
            if remote is None:
                return False
            if not read.load.block_ids:
                self.agent.send_notif(remote.agent_name, read.load.key.encode())
                return True
            read.handle = self._post(read.load, remote)
        state = self._state(read)
        if state == "DONE":
            self.read_seconds += time.perf_counter() - read.started
            self.bytes_read += self.layout.block_bytes * self.layout.num_planes * self._num_blocks(read.load)
        return state == "DONE"

    def _state(self, read: Read) -> str:
        """The read's NIXL state; a failure (the peer gone: NIXL_ERR_REMOTE_DISCONNECT) raises, naming it."""
        engine_id = read.load.remote["remote_engine_id"]
        try:
            state = self.agent.check_xfer_state(read.handle)
        except Exception as error:
            state = f"{type(error).__name__}: {error}"
        if state not in ("DONE", "PROC"):
            self._forget(engine_id)
            raise RuntimeError(f"kv_transfer: the NIXL read from engine {engine_id} failed ({state})")
        return state

    def _remote(self, params: dict) -> Remote | None:
        """The remote engine once its handshake is done (None before); raises the handshake's error."""
        engine_id = params["remote_engine_id"]
        if engine_id in self.remotes:
            return self.remotes[engine_id]
        if engine_id not in self.handshakes:
            self.handshakes[engine_id] = self.background.submit(fetch_metadata, params["remote_host"],
                                                                int(params["remote_port"]), self.handshake_timeout)
        future = self.handshakes[engine_id]
        if not future.done():
            return None
        return self._add_remote(engine_id, future.result())

    def _add_remote(self, engine_id: str, metadata: dict) -> Remote:
        if metadata.get("engine_id") != engine_id:
            raise ValueError(f"kv_transfer_params.remote_engine_id {engine_id!r}: the side channel is engine "
                             f"{metadata.get('engine_id')!r}")
        layout = KVLayout(**metadata["layout"])
        self.layout.check_peer(layout)
        name = self.agent.add_remote_agent(metadata["agent_metadata"])
        self.remotes[engine_id] = Remote(name.decode() if isinstance(name, bytes) else name, layout)
        del self.handshakes[engine_id]
        return self.remotes[engine_id]

    def _num_blocks(self, load: KVLoad) -> int:
        return -(-load.num_tokens // self.layout.block_shape[2])

    def _post(self, load: KVLoad, remote: Remote):
        num_blocks = self._num_blocks(load)
        remote_ids = list(load.remote.get("remote_block_ids") or [])[:num_blocks]
        if len(remote_ids) < num_blocks or not all(0 <= b < remote.layout.num_blocks for b in remote_ids):
            raise ValueError(f"kv_transfer_params.remote_block_ids: {num_blocks} blocks of the remote engine's "
                             f"{remote.layout.num_blocks} are needed for {load.num_tokens} tokens")
        local = self.agent.get_xfer_descs(self.layout.descs(load.block_ids[:num_blocks]), "DRAM")
        peer = self.agent.get_xfer_descs(remote.layout.descs(remote_ids), "DRAM")
        handle = self.agent.initialize_xfer("READ", local, peer, remote.agent_name, load.key.encode())
        try:
            posted = self.agent.transfer(handle)
        except Exception as error:
            posted = f"{type(error).__name__}: {error}"
        if posted not in ("DONE", "PROC"):
            self.agent.release_xfer_handle(handle)
            self._forget(load.remote["remote_engine_id"])
            raise RuntimeError(f"kv_transfer: the NIXL read from engine {load.remote['remote_engine_id']} could "
                               f"not be posted ({posted})")
        return handle

    def _drop(self, request_id: str):
        read = self.reads.pop(request_id, None)
        if read is not None and read.handle is not None:
            self.agent.release_xfer_handle(read.handle)

    def _forget(self, engine_id: str):
        """A failed read: the next request to that engine handshakes again (it may have restarted)."""
        remote = self.remotes.pop(engine_id, None)
        if remote is not None:
            self.agent.remove_remote_agent(remote.agent_name)

    def shutdown(self):
        self.stopping.set()
        self.progress.join(2)
        self.background.shutdown(wait=False, cancel_futures=True)
        for request_id in list(self.reads):
            self._drop(request_id)
        self.agent.deregister_memory(self.registered)
