"""KV connectors in the shape of vLLM's v1 interface, for prefill/decode disaggregation. A prefill instance
(kv_producer) saves a finished request's prompt KV and answers with kv_transfer_params; a decode instance
(kv_consumer) given those params loads the KV into blocks it allocates, so it computes only the last prompt
token. Scheduler side: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta,
request_finished, before_free, update_connector_output. Worker side: register_kv_caches, start_load_kv, save_kv,
get_finished. A connector whose loads are async (load_kv_async) leaves its requests waiting for remote KV
until get_finished reports their reads."""
import json
import uuid
from dataclasses import dataclass, field

ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """vLLM's --kv-transfer-config."""
    kv_connector: str
    kv_role: str = "kv_both"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(value) -> KVTransferConfig | None:
    if value is None or isinstance(value, KVTransferConfig):
        return value
    try:
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        config = KVTransferConfig(**raw)
    except (ValueError, TypeError) as error:
        raise ValueError(f"kv_transfer_config must be a JSON object of vLLM's fields: {error}") from None
    if config.kv_role not in ROLES:
        raise ValueError(f"kv_transfer_config.kv_role must be one of {ROLES}, got {config.kv_role!r}")
    if config.kv_connector not in CONNECTORS:
        raise ValueError(f"kv_transfer_config.kv_connector must be one of {sorted(CONNECTORS)}, "
                         f"got {config.kv_connector!r}")
    return config


@dataclass
class KVLoad:
    key: str
    block_ids: list[int]
    num_tokens: int
    request_id: str = ""
    remote: dict | None = None  # the kv_transfer_params naming the peer (network connectors)


@dataclass
class ConnectorMetadata:
    """What the worker does for the connector before the step's forward."""
    loads: list[KVLoad] = field(default_factory=list)


@dataclass
class KVTransferOutput:
    """vLLM's KVConnectorOutput: what the worker side finished since its last poll, by request id."""
    finished_sending: list[str] = field(default_factory=list)  # a peer has read these (their leases end)
    finished_recving: set[str] = field(default_factory=set)  # reads done: their requests compute on
    failed_recving: dict[str, Exception] = field(default_factory=dict)  # reads that failed, with the error


class KVConnector:
    """The scheduler side keeps which waiting requests load remote KV; the worker side moves the bytes."""
    load_kv_async = False  # True: start_load_kv only starts a read, which get_finished reports later

    def __init__(self, config: KVTransferConfig):
        self.config, self.pending = config, ConnectorMetadata()

    def wants_remote_prefill(self, params: dict | None) -> bool:
        return self.config.is_consumer and bool(params) and bool(params.get("do_remote_prefill"))

    def get_num_new_matched_tokens(self, seq) -> int:
        """Prompt tokens whose KV can be loaded (all but the last, which is computed here), or 0."""
        return 0

    def update_state_after_alloc(self, seq, num_external_tokens: int):
        self.pending.loads.append(KVLoad(self.key_of(seq, num_external_tokens), list(seq.block_table),
                                         num_external_tokens, seq.request.request_id))

    def build_connector_meta(self) -> ConnectorMetadata:
        meta, self.pending = self.pending, ConnectorMetadata()
        return meta

    def request_finished(self, seq) -> tuple[dict | None, tuple | None]:
        """(kv_transfer_params for the response, the save the worker runs now) for a do_remote_decode request."""
        params = seq.request.kv_transfer_params
        if not (self.config.is_producer and params and params.get("do_remote_decode")):
            return None, None
        num_tokens = seq.num_prompt_tokens - 1
        save = KVLoad(self.key_of(seq, num_tokens), list(seq.block_table), num_tokens)
        return self.response_params(seq, save), save

    def response_params(self, seq, save: KVLoad) -> dict:
        """vLLM's NIXL-style params, which proxies copy into the decode request unchanged."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.config.engine_id,
                "remote_block_ids": save.block_ids, "remote_request_id": seq.request.request_id,
                "remote_host": None, "remote_port": None, "tp_size": 1}

    def key_of(self, seq, num_tokens: int) -> str:
        raise NotImplementedError

    def before_free(self, seq, kv):
        """The scheduler frees a finished (or aborted) sequence's blocks next; a connector that still needs
        them takes a lease on them here."""

    def update_connector_output(self, output: KVTransferOutput, kv):
        """The worker side's finished transfers; a connector ends the leases they release."""

    def set_xfer_handshake_metadata(self, metadata: dict | None):
        """The worker side's handshake metadata, which the scheduler side serves to peers."""

    def register_kv_caches(self, cache, block_size: int):
        """Worker side, once: the KV cache, [layers, kv_tensors, blocks, block_size, ...]."""

    def get_handshake_metadata(self) -> dict | None:
        return None

    def get_finished(self) -> KVTransferOutput:
        return KVTransferOutput()

    def shutdown(self):
        pass


CONNECTORS: dict[str, type] = {}


def make_connector(config: KVTransferConfig | None) -> KVConnector | None:
    return None if config is None else CONNECTORS[config.kv_connector](config)


from pagedmoe.kv_transfer import nixl_connector, shared_storage  # noqa: E402,F401  (register themselves)
