"""The state-backend interface: where shared fleet state lives.

A backend has two sides.

- The request path calls the synchronous ``publish_*`` / ``record_*`` methods.  They only
  enqueue (bounded; overflow is dropped and counted in ``stats.dropped_updates``) and never wait
  on I/O, so a slow or dead Redis cannot slow down or fail a request.
- Background tasks, started by ``start`` and cancelled by ``stop``, flush the queue and apply
  other instances' changes to a ``StateSink`` (the gateway's prefix index and replica registry).

``MemoryBackend`` (the default) keeps everything in this process; ``RedisBackend`` shares it
between router instances.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from router.state.pending import PendingUpdates
from router.state.records import (
    EvictionRecord,
    HotPrefix,
    IndexChange,
    RegistryChange,
    ReplicaCounters,
)
from router.state.schema import hot_prefix_id

__all__ = ["BackendStats", "StateBackend", "StateSink"]


class StateSink(Protocol):
    """What a backend applies other instances' changes to (implemented by the gateway)."""

    def apply_index_change(self, change: IndexChange) -> None:
        """Apply another instance's index change to the local index (must not re-publish it)."""

    def apply_registry_change(self, change: RegistryChange) -> None:
        """Apply another instance's admin add/remove to the local registry (must not re-publish)."""

    def snapshot_holdings(self) -> Iterable[tuple[str, str, tuple[int, ...]]]:
        """Every (model, replica, path) the local index holds, each replica's oldest first.

        Consumed lazily, a slice at a time between event-loop turns: it must tolerate the
        index changing meanwhile (the stream tail after the snapshot's id reconciles).
        """


@dataclass(slots=True)
class BackendStats:
    """Plain counters the metrics module reads at scrape time (no cost on the request path)."""

    up: bool = True
    published_changes: int = 0  # changes this instance wrote to shared state
    applied_changes: int = 0  # other instances' changes applied to the local sink
    failed_writes: int = 0
    failed_reads: int = 0
    duplicate_batches: int = 0  # retried writes Redis recognised as already applied
    bad_entries: int = 0  # stream entries or snapshots that could not be decoded (skipped)
    resyncs: int = 0  # full re-syncs from snapshot + stream tail
    snapshots_written: int = 0
    snapshots_loaded: int = 0
    is_leader: bool = False


class StateBackend(ABC):
    """Shared fleet state.  One object per router instance; no process-wide state."""

    kind: str = "abstract"

    def __init__(
        self,
        instance_id: str,
        *,
        max_pending_changes: int,
        max_hot_prefixes: int,
        max_pending_evictions: int,
    ) -> None:
        self.instance_id = instance_id
        self.stats = BackendStats()
        self._pending = PendingUpdates(
            max_changes=max_pending_changes,
            max_hot_prefixes=max_hot_prefixes,
            max_evictions=max_pending_evictions,
            on_ready=self._wake_flusher,
        )

    # -- request path: synchronous, never waits ------------------------------------------

    def publish_index(self, change: IndexChange) -> None:
        """Share a change this instance made to its own prefix index."""
        self._pending.add_change(change, self.instance_id)

    def publish_registry(self, change: RegistryChange) -> None:
        """Share an admin add/remove of a replica made on this instance."""
        self._pending.add_change(change, self.instance_id)

    def record_request(
        self, replica_id: str, *, prompt_tokens: int, predicted_hit_tokens: int
    ) -> None:
        """Count one routed request and what the router predicted it would hit."""
        add = self._pending.add_counter
        add(replica_id, "requests", 1)
        add(replica_id, "prompt_tokens", prompt_tokens)
        add(replica_id, "predicted_hit_tokens", predicted_hit_tokens)

    def record_eviction(self, replica_id: str, model: str, blocks: int) -> None:
        """Count blocks this instance's index evicted for a replica (capacity LRU), with a record.

        Only evictions caused by this instance's own decisions are recorded: each instance
        mirrors the others' inserts and evicts likewise, and must not count those twice.
        """
        self._pending.add_eviction(replica_id, model, blocks, self.instance_id)

    def record_observed(self, replica_id: str, *, hit_tokens: int, query_tokens: int) -> None:
        """Count the replica's own prefix-cache hits/queries deltas, as scraped.

        Every instance scrapes every replica, so only the leader's deltas are kept in shared
        state (otherwise N instances would count each hit N times).
        """
        if self.stats.is_leader:
            self._pending.add_counter(replica_id, "observed_hit_tokens", hit_tokens)
            self._pending.add_counter(replica_id, "observed_query_tokens", query_tokens)

    def record_prefix_hit(
        self, model: str, block_hashes: Sequence[int], matched_blocks: int
    ) -> None:
        """Count a routed request whose first ``matched_blocks`` blocks were predicted cached."""
        if matched_blocks > 0:
            self._pending.add_hot(model, hot_prefix_id(block_hashes, matched_blocks))

    @property
    def dropped_updates(self) -> int:
        return self._pending.dropped

    @property
    def pending_changes(self) -> int:
        return len(self._pending)

    # -- lifecycle and background work ----------------------------------------------------

    @abstractmethod
    async def start(self, sink: StateSink) -> None:
        """Warm up from shared state (bounded in time) and start the background tasks."""

    @abstractmethod
    async def stop(self) -> None:
        """Flush what can be flushed quickly, cancel and await the background tasks."""

    @abstractmethod
    async def flush(self) -> None:
        """Write everything queued so far (raises when the backend cannot)."""

    @abstractmethod
    def _wake_flusher(self) -> None:
        """Called on the request path when a change was queued: must be O(1)."""

    # -- reads (operators, admin endpoints, tests; never on the request path) --------------

    @abstractmethod
    async def read_counters(self) -> dict[str, ReplicaCounters]:
        """Per-replica counters summed over all instances."""

    @abstractmethod
    async def read_evictions(self, limit: int = 100) -> list[EvictionRecord]:
        """Most recent evictions, newest first."""

    @abstractmethod
    async def read_hot_prefixes(self, model: str, limit: int = 20) -> list[HotPrefix]:
        """Prefixes of ``model`` with the most hits, most first."""

    @abstractmethod
    async def read_registry(self) -> dict[str, RegistryChange]:
        """Replicas added through the admin API on any instance (and not removed since)."""
