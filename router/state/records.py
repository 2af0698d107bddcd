"""The change records instances exchange, and the per-replica counters they accumulate.

Records are plain frozen values.  The request path builds them and hands them to a backend
(which only enqueues); the backend stamps them with its instance id (``origin``) when it
publishes, and other instances apply them to their own prefix index and replica registry.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum

__all__ = [
    "ChangeKind",
    "EvictionRecord",
    "HotPrefix",
    "IndexChange",
    "RegistryChange",
    "RegistryKind",
    "ReplicaCounters",
]


class ChangeKind(IntEnum):
    """What happened to a replica's entries in the prefix index (ints: they go on the wire)."""

    INSERT = 1  # the replica is now believed to hold these blocks (speculative, after a decision)
    REFRESH = 2  # the replica used these blocks again (request completed): recency only
    EVICT = 3  # the replica no longer holds these blocks (LRU eviction mirroring its KV capacity)
    REMOVE_REPLICA = 4  # all of the replica's entries go (replica removed or its cache cleared)


@dataclass(frozen=True, slots=True)
class IndexChange:
    """One change to the prefix index of one model, for one replica.

    ``block_hashes`` is the chained-hash path from the root (INSERT, REFRESH) or the evicted
    blocks' path (EVICT); empty for REMOVE_REPLICA (then ``model`` may be empty too: all models).
    ``origin`` is the publishing instance's id; empty until a backend publishes the change.
    """

    kind: ChangeKind
    model: str
    block_hashes: tuple[int, ...]
    replica_id: str
    origin: str = ""


class RegistryKind(IntEnum):
    """Replica-registry changes made through the admin API (ints: they go on the wire)."""

    ADD = 11
    REMOVE = 12


@dataclass(frozen=True, slots=True)
class RegistryChange:
    """A replica added to or removed from the fleet by an operator on some instance."""

    kind: RegistryKind
    replica_id: str
    url: str = ""
    models: tuple[str, ...] = ()
    origin: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """Per-replica counters kept in shared state (all integers, all only ever incremented).

    Token counts are model tokens.  ``observed_*`` come from the replica's own
    vllm:prefix_cache_hits / vllm:prefix_cache_queries (scraper deltas); ``evicted_blocks``
    counts index blocks evicted for this replica by the instance that decided the insert.
    """

    requests: int = 0
    prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    observed_hit_tokens: int = 0
    observed_query_tokens: int = 0
    evicted_blocks: int = 0

    def __add__(self, other: ReplicaCounters) -> ReplicaCounters:
        return ReplicaCounters(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(ReplicaCounters))
        )

    def as_dict(self) -> dict[str, int]:
        """Field name → value, for a Redis hash or a JSON body."""
        return {f.name: int(getattr(self, f.name)) for f in fields(ReplicaCounters)}

    @classmethod
    def from_mapping(cls, values: dict[str, int]) -> ReplicaCounters:
        """Build from a (possibly partial) mapping; unknown fields are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in values.items() if k in known})


@dataclass(frozen=True, slots=True)
class EvictionRecord:
    """One entry of the capped stream of recent evictions."""

    replica_id: str
    model: str
    blocks: int
    origin: str
    ts_ms: int


@dataclass(frozen=True, slots=True)
class HotPrefix:
    """A prefix ranked by how many routed requests hit it.

    ``prefix_id`` is ``"<blocks>:<hex of the chained hash of its last block>"``: the chained
    hash identifies the whole prefix, the block count says how long it is.
    """

    model: str
    prefix_id: str
    hits: int
