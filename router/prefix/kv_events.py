"""Exact mode's consumer: subscribe to replicas' KV-cache events over ZMQ and apply them.

One `KvEventConsumer` (an async context manager: enter it in an aiohttp cleanup context) owns
one task per replica.  Each task reads vLLM's multipart messages `(topic, seq, payload)` from a
SUB socket, decodes them (router.prefix.kv_decode, both encodings) and applies them through an
`ExactIndexer`.  Sequence numbers are checked: a jump forward is a gap (counted; when the
replica has a replay endpoint, the missing batches are fetched from it first, vLLM's protocol:
DEALER sends `(b"", start_seq)`, receives `(b"", seq, payload)` until seq = -1); a jump back means
the engine restarted, so what the index believed of that replica is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import zmq
import zmq.asyncio

from router.prefix.exact import ExactIndexer
from router.prefix.kv_decode import KvDecodeError, decode_batch, decode_seq
from router.prefix.kv_spec import KvEventSource

__all__ = ["KvEventConsumer", "KvEventSource", "KvEventStats"]

log = logging.getLogger(__name__)

# (replica_id, event type, count) and (replica_id, missed batches)
EventHook = Callable[[str, str, int], None]
GapHook = Callable[[str, int], None]
# "Everything the replay endpoint still has" (sequence numbers are signed 64-bit on the wire).
_UNBOUNDED_SEQ = 2**63 - 1


@dataclass(slots=True)
class KvEventStats:
    """What the consumer saw from one replica."""

    batches: int = 0
    last_seq: int | None = None
    gaps: int = 0  # jumps forward in the sequence
    missed_batches: int = 0  # batches in those jumps
    replayed_batches: int = 0  # of which recovered from the replay endpoint
    caught_up_batches: int = 0  # replayed on joining: published before this consumer subscribed
    restarts: int = 0
    malformed: int = 0


class KvEventConsumer:
    """Owns the ZMQ context and one subscriber task per replica."""

    def __init__(
        self,
        indexer: ExactIndexer,
        *,
        on_events: EventHook | None = None,
        on_gap: GapHook | None = None,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.indexer = indexer
        self._on_events = on_events
        self._on_gap = on_gap
        self._replay_timeout_s = replay_timeout_s
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Cancelled subscriber tasks not awaited yet (`discard` is synchronous): awaited on exit.
        self._stopping: set[asyncio.Task[None]] = set()
        self._sources: dict[str, KvEventSource] = {}
        self.stats: dict[str, KvEventStats] = {}
        self._progress = asyncio.Condition()

    async def __aenter__(self) -> KvEventConsumer:
        self._ctx = zmq.asyncio.Context()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for replica_id in list(self._tasks):
            self.discard(replica_id)
        await self._reap()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @property
    def sources(self) -> tuple[KvEventSource, ...]:
        return tuple(self._sources.values())

    def add(self, source: KvEventSource) -> None:
        """Start consuming `source` (replaces a previous subscription of the same replica)."""
        if self._ctx is None:
            raise RuntimeError("KvEventConsumer used outside `async with`")
        old = self._tasks.pop(source.replica_id, None)
        if old is not None:
            old.cancel()
            self._stopping.add(old)
        self._sources[source.replica_id] = source
        self.stats.setdefault(source.replica_id, KvEventStats())
        self.indexer.add_replica(source.replica_id, source.model)
        self._tasks[source.replica_id] = asyncio.get_running_loop().create_task(
            self._run(source), name=f"kv-events-{source.replica_id}"
        )

    async def remove(self, replica_id: str) -> None:
        """Stop consuming `replica_id` and forget what its events told the index."""
        self.discard(replica_id)
        await self._reap()

    def discard(self, replica_id: str) -> None:
        """`remove` without waiting: no batch of `replica_id` is applied after this returns
        (its task is cancelled at its current await and awaited by `remove` or on exit)."""
        task = self._tasks.pop(replica_id, None)
        self._sources.pop(replica_id, None)
        self.stats.pop(replica_id, None)
        if task is not None:
            task.cancel()
            self._stopping.add(task)
        self.indexer.remove_replica(replica_id)

    # Fleet observer (router.fleet.FleetObserver): a replica removed from the fleet (admin API,
    # another instance through shared state) is no longer consumed.
    def replica_removed(self, replica_id: str) -> None:
        self.discard(replica_id)

    def replica_stats_changed(self, replica: object, previous: object) -> None:
        """Scraped stats say nothing about KV events."""

    async def _reap(self) -> None:
        while self._stopping:
            task = self._stopping.pop()
            # A task that died of an error has logged it already (see `_run`).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def wait_for_seq(self, replica_id: str, seq: int, timeout_s: float) -> bool:
        """Wait until the batch numbered `seq` of `replica_id` has been applied (tests, admin)."""

        def reached() -> bool:
            last = self.stats.get(replica_id, KvEventStats()).last_seq
            return last is not None and last >= seq

        async with self._progress:
            try:
                await asyncio.wait_for(self._progress.wait_for(reached), timeout_s)
            except TimeoutError:
                return False
        return True

    # ------------------------------------------------------------------ internals

    async def _run(self, source: KvEventSource) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.connect(source.endpoint)
        stats = self.stats[source.replica_id]
        # A SUB socket misses whatever is published before it has joined (ZMQ's slow joiner),
        # and a quiet replica may publish nothing more for a long time: catch up from the replay
        # endpoint at once instead of waiting for the next batch to reveal the gap.  Batches the
        # SUB socket queued meanwhile and the replay already applied are then skipped.
        caught_up_to: int | None = None
        if source.replay_endpoint is not None:
            stats.caught_up_batches += await self._replay(source, stats, 0, _UNBOUNDED_SEQ)
            caught_up_to = stats.last_seq
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    stats.malformed += 1
                    continue
                try:
                    seq = decode_seq(frames[1])
                except KvDecodeError:
                    stats.malformed += 1
                    continue
                if caught_up_to is not None:
                    if seq <= caught_up_to:
                        continue
                    caught_up_to = None
                await self._sequence(source, stats, seq)
                self._apply(source, stats, seq, frames[2])
                await self._notify()
        except asyncio.CancelledError:
            raise
        except Exception:  # never die silently: log, the task ends, metrics show no progress
            log.exception("KV event consumer for %s stopped", source.replica_id)
            raise
        finally:
            sub.close(linger=0)

    async def _sequence(self, source: KvEventSource, stats: KvEventStats, seq: int) -> None:
        """Check `seq` against what came before; fetch missed batches when possible."""
        expected = None if stats.last_seq is None else stats.last_seq + 1
        if expected is None:
            # Joined after the replica started: what it stored before is unknown unless replayed.
            if seq > 0 and source.replay_endpoint is not None:
                stats.caught_up_batches += await self._replay(source, stats, 0, seq)
            return
        if seq == expected:
            return
        if seq < expected:
            # The engine restarted (sequence numbers start again at 0): its cache is empty.
            stats.restarts += 1
            stats.last_seq = None
            self.indexer.reset_replica(source.replica_id)
            return
        missed = seq - expected
        stats.gaps += 1
        stats.missed_batches += missed
        if self._on_gap is not None:
            self._on_gap(source.replica_id, missed)
        if source.replay_endpoint is not None:
            stats.replayed_batches += await self._replay(source, stats, expected, seq)

    async def _replay(
        self, source: KvEventSource, stats: KvEventStats, start: int, end: int
    ) -> int:
        """Apply batches [start, end) from the replica's replay endpoint, as far as it has them.

        Returns how many were applied."""
        assert self._ctx is not None and source.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(source.replay_endpoint)
        applied = 0
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self._replay_timeout_s)
                if len(frames) != 3:
                    stats.malformed += 1
                    continue
                seq = decode_seq(frames[1])
                if seq < 0:
                    return applied
                if start <= seq < end and (stats.last_seq is None or seq > stats.last_seq):
                    self._apply(source, stats, seq, frames[2])
                    applied += 1
        except (TimeoutError, KvDecodeError) as exc:
            log.warning("KV event replay from %s failed: %r", source.replay_endpoint, exc)
        finally:
            dealer.close(linger=0)
        return applied

    def _apply(self, source: KvEventSource, stats: KvEventStats, seq: int, payload: bytes) -> None:
        stats.last_seq = seq
        stats.batches += 1
        try:
            batch = decode_batch(payload)
            applied: Counter[str] = self.indexer.apply(source.replica_id, batch)
        except (KvDecodeError, ValueError, TypeError) as exc:
            stats.malformed += 1
            log.warning("bad KV event batch %d from %s: %r", seq, source.replica_id, exc)
            return
        if self._on_events is not None:
            for kind, count in applied.items():
                self._on_events(source.replica_id, kind, count)

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    def describe(self) -> dict[str, Any]:
        """Per-replica consumer statistics (for the admin API)."""
        return {
            rid: {
                "batches": s.batches,
                "last_seq": s.last_seq,
                "gaps": s.gaps,
                "missed_batches": s.missed_batches,
                "replayed_batches": s.replayed_batches,
                "caught_up_batches": s.caught_up_batches,
                "restarts": s.restarts,
                "malformed": s.malformed,
            }
            for rid, s in self.stats.items()
        }
