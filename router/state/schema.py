"""Redis key names, all under one configurable prefix (documented in docs/redis.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_KEY_PREFIX", "KeySchema", "hot_prefix_id"]

DEFAULT_KEY_PREFIX = "fleet-router:"


def hot_prefix_id(block_hashes: Sequence[int], matched_blocks: int) -> str:
    """The member name of a matched prefix in the hot-prefix sorted set.

    The chained hash of the prefix's last block identifies the whole prefix (it depends on every
    block before it); the block count is kept in the name so an operator sees the length.
    """
    return f"{matched_blocks}:{block_hashes[matched_blocks - 1]:016x}"


@dataclass(frozen=True, slots=True)
class KeySchema:
    """Every key the Redis backend touches; one place, so docs/redis.md can mirror it."""

    prefix: str = DEFAULT_KEY_PREFIX

    @property
    def changes(self) -> str:
        """Stream of index and registry changes (capped with XADD MAXLEN ~)."""
        return f"{self.prefix}changes"

    @property
    def snapshot(self) -> str:
        """String with a TTL: the latest index snapshot (msgpack) and its change-stream id."""
        return f"{self.prefix}snapshot"

    @property
    def leader(self) -> str:
        """String with a TTL: the id of the instance holding the leader lease."""
        return f"{self.prefix}leader"

    @property
    def registry(self) -> str:
        """Hash: replica id → msgpack {url, models, by, ts_ms}: replicas added by admin."""
        return f"{self.prefix}registry"

    @property
    def counter_replicas(self) -> str:
        """Set: replica ids that have a counters hash."""
        return f"{self.prefix}counters:replicas"

    def counters(self, replica_id: str) -> str:
        """Hash: per-replica counters (HINCRBY), fields as in ReplicaCounters."""
        return f"{self.prefix}counters:{replica_id}"

    @property
    def evictions(self) -> str:
        """Stream of recent evictions (capped with XADD MAXLEN ~)."""
        return f"{self.prefix}evictions"

    @property
    def hot_models(self) -> str:
        """Set: models that have a hot-prefix sorted set."""
        return f"{self.prefix}hot:models"

    def hot(self, model: str) -> str:
        """Sorted set: prefix id → hits, capped by ZREMRANGEBYRANK."""
        return f"{self.prefix}hot:{model}"

    def instance(self, instance_id: str) -> str:
        """Hash with a TTL: one instance's heartbeat (position, leader, started)."""
        return f"{self.prefix}instance:{instance_id}"

    def writer_seq(self, instance_id: str) -> str:
        """String with a TTL: the sequence number of the last batch this writer applied."""
        return f"{self.prefix}seq:{instance_id}"

    @property
    def instance_pattern(self) -> str:
        """SCAN pattern over live instances' heartbeat keys."""
        return f"{self.prefix}instance:*"
