"""vLLM's NixlConnector (pull-based P/D over NIXL, UCX backend; TCP where there is no RDMA). The prefill
engine (kv_producer) keeps a finished request's blocks under a lease and answers with kv_transfer_params naming
them and its side channel; the decode engine (kv_consumer) allocates blocks, handshakes with the prefill engine
once, reads the remote blocks into its own with NIXL (its request waiting meanwhile, the others stepping on) and
the read's notification ends the lease. A lease also ends after abort_request_timeout seconds (vLLM's
VLLM_NIXL_ABORT_REQUEST_TIMEOUT) when no decode engine reads. A decode request aborted mid-read keeps its blocks
until the read ends; one aborted before its read releases the prefill engine's lease by a bare notification.

kv_connector_extra_config: abort_request_timeout (s, 480), handshake_timeout (s, 10), side_channel_host
(VLLM_NIXL_SIDE_CHANNEL_HOST, 127.0.0.1), side_channel_port (VLLM_NIXL_SIDE_CHANNEL_PORT, 0: any free
port, which the kv_transfer_params carry), backends (["UCX"])."""
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

from pagedmoe.kv_transfer.connector import CONNECTORS, KVConnector, KVLoad, KVTransferOutput

logger = logging.getLogger(__name__)
FIELD = "kv_transfer_config.kv_connector_extra_config"


@dataclass
class Lease:
    """Holds a finished sequence's blocks (a fork of its block table: one more reference on each block)."""
    expires: float
    dp_rank: int | None = None
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0


def take_lease(seq, kv, expires: float = float("inf")) -> Lease:
    lease = Lease(expires, seq.dp_rank)
    kv.fork(seq, lease)
    return lease


def positive_number(extra: dict, key: str, default: float) -> float:
    try:
        value = float(extra.get(key, default))
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0:
        raise ValueError(f"{FIELD}.{key} must be a positive number of seconds, got {extra.get(key)!r}")
    return value


class NixlConnector(KVConnector):
    load_kv_async = True

    def __init__(self, config):
        super().__init__(config)
        extra = config.kv_connector_extra_config
        env_timeout = os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", 480)
        self.lease_timeout = positive_number(extra, "abort_request_timeout", env_timeout)
        self.handshake_timeout = positive_number(extra, "handshake_timeout", 10)
        self.host = extra.get("side_channel_host") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        self.port = self._port(extra.get("side_channel_port", os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", 0)))
        self.backends = extra.get("backends", ["UCX"])
        self.leases: dict[str, list[Lease]] = defaultdict(list)  # prefill side: by request id, oldest first
        self.reading: set[str] = set()  # decode side: requests whose read has started and not ended
        self.read_leases: dict[str, Lease] = {}  # decode side: blocks of requests aborted mid-read
        self.side_channel = self.worker = None

    @staticmethod
    def _port(value) -> int:
        if not str(value).isdigit() or int(value) > 65535:
            raise ValueError(f"{FIELD}.side_channel_port must be a TCP port (0: any free one), got {value!r}")
        return int(value)

    # scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict | None):
        if self.config.is_producer and metadata is not None:
            from pagedmoe.kv_transfer.nixl_side_channel import SideChannel
            self.side_channel = SideChannel(self.host, self.port, metadata)
            self.port = self.side_channel.port

    def get_num_new_matched_tokens(self, seq) -> int:
        params = seq.request.kv_transfer_params
        needed = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")
        ready = all(params.get(key) is not None for key in needed)
        return seq.num_prompt_tokens - 1 if ready and seq.num_prompt_tokens > 1 else 0

    def update_state_after_alloc(self, seq, num_external_tokens: int):
        params, request_id = seq.request.kv_transfer_params, seq.request.request_id
        self.pending.loads.append(KVLoad(str(params.get("remote_request_id")), list(seq.block_table),
                                         num_external_tokens, request_id, params))
        self.reading.add(request_id)

    def request_finished(self, seq):
        """A prefill engine's answer; the blocks stay (before_free leases them) for the decode engine to read."""
        params = seq.request.kv_transfer_params
        if not (self.config.is_producer and params and params.get("do_remote_decode")):
            return None, None
        return self.response_params(seq, KVLoad("", list(seq.block_table), seq.num_prompt_tokens - 1)), None

    def response_params(self, seq, save: KVLoad) -> dict:
        return super().response_params(seq, save) | {"remote_host": self.host, "remote_port": self.port}

    def before_free(self, seq, kv):
        request_id = seq.request.request_id
        if request_id in self.reading:  # the read may still write into these blocks
            self.read_leases[request_id] = take_lease(seq, kv)
        elif (seq.request.kv_transfer_params_out or {}).get("remote_engine_id") == self.config.engine_id:
            self.leases[request_id].append(take_lease(seq, kv, time.monotonic() + self.lease_timeout))
        elif self.wants_remote_prefill(seq.request.kv_transfer_params):
            self._release_unread(seq)

    def _release_unread(self, seq):
        """A decode request that ends before its read: a bare notification frees the prefill engine's lease."""
        params = seq.request.kv_transfer_params
        if all(params.get(key) is not None for key in ("remote_engine_id", "remote_host", "remote_port")):
            self.pending.loads.append(KVLoad(str(params.get("remote_request_id")), [], 0,
                                             seq.request.request_id, params))
        seq.request.kv_transfer_params = None

    def update_connector_output(self, output: KVTransferOutput, kv):
        for request_id in output.finished_sending:
            self._end_lease(request_id, kv)
        for request_id in (*output.finished_recving, *output.failed_recving):
            self.reading.discard(request_id)
            if request_id in self.read_leases:
                kv.free(self.read_leases.pop(request_id))
        self._expire_leases(kv)

    def _end_lease(self, request_id: str, kv):
        leases = self.leases.get(request_id)
        if leases:
            kv.free(leases.pop(0))
        if not leases:
            self.leases.pop(request_id, None)

    def _expire_leases(self, kv):
        now = time.monotonic()
        for request_id in [r for r, leases in self.leases.items() if leases[0].expires <= now]:
            logger.warning("kv_transfer: no decode engine read request %s's KV within %g s; its blocks are freed",
                           request_id, self.lease_timeout)
            self._end_lease(request_id, kv)

    @property
    def num_leases(self) -> int:
        return sum(map(len, self.leases.values())) + len(self.read_leases)

    # worker side
    def register_kv_caches(self, cache, block_size: int):
        from pagedmoe.kv_transfer.nixl_worker import NixlWorker
        self.worker = NixlWorker(self.config.engine_id, cache, self.backends, self.handshake_timeout)

    def get_handshake_metadata(self) -> dict:
        return self.worker.handshake_metadata()

    def start_load_kv(self, load: KVLoad, cache, block_size: int):
        self.worker.start_read(load)

    def get_finished(self) -> KVTransferOutput:
        return self.worker.get_finished()

    def shutdown(self):
        if self.side_channel is not None:
            self.side_channel.close()
        if self.worker is not None:
            self.worker.shutdown()


CONNECTORS["NixlConnector"] = NixlConnector
