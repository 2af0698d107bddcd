"""StateSync on real routing cores, prefix indexes and fleets, sharing through a real Redis.

The gateway wiring is exercised end to end in tests/integration/test_shared_state.py; here the
same objects a gateway builds are driven directly, request by request, with the kv_aware policy.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from router.config import ReplicaSpec
from router.core import RoutingCore
from router.fleet.circuit import CircuitBreaker
from router.metrics import RouterMetrics
from router.policies import PolicySettings, make_policy
from router.policies.base import ReplicaView, RoutingRequest
from router.prefix.index import PrefixIndex
from router.prefix.units import KeyUnits
from router.state import RedisBackend, ReplicaCounters, SharedFleet, StateSync
from tests.router.state.support import delete_prefix, unique_prefix
from tests.router.state.test_redis_backend import fast_settings

REPLICAS = ("r0", "r1", "r2", "r3")
MODEL = "m"


@dataclass
class Node:
    """What one gateway builds around its state backend."""

    fleet: SharedFleet
    core: RoutingCore
    index: PrefixIndex
    backend: RedisBackend
    sync: StateSync

    def route(self, hashes: tuple[int, ...]) -> tuple[str, int]:
        """Decide like the core does (kv_aware on plain views), insert, share. → (replica, hit)."""
        request = RoutingRequest(
            model=MODEL, block_hashes=hashes, prompt_units=len(hashes) * 64,
            prompt_tokens=len(hashes) * 16, block_units=64, members=REPLICAS,
        )  # fmt: skip
        matches = self.index.match(MODEL, hashes)
        views = [
            ReplicaView(
                r,
                matched_blocks=matches.get(r, 0),
                held_blocks=self.index.holds(r),
                capacity_blocks=self.index.capacity_of(r),
            )
            for r in REPLICAS
        ]
        chosen = self.core.policy.choose(request, views).replica_id
        self.index.insert(MODEL, hashes, chosen)
        self.sync.routed(request, chosen, matches.get(chosen, 0))
        return chosen, matches.get(chosen, 0)


Make = Callable[..., Any]


@pytest.fixture
async def make_node(redis_server_url: str) -> AsyncIterator[Make]:
    prefix = unique_prefix()
    nodes: list[Node] = []

    async def make(name: str, capacity_blocks: int | None = None, start: bool = True) -> Node:
        metrics = RouterMetrics(CollectorRegistry())
        fleet = SharedFleet(metrics=metrics, circuit_factory=lambda: CircuitBreaker(3, 1.0, 1))
        for i, rid in enumerate(REPLICAS):
            fleet.add(ReplicaSpec(rid, f"http://127.0.0.1:{40000 + i}"))
        index = PrefixIndex()
        core = RoutingCore(
            fleet=fleet,
            policy=make_policy("kv_aware", PolicySettings(seed=1)),
            metrics=metrics,
            uses_prefix=True,
            units=KeyUnits(block_units=64),
            prefix_index=index,
        )
        if capacity_blocks is not None:
            for rid in REPLICAS:
                index.set_capacity(rid, capacity_blocks)
        backend = RedisBackend(fast_settings(redis_server_url, prefix), instance_id=name)
        sync = StateSync(backend, core, fleet)
        fleet.sync = sync
        fleet.observers += [core, sync]  # as the gateway wires them
        node = Node(fleet, core, index, backend, sync)
        nodes.append(node)
        if start:
            await backend.start(sync)
        return node

    yield make
    for node in nodes:
        await node.backend.stop()
    await delete_prefix(redis_server_url, prefix)


def shared_prefix_workload(
    seed: int, groups: int = 12, per_group: int = 8
) -> list[tuple[int, ...]]:
    """Prompts as block-hash paths: a 16-block system prompt per group + 2 private blocks."""
    rng = random.Random(seed)
    systems = [tuple(rng.getrandbits(64) for _ in range(16)) for _ in range(groups)]
    prompts = [
        (*s, rng.getrandbits(64), rng.getrandbits(64)) for s in systems for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


async def caught_up(*nodes: Node) -> None:
    for node in nodes:
        await node.backend.flush()
    for node in nodes:
        await node.backend.wait_caught_up()


async def test_two_synced_instances_predict_hits_like_one(make_node: Make) -> None:
    """Alternating requests between two instances find the prefixes the other one placed."""
    prompts = shared_prefix_workload(seed=3)
    single = await make_node("single", capacity_blocks=120, start=False)
    single_hits = sum(single.route(p)[1] for p in prompts)

    a = await make_node("a", capacity_blocks=120)
    b = await make_node("b", capacity_blocks=120)
    shared_hits = 0
    for i, prompt in enumerate(prompts):
        shared_hits += (a if i % 2 == 0 else b).route(prompt)[1]
        await caught_up(a, b)  # requests are far apart compared with Redis propagation

    isolated_a = await make_node("iso-a", capacity_blocks=120, start=False)
    isolated_b = await make_node("iso-b", capacity_blocks=120, start=False)
    isolated_hits = sum(
        (isolated_a if i % 2 == 0 else isolated_b).route(p)[1] for i, p in enumerate(prompts)
    )

    total = sum(len(p) for p in prompts)
    assert abs(shared_hits - single_hits) / total <= 0.03, (shared_hits, single_hits, total)
    # without sharing, each instance learns every prefix on its own: visibly fewer hits
    assert isolated_hits < single_hits - 0.03 * total


async def test_counters_evictions_and_hot_prefixes_reach_redis(make_node: Make) -> None:
    a = await make_node("a", capacity_blocks=40)
    b = await make_node("b", capacity_blocks=40)
    prompts = shared_prefix_workload(seed=5, groups=6, per_group=4)
    for i, prompt in enumerate(prompts):
        (a if i % 2 == 0 else b).route(prompt)
        await caught_up(a, b)
    counters = await a.backend.read_counters()
    total = ReplicaCounters()
    for value in counters.values():
        total = total + value
    assert total.requests == len(prompts)
    assert total.prompt_tokens == sum(len(p) * 16 for p in prompts)
    evicted_own = sum(node.index.stats().evictions.get(r, 0) for node in (a, b) for r in REPLICAS)
    # each instance evicts for its own inserts and for the mirrored ones: Redis counts one of them
    assert 0 < total.evicted_blocks <= evicted_own
    evictions = await a.backend.read_evictions(limit=1000)
    assert sum(e.blocks for e in evictions) == total.evicted_blocks
    assert {e.origin for e in evictions} <= {"a", "b"}
    hot = await a.backend.read_hot_prefixes(MODEL, limit=3)
    assert hot and hot[0].prefix_id.startswith("16:")  # a whole system prompt is the hottest


async def test_admin_changes_are_shared_and_unknown_replicas_skipped(make_node: Make) -> None:
    a = await make_node("a")
    b = await make_node("b")
    a.fleet.add(ReplicaSpec("r9", "http://127.0.0.1:49999"), source="admin")
    await caught_up(a, b)
    assert b.fleet.get("r9") is not None and b.fleet.get("r9").source == "shared"  # type: ignore[union-attr]
    path = (1, 2, 3)
    a.route(path)
    a.index.insert(MODEL, path, "r9")
    a.sync.routed(RoutingRequest(model=MODEL, block_hashes=path, prompt_tokens=48), "r9", 0)
    await caught_up(a, b)
    assert b.index.match(MODEL, path).get("r9") == 3
    a.fleet.remove("r9")
    await caught_up(a, b)
    assert b.fleet.get("r9") is None
    assert "r9" not in b.index.match(MODEL, path)
    assert await b.backend.read_registry() == {}
    # a change about a replica b does not know is skipped, not applied blindly
    a.index.insert(MODEL, (7,), "ghost")
    a.sync.routed(RoutingRequest(model=MODEL, block_hashes=(7,), prompt_tokens=16), "ghost", 0)
    await caught_up(a, b)
    assert b.sync.skipped_changes >= 1 and "ghost" not in b.index.replicas


async def test_new_instance_warms_up_to_the_same_index(make_node: Make) -> None:
    a = await make_node("a", capacity_blocks=200)
    prompts = shared_prefix_workload(seed=9)
    for prompt in prompts:
        a.route(prompt)
    await caught_up(a)
    await a.backend.write_snapshot()
    for prompt in shared_prefix_workload(seed=10, groups=2, per_group=2):
        a.route(prompt)  # the tail after the snapshot
    await a.backend.flush()
    c = await make_node("c", capacity_blocks=200)
    assert c.backend.stats.snapshots_loaded == 1
    for prompt in prompts[:30]:
        assert c.index.match(MODEL, prompt) == a.index.match(MODEL, prompt)
    assert c.index.stats().held_blocks == a.index.stats().held_blocks


async def test_observed_counters_come_from_scrape_deltas_of_the_leader(make_node: Make) -> None:
    from router.fleet.stats import ScrapedStats

    a = await make_node("a")
    b = await make_node("b")
    assert a.backend.stats.is_leader and not b.backend.stats.is_leader
    for node in (a, b):
        replica = node.fleet.get("r0")
        assert replica is not None
        node.fleet.set_stats(replica, ScrapedStats(prefix_hit_tokens=100, prefix_query_tokens=400))
        node.fleet.set_stats(replica, ScrapedStats(prefix_hit_tokens=160, prefix_query_tokens=500))
        node.fleet.set_stats(
            replica, ScrapedStats(prefix_hit_tokens=10, prefix_query_tokens=20)
        )  # restart
    await caught_up(a, b)
    counters = (await a.backend.read_counters())["r0"]
    assert (counters.observed_hit_tokens, counters.observed_query_tokens) == (170, 520)
