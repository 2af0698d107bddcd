"""The in-process backend: private by default, shared between gateways through one store."""

from __future__ import annotations

from router.state import (
    ChangeKind,
    IndexChange,
    MemoryBackend,
    MemoryStore,
    RegistryChange,
    RegistryKind,
)
from tests.router.state.support import DictSink, eventually


async def test_two_backends_on_one_store_exchange_changes() -> None:
    store = MemoryStore()
    a, b = MemoryBackend(store, instance_id="a"), MemoryBackend(store, instance_id="b")
    sink_a, sink_b = DictSink(), DictSink()
    await a.start(sink_a)
    await b.start(sink_b)
    try:
        assert a.stats.is_leader and not b.stats.is_leader
        a.publish_index(IndexChange(ChangeKind.INSERT, "m", (1, 2), "r1"))
        a.publish_registry(RegistryChange(RegistryKind.ADD, "r9", "http://x", ("m",)))
        await eventually(lambda: bool(sink_b.paths("m", "r1")) and "r9" in sink_b.registry)
        assert sink_a.changes == []  # never applied to its own sink
        assert sink_b.changes[0].origin == "a"
        assert b.stats.applied_changes == 2 and a.stats.published_changes == 2
        a.record_request("r1", prompt_tokens=100, predicted_hit_tokens=40)
        b.record_request("r1", prompt_tokens=50, predicted_hit_tokens=0)
        a.record_observed("r1", hit_tokens=30, query_tokens=150)  # leader: kept
        b.record_observed("r1", hit_tokens=30, query_tokens=150)  # not leader: would double count
        await a.flush()
        counters = (await b.read_counters())["r1"]
        assert (counters.requests, counters.prompt_tokens, counters.predicted_hit_tokens) == (
            2,
            150,
            40,
        )
        assert (counters.observed_hit_tokens, counters.observed_query_tokens) == (30, 150)
    finally:
        await a.stop()
        await b.stop()
    assert b.stats.is_leader is False and store.members == []


async def test_a_joining_backend_warms_up_from_the_leader() -> None:
    store = MemoryStore()
    a = MemoryBackend(store)
    sink_a = DictSink()
    await a.start(sink_a)
    for i in range(10):
        sink_a.apply_index_change(IndexChange(ChangeKind.INSERT, "m", (0, i), "r1"))
    a.publish_registry(RegistryChange(RegistryKind.ADD, "r2", "http://r2"))
    await a.flush()
    c = MemoryBackend(store)
    sink_c = DictSink()
    await c.start(sink_c)
    try:
        assert sink_c.paths("m", "r1") == {(0, i) for i in range(10)}
        assert set(sink_c.registry) == {"r2"}
        assert c.stats.snapshots_loaded == 1
    finally:
        await c.stop()
        await a.stop()


async def test_evictions_and_hot_prefixes_are_recorded() -> None:
    backend = MemoryBackend()
    await backend.start(DictSink())
    try:
        backend.publish_index(IndexChange(ChangeKind.EVICT, "m", (5, 6), "r1"))
        for _ in range(3):
            backend.record_prefix_hit("m", [11, 22, 33], 2)
        backend.record_prefix_hit("m", [11, 22, 33], 1)
        backend.record_prefix_hit("m", [11, 22, 33], 0)  # no match: not a hit
        evictions = await backend.read_evictions()
        assert [(e.replica_id, e.blocks) for e in evictions] == [("r1", 2)]
        hot = await backend.read_hot_prefixes("m")
        assert [(h.prefix_id, h.hits) for h in hot] == [(f"2:{22:016x}", 3), (f"1:{11:016x}", 1)]
        assert (await backend.read_counters())["r1"].evicted_blocks == 2
    finally:
        await backend.stop()
