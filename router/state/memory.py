"""The in-process backend (the default): shared state kept in this process, no Redis.

A lone gateway gets a private ``MemoryStore``.  Gateways in one process (tests, the offline
simulator) may share one store: they then exchange index and registry changes exactly as Redis
instances do, through a background flusher, with the same bounded, non-blocking request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter, deque
from dataclasses import dataclass

from router.state.base import StateBackend, StateSink
from router.state.pending import PendingBatch
from router.state.records import (
    EvictionRecord,
    HotPrefix,
    IndexChange,
    RegistryChange,
    RegistryKind,
    ReplicaCounters,
)
from router.state.snapshot import SnapshotBuilder
from router.tasks import stop_task

__all__ = ["MemoryBackend", "MemorySettings", "MemoryStore"]


@dataclass(frozen=True, slots=True)
class MemorySettings:
    max_pending_changes: int = 100_000
    max_batch_changes: int = 1_024
    max_hot_prefixes: int = 1_000  # kept in the store; also bounds the pending hot set
    max_evictions: int = 10_000  # recent-evictions records kept
    flush_interval_s: float = 0.05  # counters are written at least this often


class MemoryStore:
    """State shared by the MemoryBackends attached to it (one per gateway in this process)."""

    def __init__(self, settings: MemorySettings | None = None) -> None:
        self.settings = settings or MemorySettings()
        self.counters: dict[str, Counter[str]] = {}
        self.evictions: deque[EvictionRecord] = deque(maxlen=self.settings.max_evictions)
        self.hot: dict[str, Counter[str]] = {}
        self.registry: dict[str, RegistryChange] = {}
        self.members: list[MemoryBackend] = []

    def write(self, batch: PendingBatch, origin: MemoryBackend) -> None:
        for (replica_id, name), value in batch.counters.items():
            self.counters.setdefault(replica_id, Counter())[name] += value
        self.evictions.extend(batch.evictions)
        for (model, prefix_id), hits in batch.hot.items():
            ranked = self.hot.setdefault(model, Counter())
            ranked[prefix_id] += hits
            if len(ranked) > 2 * self.settings.max_hot_prefixes:  # trim like ZREMRANGEBYRANK
                self.hot[model] = Counter(dict(ranked.most_common(self.settings.max_hot_prefixes)))
        for change in batch.changes:
            if isinstance(change, RegistryChange):
                if change.kind is RegistryKind.ADD:
                    self.registry[change.replica_id] = change
                else:
                    self.registry.pop(change.replica_id, None)
        for member in self.members:
            if member is not origin:
                member.deliver(batch.changes, origin.instance_id)

    @property
    def leader(self) -> MemoryBackend | None:
        return self.members[0] if self.members else None


class MemoryBackend(StateBackend):
    """In-process shared state; see the module docstring."""

    kind = "memory"

    def __init__(
        self,
        store: MemoryStore | None = None,
        *,
        instance_id: str | None = None,
    ) -> None:
        self.store = store or MemoryStore()
        s = self.store.settings
        super().__init__(
            instance_id or uuid.uuid4().hex[:12],
            max_pending_changes=s.max_pending_changes,
            max_hot_prefixes=s.max_hot_prefixes,
            max_pending_evictions=s.max_evictions,
        )
        self._sink: StateSink | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, sink: StateSink) -> None:
        self._sink = sink
        leader = self.store.leader
        if leader is not None and leader._sink is not None:
            # warm up like a Redis instance would: the leader's index, then the registry
            builder = SnapshotBuilder()
            for model, replica_id, path in leader._sink.snapshot_holdings():
                builder.add(model, replica_id, path)
            snap = builder.build("0-0", leader.instance_id)
            for change in snap.changes():
                sink.apply_index_change(change)
                self.stats.applied_changes += 1
            self.stats.snapshots_loaded += 1
        for entry in list(self.store.registry.values()):
            sink.apply_registry_change(entry)
        self.store.members.append(self)
        self._refresh_leadership()
        self._task = asyncio.create_task(self._flush_loop(), name=f"state-flush-{self.instance_id}")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None
        await self.flush()
        if self in self.store.members:
            self.store.members.remove(self)
        for member in self.store.members:
            member._refresh_leadership()
        self.stats.is_leader = False

    async def flush(self) -> None:
        while self._pending.has_work():
            self._write(self._pending.drain(self.store.settings.max_batch_changes))

    def deliver(self, changes: list[IndexChange | RegistryChange], origin: str) -> None:
        """Apply another member's changes (called from that member's flusher)."""
        if self._sink is None:
            return
        for change in changes:
            if isinstance(change, IndexChange):
                self._sink.apply_index_change(change)
            else:
                self._sink.apply_registry_change(change)
            self.stats.applied_changes += 1

    def _refresh_leadership(self) -> None:
        self.stats.is_leader = self.store.leader is self

    def _wake_flusher(self) -> None:
        # Changes go out at once only when another instance shares this store (a single one
        # has nobody to tell: its counters are written every flush interval anyway), so a
        # lone gateway does not wake its flusher on every routed request.
        if len(self.store.members) > 1:
            self._wake.set()

    def _write(self, batch: PendingBatch) -> None:
        if batch.is_empty():
            return
        stamped = [_stamp(c, self.instance_id) for c in batch.changes]
        batch.changes = stamped
        self.store.write(batch, self)
        self.stats.published_changes += len(stamped)

    async def _flush_loop(self) -> None:
        while True:
            interval = self.store.settings.flush_interval_s
            if len(self.store.members) < 2:
                # Alone: nobody reads the store between flushes but this instance, whose reads
                # flush first; writing now and then only bounds what piles up.
                interval *= 20
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def read_counters(self) -> dict[str, ReplicaCounters]:
        await self.flush()
        return {
            rid: ReplicaCounters.from_mapping(dict(values))
            for rid, values in self.store.counters.items()
        }

    async def read_evictions(self, limit: int = 100) -> list[EvictionRecord]:
        await self.flush()
        return list(reversed(self.store.evictions))[:limit]

    async def read_hot_prefixes(self, model: str, limit: int = 20) -> list[HotPrefix]:
        await self.flush()
        ranked = self.store.hot.get(model, Counter())
        return [HotPrefix(model, pid, hits) for pid, hits in ranked.most_common(limit)]

    async def read_registry(self) -> dict[str, RegistryChange]:
        await self.flush()
        return dict(self.store.registry)


def _stamp(change: IndexChange | RegistryChange, origin: str) -> IndexChange | RegistryChange:
    if change.origin == origin:
        return change
    if isinstance(change, IndexChange):
        return IndexChange(
            change.kind, change.model, change.block_hashes, change.replica_id, origin
        )
    return RegistryChange(change.kind, change.replica_id, change.url, change.models, origin)
