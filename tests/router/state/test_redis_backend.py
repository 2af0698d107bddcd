"""The Redis backend against a real redis-server, each test under its own key prefix."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from router.state import (
    ChangeKind,
    IndexChange,
    KeySchema,
    RedisBackend,
    RedisSettings,
    RegistryChange,
    RegistryKind,
)
from tests.router.state.support import (
    DictSink,
    delete_prefix,
    eventually,
    private_redis,
    unique_prefix,
)

Factory = Callable[..., RedisBackend]


def fast_settings(url: str, prefix: str, **overrides: Any) -> RedisSettings:
    base = RedisSettings(
        url=url,
        key_prefix=prefix,
        command_timeout_s=0.5,
        connect_timeout_s=0.5,
        read_block_s=0.05,
        flush_interval_s=0.01,
        heartbeat_interval_s=0.1,
        heartbeat_ttl_s=2.0,
        lease_ttl_s=0.5,
        snapshot_interval_s=3600.0,
        warmup_timeout_s=5.0,
        backoff_cap_s=0.2,
    )
    return dataclasses.replace(base, **overrides)


@pytest.fixture
async def prefix(redis_server_url: str) -> AsyncIterator[str]:
    p = unique_prefix()
    yield p
    await delete_prefix(redis_server_url, p)


@pytest.fixture
async def client(redis_server_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_server_url)
    yield c
    await c.aclose()


@pytest.fixture
async def backends(redis_server_url: str, prefix: str) -> AsyncIterator[Factory]:
    """Makes started-later backends on the shared test Redis; stops them all afterwards."""
    made: list[RedisBackend] = []

    def make(instance_id: str, **overrides: Any) -> RedisBackend:
        backend = RedisBackend(
            fast_settings(redis_server_url, prefix, **overrides), instance_id=instance_id
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.stop()


def ins(path: tuple[int, ...], replica: str = "r1", model: str = "m") -> IndexChange:
    return IndexChange(ChangeKind.INSERT, model, path, replica)


async def test_publish_apply_round_trip_between_two_instances(backends: Factory) -> None:
    a, b = backends("a"), backends("b")
    sink_a, sink_b = DictSink(), DictSink()
    await a.start(sink_a)
    await b.start(sink_b)
    a.publish_index(ins((1, 2, 3)))
    a.publish_index(IndexChange(ChangeKind.REFRESH, "m", (1, 2, 3), "r1"))
    a.publish_index(ins((1, 2, 3), replica="r2"))
    a.publish_index(IndexChange(ChangeKind.EVICT, "m", (1, 2, 3), "r2"))
    a.publish_registry(RegistryChange(RegistryKind.ADD, "r3", "http://127.0.0.1:9", ("m",)))
    b.publish_index(ins((9,), replica="r2"))
    await eventually(lambda: len(sink_b.changes) == 5, what="b applied a's five changes")
    await eventually(lambda: len(sink_a.changes) == 1, what="a applied b's change")
    assert [c.origin for c in sink_b.changes] == ["a"] * 5
    assert sink_b.paths("m", "r1") == {(1, 2, 3)}
    assert sink_b.paths("m", "r2") == set()
    assert sink_b.registry["r3"].url == "http://127.0.0.1:9"
    assert sink_a.paths("m", "r2") == {(9,)}
    assert (a.stats.published_changes, b.stats.applied_changes) == (5, 5)
    assert a.stats.up and b.stats.up
    # a remove_replica wipes r1 on the other side
    b.publish_index(IndexChange(ChangeKind.REMOVE_REPLICA, "", (), "r1"))
    b.publish_registry(RegistryChange(RegistryKind.REMOVE, "r3"))
    await b.flush()
    await eventually(lambda: not sink_a.paths("m", "r1"), what="a applied b's remove_replica")
    assert await a.read_registry() == {}


async def test_new_instance_warms_up_from_snapshot_plus_tail(backends: Factory) -> None:
    a = backends("a")
    sink_a = DictSink()
    await a.start(sink_a)
    for i in range(50):
        sink_a.apply_index_change(ins((100, i)))  # a's own index...
        a.publish_index(ins((100, i)))  # ...and what it shares
    await a.flush()
    await a.wait_caught_up()
    snapshot_id = await a.write_snapshot()
    for i in range(10):
        sink_a.apply_index_change(ins((200, i), replica="r2"))
        a.publish_index(ins((200, i), replica="r2"))
    a.publish_registry(RegistryChange(RegistryKind.ADD, "r2", "http://r2"))
    await a.flush()

    c = backends("c")
    sink_c = DictSink()
    await c.start(sink_c)
    assert sink_c.paths("m", "r1") == {(100, i) for i in range(50)}
    assert sink_c.paths("m", "r2") == {(200, i) for i in range(10)}
    assert "r2" in sink_c.registry
    assert c.stats.snapshots_loaded == 1
    # 50 from the snapshot, then only the 11 changes after the snapshot's stream id
    assert c.stats.applied_changes == 50 + 11
    assert c.position is not None and c.position > snapshot_id


async def test_stream_is_capped_and_a_trimmed_instance_resyncs_from_snapshot(
    backends: Factory, client: aioredis.Redis, prefix: str
) -> None:
    a = backends("a", stream_maxlen=10, max_batch_changes=1, evictions_maxlen=10)
    sink_a = DictSink()
    await a.start(sink_a)
    b = backends("b")
    sink_b = DictSink()
    await b.start(sink_b)
    assert b.position is not None
    await b.stop()  # b is away while the stream is trimmed past its position
    for i in range(400):
        change = ins((7, i))
        sink_a.apply_index_change(change)
        a.publish_index(change)
        a.publish_index(IndexChange(ChangeKind.EVICT, "m", (8, i), "r9"))
    await a.flush()
    keys = KeySchema(prefix)
    # MAXLEN ~ trims whole radix-tree nodes (100 entries each by default)
    assert await client.xlen(keys.changes) <= 10 + 100
    assert await client.xlen(keys.evictions) <= 10 + 100
    await a.wait_caught_up()
    await a.write_snapshot()

    b2 = backends("b")  # the same instance coming back, its old position trimmed away
    b2._position = b._position  # what a restarted process would have kept in memory
    await b2.start(sink_b)
    assert b2.stats.resyncs == 1 and b2.stats.snapshots_loaded == 1
    assert sink_b.paths("m", "r1") == {(7, i) for i in range(400)}


async def test_instance_resumes_from_its_position_when_the_stream_still_has_it(
    backends: Factory,
) -> None:
    a, b = backends("a"), backends("b")
    sink_b = DictSink()
    await a.start(DictSink())
    await b.start(sink_b)
    a.publish_index(ins((2,)))
    await eventually(lambda: sink_b.paths("m", "r1") == {(2,)})
    await a.wait_caught_up()
    await a.write_snapshot()
    old_position = b._position
    assert old_position is not None and old_position > (0, 0)
    await b.stop()
    for i in range(20):
        a.publish_index(ins((3, i)))
    await a.flush()
    b2 = backends("b")
    b2._position = old_position
    sink_b2 = DictSink()
    await b2.start(sink_b2)
    assert b2.stats.snapshots_loaded == 0 and b2.stats.resyncs == 0
    assert b2.stats.applied_changes == 20
    assert sink_b2.paths("m", "r1") == {(3, i) for i in range(20)}


async def test_keys_that_can_go_stale_have_ttls(
    backends: Factory, client: aioredis.Redis, prefix: str
) -> None:
    keys = KeySchema(prefix)
    a = backends("a", heartbeat_ttl_s=1.0, lease_ttl_s=0.5, snapshot_ttl_s=60.0)
    await a.start(DictSink())
    a.publish_index(ins((1,)))
    await a.flush()
    await a.write_snapshot()
    assert 0 < await client.ttl(keys.instance("a")) <= 1
    assert 0 < await client.pttl(keys.leader) <= 500
    assert 0 < await client.ttl(keys.snapshot) <= 60
    assert await client.ttl(keys.writer_seq("a")) > 0
    assert await a.live_instances() == ["a"]
    # an instance that dies without saying goodbye disappears when its heartbeat expires
    for task in a._tasks:
        task.cancel()
    await asyncio.gather(*a._tasks, return_exceptions=True)
    a._tasks = []

    async def gone(key: str) -> bool:
        return int(await client.exists(key)) == 0

    await eventually(lambda: gone(keys.instance("a")), timeout_s=5, what="heartbeat expired")
    await eventually(lambda: gone(keys.leader), timeout_s=5, what="lease expired")


async def test_counters_hot_prefixes_and_evictions(backends: Factory) -> None:
    a, b = backends("a", max_hot_prefixes=2), backends("b")
    await a.start(DictSink())
    await b.start(DictSink())
    assert a.stats.is_leader and not b.stats.is_leader
    a.record_request("r1", prompt_tokens=100, predicted_hit_tokens=64)
    b.record_request("r1", prompt_tokens=10, predicted_hit_tokens=0)
    b.record_request("r2", prompt_tokens=7, predicted_hit_tokens=7)
    a.record_observed("r1", hit_tokens=50, query_tokens=110)
    b.record_observed("r1", hit_tokens=50, query_tokens=110)  # not the leader: not counted again
    a.publish_index(IndexChange(ChangeKind.EVICT, "m", (1, 2, 3), "r2"))
    hashes = [0xA, 0xB, 0xC, 0xD]
    for matched, times in ((1, 5), (2, 3), (3, 1), (4, 2)):
        for _ in range(times):
            a.record_prefix_hit("m", hashes, matched)
    await a.flush()
    await b.flush()
    counters = await b.read_counters()
    assert counters["r1"].as_dict() == {
        "requests": 2,
        "prompt_tokens": 110,
        "predicted_hit_tokens": 64,
        "observed_hit_tokens": 50,
        "observed_query_tokens": 110,
        "evicted_blocks": 0,
    }
    assert counters["r2"].evicted_blocks == 3 and counters["r2"].requests == 1
    assert [(e.replica_id, e.model, e.blocks, e.origin) for e in await b.read_evictions()] == [
        ("r2", "m", 3, "a")
    ]
    await eventually(lambda: _hot_len(b), what="hot set trimmed to max_hot_prefixes")
    hot = await b.read_hot_prefixes("m")
    assert [(h.prefix_id, h.hits) for h in hot] == [(f"1:{0xA:016x}", 5), (f"2:{0xB:016x}", 3)]


async def _hot_len(backend: RedisBackend) -> bool:
    return len(await backend.read_hot_prefixes("m", limit=100)) == 2


async def test_redis_down_then_back_resumes_and_loses_nothing(tmp_path: Path) -> None:
    async with private_redis(tmp_path, persist=True) as server:
        prefix = unique_prefix()
        a = RedisBackend(fast_settings(server.url, prefix), instance_id="a")
        b = RedisBackend(fast_settings(server.url, prefix), instance_id="b")
        sink_b = DictSink()
        await a.start(DictSink())
        await b.start(sink_b)
        try:
            a.publish_index(ins((1,)))
            a.record_request("r1", prompt_tokens=10, predicted_hit_tokens=5)
            await eventually(lambda: sink_b.paths("m", "r1") == {(1,)})
            await server.stop()
            for i in range(2, 30):  # the request path keeps going while Redis is gone
                a.publish_index(ins((i,)))
                a.record_request("r1", prompt_tokens=10, predicted_hit_tokens=5)
            await eventually(lambda: not a.stats.up and not b.stats.up, what="both see Redis down")
            assert a.pending_changes > 0 or a._inflight is not None
            server.start()
            await server.wait_ready()
            await eventually(lambda: a.stats.up and b.stats.up, what="both see Redis back")
            await eventually(
                lambda: len(sink_b.paths("m", "r1")) == 29, what="b got a's outage changes"
            )
            await a.flush()
            counters = (await b.read_counters())["r1"]
            assert (counters.requests, counters.prompt_tokens) == (29, 290)
            assert a.stats.failed_writes + a.stats.failed_reads > 0
            assert a.dropped_updates == 0
        finally:
            await a.stop()
            await b.stop()


async def test_redis_restarting_empty_is_detected_and_reseeded(tmp_path: Path) -> None:
    async with private_redis(tmp_path, persist=False) as server:
        prefix = unique_prefix()
        a = RedisBackend(fast_settings(server.url, prefix), instance_id="a")
        sink_a = DictSink()
        await a.start(sink_a)
        try:
            sink_a.apply_index_change(ins((1,)))
            a.publish_index(ins((1,)))
            await a.flush()
            await a.wait_caught_up()
            written = a.stats.snapshots_written
            await server.stop()
            await eventually(lambda: not a.stats.up)
            server.start()
            await server.wait_ready()
            await eventually(lambda: a.stats.up and a.stats.resyncs == 1, what="re-synced")
            # the leader re-seeds a snapshot so that new instances can still warm up
            await eventually(lambda: a.stats.snapshots_written > written, what="snapshot re-seeded")
            c = RedisBackend(fast_settings(server.url, prefix), instance_id="c")
            sink_c = DictSink()
            await c.start(sink_c)
            await c.stop()
            assert sink_c.paths("m", "r1") == {(1,)}
        finally:
            await a.stop()


async def test_slow_redis_marks_down_and_batches_land_exactly_once(tmp_path: Path) -> None:
    async with private_redis(tmp_path, persist=False) as server:
        prefix = unique_prefix()
        settings = fast_settings(server.url, prefix, command_timeout_s=0.2, read_block_s=0.05)
        a = RedisBackend(settings, instance_id="a")
        await a.start(DictSink())
        admin = aioredis.Redis.from_url(server.url)
        try:
            await admin.client_pause(1500)  # every other client's commands now hang
            for _ in range(100):
                a.record_request("r1", prompt_tokens=3, predicted_hit_tokens=1)
            await eventually(lambda: not a.stats.up, what="timeouts mark the backend down")
            await eventually(lambda: a.stats.up, what="back once the pause ends")
            await a.flush()
            counters = (await a.read_counters())["r1"]
            # the timed-out call ran after the pause, and its retry was recognised as a duplicate
            assert (counters.requests, counters.prompt_tokens) == (100, 300)
        finally:
            await admin.aclose()
            await a.stop()


async def test_unreachable_redis_at_start_does_not_block_start(tmp_path: Path) -> None:
    async with private_redis(tmp_path, persist=False) as server:
        url = server.url
        await server.stop()
        a = RedisBackend(fast_settings(url, unique_prefix()), instance_id="a")
        sink_a = DictSink()
        await a.start(sink_a)  # returns: routing goes on with local state
        try:
            assert not a.stats.up
            a.publish_index(ins((1,)))
            server.start()
            await server.wait_ready()
            await eventually(lambda: a.stats.up and a.stats.published_changes == 1)
        finally:
            await a.stop()


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="redis://"):
        RedisSettings(url="http://localhost")
    with pytest.raises(ValueError, match="read_block_s"):
        RedisSettings(url="redis://x", read_block_s=1.0, command_timeout_s=0.5)
    with pytest.raises(ValueError, match="prefix"):
        RedisSettings(url="redis://x", key_prefix="")
