"""The Redis backend: router instances share index changes, the registry and counters.

Three background tasks per instance, all owned by ``start``/``stop``:

- flusher: drains the pending queue into one atomic, at-most-once Lua call per batch (change
  stream XADD MAXLEN ~, registry hash, per-replica counter hashes, hot-prefix sorted sets,
  recent-evictions stream);
- reader: XREAD BLOCK on the change stream from this instance's own position, applying other
  instances' changes (its own are skipped) to the sink; after any failure it re-syncs: it
  resumes from its position when the stream still holds it, else loads the snapshot and reads
  the tail from the snapshot's stream id;
- maintenance: heartbeat key with a TTL, the leader lease, and for the leader a periodic
  index snapshot; trims hot-prefix sets.

Every Redis call has a socket timeout and redis-py's Retry with jittered exponential backoff;
loops back off with the same backoff object.  Nothing here is awaited on the request path.
See docs/redis.md for the key schema.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError, ResponseError

from router.state.base import StateBackend, StateSink
from router.state.codec import CodecError, decode_batch, encode_batch
from router.state.pending import PendingBatch
from router.state.records import (
    EvictionRecord,
    HotPrefix,
    IndexChange,
    RegistryChange,
    RegistryKind,
    ReplicaCounters,
)
from router.state.redis_scripts import LEASE_ACQUIRE, LEASE_RELEASE, WRITE_BATCH
from router.state.schema import DEFAULT_KEY_PREFIX, KeySchema
from router.state.snapshot import IndexSnapshot, SnapshotBuilder

__all__ = ["RedisBackend", "RedisSettings", "StreamId"]

log = logging.getLogger(__name__)

# What a dead, restarting or slow Redis raises through redis-py (OSError: refused sockets
# that slip past redis-py's own wrapping).
_FAILURES = (RedisError, OSError, asyncio.TimeoutError)

StreamId = tuple[int, int]


async def _cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel and await tasks, cancelling again if one swallowed it.

    On Python 3.11 a cancellation that races an expiring ``asyncio.timeout`` inside redis-py
    becomes a TimeoutError, which redis-py's Retry then retries: the cancel is lost.  The loops
    also stop on ``_closing``, so a second cancel (or the next loop turn) always ends them.
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _done, pending = await asyncio.wait(pending, timeout=0.5)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("state backend task %s failed", task.get_name(), exc_info=task.exception())


def _parse_id(raw: bytes | str | None) -> StreamId:
    if raw is None:
        return (0, 0)
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return (int(ms), int(seq or 0))


def _format_id(sid: StreamId) -> str:
    return f"{sid[0]}-{sid[1]}"


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Tuning of the Redis backend (defaults suit a Redis on the same network)."""

    url: str
    key_prefix: str = DEFAULT_KEY_PREFIX
    command_timeout_s: float = 0.5  # socket timeout of every command
    connect_timeout_s: float = 0.5
    command_retries: int = 1  # redis-py Retry per command, on connection errors and timeouts
    backoff_base_s: float = 0.02
    backoff_cap_s: float = 1.0
    read_block_s: float = 0.2  # XREAD BLOCK; must stay below command_timeout_s
    read_count: int = 512  # stream entries per XREAD
    flush_interval_s: float = 0.05  # counters are flushed at least this often
    # After the first queued change, wait this long for more before writing: one script call
    # per burst instead of per change (less CPU per request on the gateway's event loop), at
    # the price of this much propagation delay.
    flush_linger_s: float = 0.005
    max_batch_changes: int = 256  # changes per stream entry / Lua call
    max_pending_changes: int = 100_000  # bound of the request-path queue
    stream_maxlen: int = 100_000  # change-stream entries kept (approximately)
    evictions_maxlen: int = 10_000  # recent-evictions entries kept (approximately)
    max_hot_prefixes: int = 1_000  # per model, after trimming
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 10.0
    lease_ttl_s: float = 5.0
    snapshot_interval_s: float = 30.0
    snapshot_ttl_s: float = 3_600.0
    seq_ttl_s: float = 86_400.0
    warmup_timeout_s: float = 30.0
    apply_yield_every: int = 256  # changes applied between yields to the event loop
    snapshot_yield_every: int = 256  # snapshot paths read between yields to the event loop

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"redis url must start with redis://, rediss:// or unix://: {self.url!r}"
            )
        if not self.key_prefix:
            raise ValueError("redis key prefix must not be empty")
        if self.read_block_s >= self.command_timeout_s:
            raise ValueError(
                "read_block_s must be below command_timeout_s (XREAD BLOCK would time out)"
            )
        if not 0 <= self.flush_linger_s < self.flush_interval_s:
            raise ValueError("flush_linger_s must be >= 0 and below flush_interval_s")
        if self.lease_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                "lease_ttl_s must exceed heartbeat_interval_s (the lease is renewed then)"
            )
        for name in (
            "flush_interval_s",
            "heartbeat_ttl_s",
            "snapshot_interval_s",
            "warmup_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in (
            "max_batch_changes",
            "max_pending_changes",
            "stream_maxlen",
            "read_count",
            "apply_yield_every",
            "snapshot_yield_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


class RedisBackend(StateBackend):
    """Shared state in Redis; see the module docstring."""

    kind = "redis"

    def __init__(self, settings: RedisSettings, *, instance_id: str | None = None) -> None:
        super().__init__(
            instance_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
            max_pending_changes=settings.max_pending_changes,
            max_hot_prefixes=settings.max_hot_prefixes,
            max_pending_evictions=settings.evictions_maxlen,
        )
        self.settings = settings
        self.keys = KeySchema(settings.key_prefix)
        self._backoff = ExponentialWithJitterBackoff(
            cap=settings.backoff_cap_s, base=settings.backoff_base_s
        )
        self._client: aioredis.Redis | None = None
        self._sink: StateSink | None = None
        self._position: StreamId | None = None  # last change-stream id seen
        self._needs_sync = True
        self._snapshot_due = False
        self._last_snapshot = 0.0
        self._seq = 0
        self._inflight: tuple[int, PendingBatch] | None = None
        self._write_lock = asyncio.Lock()
        self._hot_models: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._started_ms = int(time.time() * 1000)
        self.last_error: str = ""

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, sink: StateSink) -> None:
        """Connect, warm up (snapshot + tail; bounded by warmup_timeout_s), start the tasks.

        When Redis is unreachable the instance starts anyway with local state only; the reader
        keeps trying and syncs once Redis answers.
        """
        s = self.settings
        self._sink = sink
        self._last_snapshot = time.monotonic()  # the first one after an interval (or a gap)
        self._client = aioredis.Redis.from_url(
            s.url,
            socket_timeout=s.command_timeout_s,
            socket_connect_timeout=s.connect_timeout_s,
            retry=Retry(self._backoff, s.command_retries),
            client_name=f"fleet-router:{self.instance_id}",
        )
        self._write_script = self._client.register_script(WRITE_BATCH)
        self._lease_script = self._client.register_script(LEASE_ACQUIRE)
        self._release_script = self._client.register_script(LEASE_RELEASE)
        try:
            async with asyncio.timeout(s.warmup_timeout_s):
                await self._sync()
                await self._catch_up()
            self._needs_sync = False
            self._mark_up()
            await self._maintain()
        except _FAILURES as exc:
            self._mark_down("warm-up", exc)
        name = self.instance_id
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"state-read-{name}"),
            asyncio.create_task(self._flush_loop(), name=f"state-flush-{name}"),
            asyncio.create_task(self._maintenance_loop(), name=f"state-maint-{name}"),
        ]

    async def stop(self) -> None:
        """Cancel the tasks, flush once (briefly), give up the lease, drop the heartbeat."""
        self._closing = True
        await _cancel_and_wait(self._tasks)
        self._tasks = []
        if self._client is None:
            return
        try:
            async with asyncio.timeout(self.settings.command_timeout_s * 2):
                await self.flush()
                await self._release_script(keys=[self.keys.leader], args=[self.instance_id])
                await self._client.delete(self.keys.instance(self.instance_id))
        except _FAILURES as exc:
            unsent = len(self._pending) + (len(self._inflight[1].changes) if self._inflight else 0)
            log.warning(
                "state backend: final flush failed (%s); %d changes not shared", exc, unsent
            )
        self.stats.is_leader = False
        await self._client.aclose()
        self._client = None

    async def flush(self) -> None:
        """Write everything queued so far, in order; raises when Redis fails.

        A batch that failed stays in flight with its sequence number and is retried before
        anything newer, so a retry after a lost reply is recognised by Redis and not applied
        twice (the counters in Redis then match the Prometheus ones exactly).
        """
        async with self._write_lock:
            while True:
                if self._inflight is None:
                    if not self._pending.has_work():
                        return
                    self._seq += 1
                    self._inflight = (
                        self._seq,
                        self._pending.drain(self.settings.max_batch_changes),
                    )
                seq, batch = self._inflight
                await self._write(seq, batch)
                self._inflight = None

    @property
    def position(self) -> str | None:
        """The last change-stream id this instance has read (None before the first sync)."""
        return None if self._position is None else _format_id(self._position)

    async def wait_caught_up(self, timeout_s: float = 5.0) -> None:
        """Wait until this instance has applied everything in the change stream now (tests)."""
        client = self._require_client()
        async with asyncio.timeout(timeout_s):
            while True:
                info = await self._stream_info(client)
                target = info[0] if info else (0, 0)
                if not self._needs_sync and self._position is not None and self._position >= target:
                    return
                await asyncio.sleep(0.01)

    async def write_snapshot(self) -> str:
        """Write the local index as the shared snapshot now; returns the stream id it covers."""
        client = self._require_client()
        assert self._sink is not None
        # Changes made while the holdings are read come after this position: replayed on load.
        position = self._position or (0, 0)
        builder = SnapshotBuilder()
        for n, (model, replica_id, path) in enumerate(self._sink.snapshot_holdings(), 1):
            builder.add(model, replica_id, path)
            if n % self.settings.snapshot_yield_every == 0:
                await asyncio.sleep(0)  # 100k blocks take ~0.2 s: never in one loop turn
        blob = builder.build(_format_id(position), self.instance_id).encode()
        await client.set(self.keys.snapshot, blob, ex=int(self.settings.snapshot_ttl_s))
        self.stats.snapshots_written += 1
        self._last_snapshot = time.monotonic()
        self._snapshot_due = False
        return _format_id(position)

    # -- request-path hook ----------------------------------------------------------------

    def _wake_flusher(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    # -- up / down --------------------------------------------------------------------------

    def _mark_up(self) -> None:
        if not self.stats.up:
            log.info("state backend: Redis reachable again")
        self.stats.up = True

    def _mark_down(self, where: str, exc: BaseException) -> None:
        self.last_error = f"{where}: {type(exc).__name__}: {exc}"
        if self.stats.up:
            log.warning(
                "state backend: Redis unavailable (%s); routing on local state", self.last_error
            )
        self.stats.up = False
        self._needs_sync = True

    def _require_client(self) -> aioredis.Redis:
        if self._client is None:
            raise RuntimeError("state backend not started")
        return self._client

    # -- flusher ----------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        failures = 0
        while not self._closing:
            if failures:
                await asyncio.sleep(self._backoff.compute(failures))
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.flush_interval_s):
                        await self._wake.wait()
                        if self.settings.flush_linger_s > 0:
                            await asyncio.sleep(self.settings.flush_linger_s)
            self._wake.clear()
            try:
                await self.flush()
            except _FAILURES as exc:
                failures += 1
                self.stats.failed_writes += 1
                self._mark_down("write", exc)
            else:
                failures = 0

    async def _write(self, seq: int, batch: PendingBatch) -> None:
        if batch.is_empty():
            return
        s = self.settings
        keys: list[str] = [
            self.keys.writer_seq(self.instance_id),
            self.keys.changes,
            self.keys.registry,
            self.keys.counter_replicas,
            self.keys.evictions,
            self.keys.hot_models,
        ]
        key_pos: dict[str, int] = {}

        def key_ref(key: str) -> int:
            if key not in key_pos:
                keys.append(key)
                key_pos[key] = len(keys)  # Lua KEYS are 1-based
            return key_pos[key]

        args: list[str | bytes | int] = [
            seq,
            int(s.seq_ttl_s),
            self.instance_id,
            encode_batch(batch.changes) if batch.changes else b"",
            s.stream_maxlen,
            s.evictions_maxlen,
        ]
        registry = [c for c in batch.changes if isinstance(c, RegistryChange)]
        args.append(len(registry))
        for change in registry:
            if change.kind is RegistryKind.ADD:
                value = msgpack.packb(
                    {
                        "url": change.url,
                        "models": list(change.models),
                        "by": self.instance_id,
                        "ts_ms": int(time.time() * 1000),
                    }
                )
                args += ["A", change.replica_id, value]
            else:
                args += ["D", change.replica_id, b""]
        args.append(len(batch.counters))
        replicas: set[str] = set()
        for (replica_id, name), value in batch.counters.items():
            args += [key_ref(self.keys.counters(replica_id)), name, value]
            replicas.add(replica_id)
        args.append(len(replicas))
        args += sorted(replicas)
        args.append(len(batch.hot))
        for (model, prefix_id), hits in batch.hot.items():
            args += [key_ref(self.keys.hot(model)), prefix_id, hits, model]
            self._hot_models.add(model)
        args.append(len(batch.evictions))
        for ev in batch.evictions:
            args += [ev.replica_id, ev.model, ev.blocks, ev.ts_ms]
        if not await self._write_script(keys=keys, args=args):
            # a retry of a batch Redis had already applied (its reply was lost): not re-applied
            self.stats.duplicate_batches += 1
        self.stats.published_changes += len(batch.changes)
        self._mark_up()

    # -- reader and re-sync -----------------------------------------------------------------

    async def _read_loop(self) -> None:
        client = self._require_client()
        failures = 0
        block_ms = int(self.settings.read_block_s * 1000)
        while not self._closing:
            try:
                if self._needs_sync:
                    await self._sync()
                    self._needs_sync = False
                assert self._position is not None
                # redis-py's response types are unions over decode modes; ours are bytes.
                response: Any = await client.xread(
                    {self.keys.changes: _format_id(self._position)},
                    count=self.settings.read_count,
                    block=block_ms,
                )
                if response:
                    await self._apply_entries(response[0][1])
                failures = 0
                self._mark_up()
            except _FAILURES as exc:
                failures += 1
                self.stats.failed_reads += 1
                self._mark_down("read", exc)
                await asyncio.sleep(self._backoff.compute(failures))

    async def _catch_up(self) -> None:
        """Read the stream to its end without blocking (warm-up)."""
        client = self._require_client()
        while True:
            assert self._position is not None
            response: Any = await client.xread(
                {self.keys.changes: _format_id(self._position)}, count=self.settings.read_count
            )
            if not response or not response[0][1]:
                return
            await self._apply_entries(response[0][1])

    async def _apply_entries(self, entries: Iterable[tuple[bytes, dict[bytes, bytes]]]) -> None:
        assert self._sink is not None
        sink = self._sink
        applied_since_yield = 0
        for raw_id, fields in entries:
            self._position = _parse_id(raw_id)
            origin = fields.get(b"o", b"").decode()
            if origin == self.instance_id:
                continue  # our own changes are in our index already
            try:
                changes = decode_batch(fields.get(b"d", b""), origin)
            except CodecError as exc:
                self.stats.bad_entries += 1
                log.warning("state backend: skipping stream entry %r: %s", raw_id, exc)
                continue
            for change in changes:
                if isinstance(change, IndexChange):
                    sink.apply_index_change(change)
                else:
                    sink.apply_registry_change(change)
            self.stats.applied_changes += len(changes)
            applied_since_yield += len(changes)
            if applied_since_yield >= self.settings.apply_yield_every:
                applied_since_yield = 0
                await asyncio.sleep(0)

    async def _stream_info(self, client: aioredis.Redis) -> tuple[StreamId, StreamId] | None:
        """(last generated id, first kept id) of the change stream; None when it is absent.

        Entries after our position are all still there iff the first kept id is not after it
        (Redis does not record MAXLEN trimming in max-deleted-entry-id); the first kept id is
        (0, 0) when nothing was ever trimmed.
        """
        try:
            info: Any = await client.xinfo_stream(self.keys.changes)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise
        first = info.get("first-entry")
        never_trimmed = int(info.get("entries-added", 0)) == int(info.get("length", 0))
        return (
            _parse_id(info.get("last-generated-id")),
            (0, 0) if never_trimmed or not first else _parse_id(first[0]),
        )

    async def _sync(self) -> None:
        """Bring the local view up to date with Redis after start-up or a failure."""
        client = self._require_client()
        assert self._sink is not None
        for change in (await self._registry_entries(client)).values():
            if change.origin != self.instance_id:
                self._sink.apply_registry_change(change)
        info = await self._stream_info(client)
        position = self._position
        if position is not None:
            last, first = info if info else ((0, 0), (0, 0))
            if last < position:
                # Redis lost the stream (restarted without persistence, or flushed): start
                # again at the new stream's beginning and have the leader re-seed a snapshot.
                log.warning("state backend: change stream is behind our position; Redis lost data")
                self._position = (0, 0)
                self._snapshot_due = True
                self.stats.resyncs += 1
                return
            if first <= position:
                return  # every entry after our position is still there: keep reading
            self.stats.resyncs += 1
        await self._load_snapshot(client)

    async def _load_snapshot(self, client: aioredis.Redis) -> None:
        assert self._sink is not None
        blob: Any = await client.get(self.keys.snapshot)
        if blob is None:
            self._position = (0, 0)  # no snapshot: replay whatever the stream still holds
            return
        try:
            snapshot = IndexSnapshot.decode(blob)
        except CodecError as exc:
            self.stats.bad_entries += 1
            log.warning("state backend: ignoring undecodable snapshot: %s", exc)
            self._position = (0, 0)
            return
        n = 0
        for change in snapshot.changes():
            self._sink.apply_index_change(change)
            n += 1
            if n % self.settings.apply_yield_every == 0:
                await asyncio.sleep(0)
        self.stats.applied_changes += n
        self.stats.snapshots_loaded += 1
        self._position = _parse_id(snapshot.stream_id)

    # -- heartbeat, lease, snapshots, trimming -----------------------------------------------

    async def _maintenance_loop(self) -> None:
        failures = 0
        while not self._closing:
            await asyncio.sleep(
                self._backoff.compute(failures) if failures else self.settings.heartbeat_interval_s
            )
            try:
                await self._maintain()
                failures = 0
            except _FAILURES as exc:
                failures += 1
                self.stats.is_leader = False
                self._mark_down("maintenance", exc)

    async def _maintain(self) -> None:
        client = self._require_client()
        s = self.settings
        leader = await self._lease_script(
            keys=[self.keys.leader], args=[self.instance_id, int(s.lease_ttl_s * 1000)]
        )
        self.stats.is_leader = bool(leader)
        heartbeat: Any = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_ms": self._started_ms,
            "seen_ms": int(time.time() * 1000),
            "position": self.position or "",
            "leader": int(self.stats.is_leader),
            "pending": len(self._pending),
            "dropped": self._pending.dropped,
        }
        async with client.pipeline(transaction=False) as pipe:
            key = self.keys.instance(self.instance_id)
            pipe.hset(key, mapping=heartbeat)
            pipe.expire(key, int(max(1, s.heartbeat_ttl_s)))
            for model in self._hot_models:
                pipe.zremrangebyrank(self.keys.hot(model), 0, -(s.max_hot_prefixes + 1))
            await pipe.execute()
        self._hot_models.clear()
        due = self._snapshot_due or time.monotonic() - self._last_snapshot >= s.snapshot_interval_s
        if self.stats.is_leader and due and not self._needs_sync:
            await self.write_snapshot()

    # -- reads ------------------------------------------------------------------------------

    async def read_counters(self) -> dict[str, ReplicaCounters]:
        client = self._require_client()
        members: Any = await client.smembers(self.keys.counter_replicas)
        replica_ids = sorted(r.decode() for r in members)
        async with client.pipeline(transaction=False) as pipe:
            for rid in replica_ids:
                pipe.hgetall(self.keys.counters(rid))
            rows = await pipe.execute()
        return {
            rid: ReplicaCounters.from_mapping({k.decode(): int(v) for k, v in row.items()})
            for rid, row in zip(replica_ids, rows, strict=True)
        }

    async def read_evictions(self, limit: int = 100) -> list[EvictionRecord]:
        client = self._require_client()
        entries: Any = await client.xrevrange(self.keys.evictions, count=limit)
        out = []
        for _id, f in entries:
            out.append(
                EvictionRecord(
                    f[b"replica"].decode(),
                    f[b"model"].decode(),
                    int(f[b"blocks"]),
                    f[b"origin"].decode(),
                    int(f[b"ts_ms"]),
                )
            )
        return out

    async def read_hot_prefixes(self, model: str, limit: int = 20) -> list[HotPrefix]:
        client = self._require_client()
        rows: Any = await client.zrevrange(self.keys.hot(model), 0, limit - 1, withscores=True)
        return [HotPrefix(model, member.decode(), int(score)) for member, score in rows]

    async def read_registry(self) -> dict[str, RegistryChange]:
        return await self._registry_entries(self._require_client())

    async def _registry_entries(self, client: aioredis.Redis) -> dict[str, RegistryChange]:
        out: dict[str, RegistryChange] = {}
        entries: Any = await client.hgetall(self.keys.registry)
        for raw_id, raw in entries.items():
            rid = raw_id.decode()
            try:
                entry = msgpack.unpackb(raw, raw=False)
                out[rid] = RegistryChange(
                    RegistryKind.ADD,
                    rid,
                    str(entry["url"]),
                    tuple(str(m) for m in entry.get("models", ())),
                    str(entry.get("by", "")),
                )
            except (ValueError, TypeError, KeyError, AttributeError, msgpack.ExtraData):
                self.stats.bad_entries += 1
        return out

    async def live_instances(self) -> list[str]:
        """Ids of instances whose heartbeat has not expired."""
        client = self._require_client()
        prefix = self.keys.instance("")
        found = []
        async for key in client.scan_iter(match=self.keys.instance_pattern, count=100):
            found.append(key.decode()[len(prefix) :])
        return sorted(found)
