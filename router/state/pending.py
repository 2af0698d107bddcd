"""Updates waiting to be written to shared state: the only thing the request path touches.

Everything here is synchronous and O(1) per call: appending to a bounded queue or bumping an
in-memory counter.  A backend's background flusher drains it.  Changes beyond the bound are
dropped and counted; counters are never dropped (one entry per replica and field).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.state.records import ChangeKind, EvictionRecord, IndexChange, RegistryChange

__all__ = ["PendingBatch", "PendingUpdates"]

Change = IndexChange | RegistryChange


@dataclass(slots=True)
class PendingBatch:
    """One drained batch, written to shared state in one round trip."""

    changes: list[Change] = field(default_factory=list)
    # (replica id, ReplicaCounters field name) → increment
    counters: Counter[tuple[str, str]] = field(default_factory=Counter)
    # (model, prefix id) → hits
    hot: Counter[tuple[str, str]] = field(default_factory=Counter)
    evictions: list[EvictionRecord] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.changes or self.counters or self.hot or self.evictions)


class PendingUpdates:
    """Bounded buffers between the request path and a backend's flusher."""

    def __init__(
        self,
        *,
        max_changes: int,
        max_hot_prefixes: int,
        max_evictions: int,
        on_ready: Callable[[], None],
    ) -> None:
        self._changes: deque[Change] = deque()
        self._counters: Counter[tuple[str, str]] = Counter()
        self._hot: Counter[tuple[str, str]] = Counter()
        self._evictions: deque[EvictionRecord] = deque()
        self._max_changes = max_changes
        self._max_hot = max_hot_prefixes
        self._max_evictions = max_evictions
        self._on_ready = on_ready
        self.dropped = 0  # updates thrown away because a buffer was full
        self.enqueued_changes = 0

    def __len__(self) -> int:
        return len(self._changes)

    def add_change(self, change: Change, origin: str) -> None:
        """Queue a change for publishing; an EVICT also becomes a counter and an eviction record."""
        if len(self._changes) >= self._max_changes:
            self.dropped += 1
            return
        self._changes.append(change)
        self.enqueued_changes += 1
        if isinstance(change, IndexChange) and change.kind is ChangeKind.EVICT:
            self.add_eviction(change.replica_id, change.model, len(change.block_hashes), origin)
        self._on_ready()

    def add_eviction(self, replica_id: str, model: str, blocks: int, origin: str) -> None:
        """Count evicted blocks and keep a record for the recent-evictions stream."""
        if blocks <= 0:
            return
        self._counters[(replica_id, "evicted_blocks")] += blocks
        if len(self._evictions) >= self._max_evictions:
            self.dropped += 1
            return
        self._evictions.append(
            EvictionRecord(replica_id, model, blocks, origin, int(time.time() * 1000))
        )

    def add_counter(self, replica_id: str, name: str, value: int) -> None:
        if value:
            self._counters[(replica_id, name)] += value

    def add_hot(self, model: str, prefix_id: str, hits: int = 1) -> None:
        key = (model, prefix_id)
        if key not in self._hot and len(self._hot) >= self._max_hot:
            self.dropped += 1
            return
        self._hot[key] += hits

    def drain(self, max_changes: int) -> PendingBatch:
        """Take up to ``max_changes`` changes and everything else accumulated so far."""
        n = min(max_changes, len(self._changes))
        batch = PendingBatch(
            changes=[self._changes.popleft() for _ in range(n)],
            counters=self._counters,
            hot=self._hot,
            evictions=list(self._evictions),
        )
        self._counters = Counter()
        self._hot = Counter()
        self._evictions.clear()
        return batch

    def has_work(self) -> bool:
        return bool(self._changes or self._counters or self._hot or self._evictions)
