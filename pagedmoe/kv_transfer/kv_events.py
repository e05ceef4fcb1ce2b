"""KV cache events in vLLM's wire format (vllm/distributed/kv_events.py as vLLM 0.32 encodes it with msgspec),
so KV-aware routers (vllm-router's kv_aware policy, llm-d, Dynamo) score pagedmoe replicas as they score vLLM
ones. A batch is msgpack of the array [ts, events, data_parallel_rank]; each event a map tagged by "type":
{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
"lora_name"}, {"type": "BlockRemoved", "block_hashes", "medium"}, {"type": "AllBlocksCleared"}. Block hashes
are pagedmoe's 32-byte chained sha256 digests (routers rehash the token ids). medium as vLLM names the tiers:
"GPU" for the engine's main pool (whatever the device), "CPU" for the host tier, "STORAGE" for the disk tier."""
import json
from dataclasses import dataclass, field

import msgpack

MAIN, HOST, DISK = "GPU", "CPU", "STORAGE"


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MAIN
    lora_name: str | None = None

    def as_wire(self) -> dict:
        return {"type": "BlockStored", "block_hashes": self.block_hashes, "parent_block_hash": self.parent_block_hash,
                "token_ids": self.token_ids, "block_size": self.block_size, "lora_id": self.lora_id,
                "medium": self.medium, "lora_name": self.lora_name}


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = MAIN

    def as_wire(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass
class AllBlocksCleared:
    def as_wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list, data_parallel_rank: int = 0) -> bytes:
    return msgpack.packb([ts, [event.as_wire() for event in events], data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list]:
    ts, events, *_ = msgpack.unpackb(payload, raw=False)
    return ts, [_from_wire(event) for event in events]


def _from_wire(event: dict):
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
    fields = {k: v for k, v in event.items() if k != "type"}
    kind = kinds[event["type"]]
    return kind(**{k: v for k, v in fields.items() if k in kind.__dataclass_fields__})


@dataclass
class KVEventsConfig:
    """vLLM's --kv-events-config."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    extra: dict = field(default_factory=dict)


def parse_kv_events_config(value) -> KVEventsConfig | None:
    """A KVEventsConfig, a dict or its JSON text; None when events are off."""
    if value is None or isinstance(value, KVEventsConfig):
        return value if value is None or value.enable_kv_cache_events else None
    try:
        raw = json.loads(value) if isinstance(value, str) else dict(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"kv_events_config must be a JSON object, got {value!r}: {error}") from None
    known = set(KVEventsConfig.__dataclass_fields__) - {"extra"}
    config = KVEventsConfig(**{k: v for k, v in raw.items() if k in known},
                            extra={k: v for k, v in raw.items() if k not in known})
    if config.publisher not in ("zmq", "null"):
        raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {config.publisher!r}")
    return config if config.enable_kv_cache_events else None


class KVEventRecorder:
    """Collects a KV manager's events between two publishes. The manager describes each full block (its
    parent hash and tokens) as it caches it; a pool reports by hash when a block enters or leaves a tier."""

    def __init__(self, block_size: int, max_described: int):
        self.block_size, self.max_described = block_size, max_described
        self.events: list = []
        self.described: dict[bytes, tuple[bytes | None, list[int]]] = {}

    def describe(self, block_hash: bytes, parent: bytes | None, token_ids: list[int]):
        self.described.pop(block_hash, None)
        self.described[block_hash] = (parent, token_ids)
        while len(self.described) > self.max_described:  # oldest first (dicts keep insertion order)
            del self.described[next(iter(self.described))]

    def stored(self, block_hash: bytes, medium: str):
        if block_hash in self.described:  # internal hashes (sliding-window copies) are never described
            parent, token_ids = self.described[block_hash]
            self.events.append(BlockStored([block_hash], parent, token_ids, self.block_size, None, medium))

    def removed(self, block_hash: bytes, medium: str):
        if block_hash in self.described:
            self.events.append(BlockRemoved([block_hash], medium))

    def cleared(self):
        self.events.append(AllBlocksCleared())

    def take(self) -> list:
        events, self.events = self.events, []
        return events
