"""vLLM KV-cache event batches off the wire, in both of vLLM's msgpack encodings.

A ZMQ message is `(topic, seq, payload)`: `seq` an 8-byte big-endian counter, `payload` a msgpack
`EventBatch{ts, events, data_parallel_rank}`.  Older vLLM (msgspec `array_like=True`) sends the
batch and each event as positional arrays whose first element is the event type; current vLLM
sends maps with a `"type"` key.  Both decode to the same plain values here; unknown event types
are skipped (newer vLLM may add some), malformed payloads raise `KvDecodeError`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvDecodeError",
    "KvEvent",
    "KvEventBatch",
    "decode_batch",
    "decode_seq",
]

EngineHash = Hashable  # int by default; bytes with vLLM's sha256 block hashing


class KvDecodeError(ValueError):
    """A payload that is not a vLLM EventBatch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly cached by the engine; `token_ids` are all their tokens, concatenated."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine reset its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """The events of one engine step."""

    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


# Positional field order of the array encoding (vllm/distributed/kv_events.py), after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name")  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium")


def _hash(value: Any) -> EngineHash:
    if isinstance(value, list):  # msgpack arrays decode as lists; a hash must be hashable
        return tuple(value)
    if not isinstance(value, int | bytes | str | tuple):
        raise KvDecodeError(f"bad block hash {value!r}")
    return value


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise KvDecodeError(f"block_hashes must be an array, got {type(value).__name__}")
    return tuple(_hash(v) for v in value)


def _fields(raw: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, Mapping):
        kind = raw.get("type")
        return (kind if isinstance(kind, str) else ""), dict(raw)
    if isinstance(raw, Sequence) and not isinstance(raw, str | bytes) and raw:
        kind = raw[0]
        return (kind if isinstance(kind, str) else ""), dict(zip(names, raw[1:], strict=False))
    raise KvDecodeError(f"an event must be an array or a map, got {type(raw).__name__}")


def _event(raw: Any) -> KvEvent | None:
    kind, _ = _fields(raw, ())
    if kind == "BlockStored":
        _, f = _fields(raw, _STORED_FIELDS)
        tokens = f.get("token_ids")
        size = f.get("block_size")
        if not isinstance(tokens, Sequence) or not isinstance(size, int) or size <= 0:
            raise KvDecodeError("BlockStored needs token_ids and a positive block_size")
        parent = f.get("parent_block_hash")
        lora = f.get("lora_name")
        medium = f.get("medium")
        return BlockStored(
            block_hashes=_hashes(f.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash(parent),
            token_ids=tuple(int(t) for t in tokens),
            block_size=size,
            lora_name=lora if isinstance(lora, str) else None,
            medium=medium if isinstance(medium, str) else None,
        )
    if kind == "BlockRemoved":
        _, f = _fields(raw, _REMOVED_FIELDS)
        medium = f.get("medium")
        return BlockRemoved(
            _hashes(f.get("block_hashes")), medium if isinstance(medium, str) else None
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event type this router does not know: skip it


def decode_batch(payload: bytes) -> KvEventBatch:
    """Decode one msgpack EventBatch (array or map encoding)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise KvDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, Mapping):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, Sequence) and not isinstance(raw, str | bytes) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvDecodeError("an EventBatch must be an array or a map")
    if not isinstance(events, Sequence) or isinstance(events, str | bytes):
        raise KvDecodeError("EventBatch.events must be an array")
    decoded = tuple(e for e in (_event(r) for r in events) if e is not None)
    return KvEventBatch(
        ts=float(ts) if isinstance(ts, int | float) else 0.0,
        events=decoded,
        data_parallel_rank=rank if isinstance(rank, int) else None,
    )


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number of a message (-1 ends a replay)."""
    if len(frame) != 8:
        raise KvDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
