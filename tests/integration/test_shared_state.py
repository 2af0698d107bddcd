"""Shared fleet state end to end: real sim replicas, real gateways, a real Redis.

- Two gateways (one process, both real) in front of 4 sim replicas, requests alternating between
  them on the shared-prefix workload of tests/integration/test_cache_routing.py (kv_aware): the
  fleet hit rate (from the replicas' own vllm:prefix_cache_hits/queries deltas) is within 0.03
  of a single gateway's on the same workload, with fresh replicas for each run.
- The counters in Redis agree with the gateways' Prometheus counters; eviction records appear
  (each replica's KV holds only part of the workload).
- Redis stopped mid-load and started again: no request fails, the gateways' /metrics show the
  backend down, and afterwards both gateways hold the same index and Redis the same counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from loadtest.drivers import DriverConfig
from loadtest.runner import RunSettings, execute
from replicas.sim import SimReplica, SimSettings, start_replica
from router.app import Gateway, running_gateway
from router.config import RouterConfig
from router.state import SHARED_STATE, RedisBackend, ReplicaCounters
from tests.router.state.support import delete_prefix, eventually, private_redis, unique_prefix

MODEL = "sim-model"
# The scaled-down shared-prefix workload of test_cache_routing.py: 16 groups x 10 prompts with
# 1,024-token system prompts; 384 KV blocks of 16 tokens per replica hold about 5 of the 16.
WORKLOAD = {
    "num_groups": 16,
    "prompts_per_group": 10,
    "system_prompt_len": 1024,
    "question_len": 64,
    "output_len": 16,
}


@contextlib.asynccontextmanager
async def sim_fleet(num_gpu_blocks: int, time_scale: float) -> AsyncIterator[list[SimReplica]]:
    sims: list[SimReplica] = []
    try:
        for i in range(4):
            settings = SimSettings(
                port=0, model=MODEL, seed=i, time_scale=time_scale, num_gpu_blocks=num_gpu_blocks
            )
            sims.append(await start_replica(settings))
        yield sims
    finally:
        for sim in reversed(sims):
            await sim.stop()


def config(sims: Sequence[SimReplica], redis_url: str, prefix: str) -> RouterConfig:
    return RouterConfig(
        host="127.0.0.1",
        port=0,
        replicas=tuple(f"r{i}={s.url}" for i, s in enumerate(sims)),
        sim_replicas=0,
        policy="kv_aware",
        seed=1,
        health_interval_s=0.2,
        scrape_interval_s=0.1,
        redis_url=redis_url,
        redis_prefix=prefix or "fleet-router:",
    )


async def ready(*gateways: Gateway) -> None:
    """Every replica up with its KV capacity scraped, every backend synced."""

    def known() -> bool:
        return all(r.up and r.stats.num_gpu_blocks for g in gateways for r in g.fleet)

    await eventually(known, timeout_s=20, what="replicas up and scraped")


def backend(gateway: Gateway) -> RedisBackend:
    b = gateway.app[SHARED_STATE].backend
    assert isinstance(b, RedisBackend)
    return b


def prom(gateway: Gateway) -> dict[str, dict[str, float]]:
    """sample name → {replica label (or ""): value summed over other labels}."""
    text = generate_latest(gateway.state.metrics.registry).decode()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            per = out.setdefault(sample.name, {})
            key = sample.labels.get("replica", "")
            per[key] = per.get(key, 0.0) + sample.value
    return out


def summed(gateways: Sequence[Gateway], name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for g in gateways:
        for replica, value in prom(g).get(name, {}).items():
            out[replica] = out.get(replica, 0.0) + value
    return out


async def replica_counter(session: aiohttp.ClientSession, sim: SimReplica, name: str) -> float:
    async with session.get(sim.url + "/metrics") as response:
        text = await response.text()
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


async def settle(gateways: Sequence[Gateway], sims: Sequence[SimReplica]) -> None:
    """Wait for the leader to have scraped the replicas' final counters, then flush all."""
    leader = next(g for g in gateways if backend(g).stats.is_leader)
    async with aiohttp.ClientSession() as session:
        final = {
            f"r{i}": await replica_counter(session, s, "vllm:prefix_cache_hits_total")
            for i, s in enumerate(sims)
        }

    def scraped() -> bool:
        return all(
            leader.fleet.get(rid) is not None
            and leader.fleet.get(rid).stats.prefix_hit_tokens == value  # type: ignore[union-attr]
            for rid, value in final.items()
        )

    await eventually(scraped, timeout_s=10, what="leader scraped the final counters")
    for g in gateways:
        await backend(g).flush()
    for g in gateways:
        await backend(g).wait_caught_up()


async def check_counters_agree(
    gateways: Sequence[Gateway], sims: Sequence[SimReplica]
) -> dict[str, ReplicaCounters]:
    """Redis counters = the gateways' Prometheus counters (summed), replica by replica."""
    redis = await backend(gateways[0]).read_counters()
    predicted = summed(gateways, "fleet_router_predicted_hit_tokens_total")
    prompt = summed(gateways, "fleet_router_predicted_prompt_tokens_total")
    requests = summed(gateways, "fleet_router_requests_total")
    async with aiohttp.ClientSession() as session:
        for i, sim in enumerate(sims):
            rid = f"r{i}"
            c = redis.get(rid, ReplicaCounters())
            assert c.predicted_hit_tokens == predicted.get(rid, 0), rid
            assert c.prompt_tokens == prompt.get(rid, 0), rid
            assert c.requests == requests.get(rid, 0), rid
            # observed: the leader's scrape deltas add up to the replica's own counters
            assert c.observed_hit_tokens == await replica_counter(
                session, sim, "vllm:prefix_cache_hits_total"
            )
            assert c.observed_query_tokens == await replica_counter(
                session, sim, "vllm:prefix_cache_queries_total"
            )
    return redis


async def run_workload(targets: tuple[str, ...], sims: Sequence[SimReplica]) -> Any:
    settings = RunSettings(
        targets=targets,
        workload="shared-prefix",
        driver=DriverConfig(num_requests=160, rate_per_s=40.0, seed=1),
        workload_params=dict(WORKLOAD),
        seed=1,
        model=MODEL,
        replica_metrics=tuple(s.url for s in sims),
    )
    return await execute(settings, console=Console(file=io.StringIO()))


async def test_two_gateways_route_as_one_and_redis_counters_agree(redis_server_url: str) -> None:
    prefixes = [unique_prefix(), unique_prefix()]
    try:
        # one gateway (its state in Redis too: a lone instance is its own leader)
        async with (
            sim_fleet(num_gpu_blocks=384, time_scale=0.05) as sims,
            running_gateway(config(sims, redis_server_url, prefixes[0])) as single,
        ):
            await ready(single)
            one = await run_workload((single.url,), sims)
            await settle([single], sims)
            redis = await check_counters_agree([single], sims)
            # a single instance counts every eviction of its index, exactly
            evictions = summed([single], "fleet_router_index_evictions_total")
            for rid, c in redis.items():
                assert c.evicted_blocks == evictions.get(rid, 0), rid
            assert sum(c.evicted_blocks for c in redis.values()) > 0

        # two gateways, fresh replicas, requests alternating between them
        async with (
            sim_fleet(num_gpu_blocks=384, time_scale=0.05) as sims,
            running_gateway(config(sims, redis_server_url, prefixes[1])) as gw_a,
            running_gateway(config(sims, redis_server_url, prefixes[1])) as gw_b,
        ):
            await ready(gw_a, gw_b)
            two = await run_workload((gw_a.url, gw_b.url), sims)
            await settle([gw_a, gw_b], sims)
            redis = await check_counters_agree([gw_a, gw_b], sims)
            records = await backend(gw_a).read_evictions(limit=10_000)
            assert records and sum(r.blocks for r in records) == sum(
                c.evicted_blocks for c in redis.values()
            )
            assert {r.origin for r in records} <= {
                backend(gw_a).instance_id,
                backend(gw_b).instance_id,
            }
            # each gateway routed half the requests and applied the other's changes
            assert (
                backend(gw_a).stats.applied_changes > 0 and backend(gw_b).stats.applied_changes > 0
            )
            hot = await backend(gw_a).read_hot_prefixes(MODEL, limit=5)
            assert hot and hot[0].hits >= 5

        # the same two gateways without shared state (each in-process): what sharing buys
        async with (
            sim_fleet(num_gpu_blocks=384, time_scale=0.05) as sims,
            running_gateway(replace(config(sims, redis_server_url, ""), redis_url=None)) as gw_a,
            running_gateway(replace(config(sims, redis_server_url, ""), redis_url=None)) as gw_b,
        ):
            await ready(gw_a, gw_b)
            apart = await run_workload((gw_a.url, gw_b.url), sims)

        for outcome in (one, two, apart):
            assert outcome.summary.failed == 0
            assert outcome.summary.completed == 160
        hit_one = one.summary.server.prefix_cache_hit_rate
        hit_two = two.summary.server.prefix_cache_hit_rate
        hit_apart = apart.summary.server.prefix_cache_hit_rate
        print(
            f"fleet hit rate: one gateway {hit_one:.3f}, two sharing Redis {hit_two:.3f},"
            f" two apart {hit_apart:.3f}"
        )
        assert hit_one > 0.5  # the workload does reward cache-aware routing
        assert abs(hit_two - hit_one) <= 0.03
        assert hit_apart < hit_two - 0.03  # the comparison is not vacuous
    finally:
        for p in prefixes:
            await delete_prefix(redis_server_url, p)


def prompts(seed: int, groups: int, per_group: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "route", "fleet", "prefix"]
    systems = [" ".join(rng.choice(words) for _ in range(220)) for _ in range(groups)]
    out = [
        f"{s}\nQ{i}: " + " ".join(rng.choice(words) for _ in range(12))
        for s in systems
        for i in range(per_group)
    ]
    rng.shuffle(out)
    return out


async def send_all(
    session: aiohttp.ClientSession, gateways: Sequence[Gateway], batch: list[str]
) -> list[int]:
    """Send prompts 4 at a time, alternating gateways; the HTTP statuses."""

    async def one(i: int, prompt: str) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        async with session.post(gateways[i % 2].url + "/v1/completions", json=body) as response:
            await response.read()
            return response.status

    statuses: list[int] = []
    for start in range(0, len(batch), 4):
        chunk = batch[start : start + 4]
        statuses += await asyncio.gather(*(one(start + j, p) for j, p in enumerate(chunk)))
    return statuses


async def backend_up(session: aiohttp.ClientSession, gateway: Gateway) -> float:
    async with session.get(gateway.url + "/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fleet_router_state_backend_up":
                return sample.value
    raise AssertionError("fleet_router_state_backend_up not exported")


async def test_redis_outage_mid_load_fails_no_request_and_resyncs(tmp_path: Path) -> None:
    work = prompts(seed=4, groups=6, per_group=12)
    phases = [work[:24], work[24:48], work[48:]]
    async with (
        private_redis(tmp_path, persist=True) as server,
        sim_fleet(num_gpu_blocks=20_000, time_scale=0.01) as sims,  # ample KV: no evictions
        running_gateway(config(sims, server.url, unique_prefix())) as gw_a,
        running_gateway(config(sims, server.url, gw_a.state.config.redis_prefix)) as gw_b,
        aiohttp.ClientSession() as session,
    ):
        gateways = (gw_a, gw_b)
        await ready(gw_a, gw_b)
        statuses = await send_all(session, gateways, phases[0])

        await server.stop()
        for g in gateways:
            await eventually(lambda g=g: backend_down(g), timeout_s=10, what="backend down seen")  # type: ignore[misc]
            assert await backend_up(session, g) == 0.0  # visible in /metrics
        statuses += await send_all(session, gateways, phases[1])  # routed on local state

        server.start()
        await server.wait_ready()
        for g in gateways:
            await eventually(lambda g=g: backend(g).stats.up, timeout_s=15, what="backend back")  # type: ignore[misc]
            assert await backend_up(session, g) == 1.0
        statuses += await send_all(session, gateways, phases[2])

        assert statuses == [200] * len(work)  # zero failed requests
        await settle(gateways, sims)
        await check_counters_agree(gateways, sims)  # nothing lost, nothing counted twice
        for g in gateways:
            assert backend(g).stats.failed_reads + backend(g).stats.failed_writes > 0
            assert backend(g).dropped_updates == 0
        # re-synced: both indexes hold the same blocks, including what the other routed offline
        index_a, index_b = gw_a.state.core.prefix_index, gw_b.state.core.prefix_index
        assert index_a is not None and index_b is not None
        assert index_a.stats().held_blocks == index_b.stats().held_blocks
        assert sum(index_a.stats().held_blocks.values()) > 0
        hashes = gw_a.state.core.prepare
        for prompt in work:
            ctx = hashes("completions", {"model": MODEL, "prompt": prompt}, MODEL)
            assert index_a.match(MODEL, ctx.request.block_hashes) == index_b.match(
                MODEL, ctx.request.block_hashes
            )


def backend_down(gateway: Gateway) -> bool:
    return not backend(gateway).stats.up


async def test_admin_add_and_remove_on_one_gateway_reach_the_other(redis_server_url: str) -> None:
    prefix = unique_prefix()
    try:
        async with (
            sim_fleet(num_gpu_blocks=1024, time_scale=0.01) as sims,
            running_gateway(
                replace(config(sims[:1], redis_server_url, prefix), admin_token="t")
            ) as gw_a,
            running_gateway(config(sims[:1], redis_server_url, prefix)) as gw_b,
            aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as session,
        ):
            await ready(gw_a, gw_b)
            body = {"url": sims[1].url, "name": "extra"}
            async with session.post(gw_a.url + "/admin/replicas", json=body) as response:
                assert response.status == 201
            # gateway b learns of it through Redis, probes it and routes to it
            await eventually(lambda: _up(gw_b, "extra"), timeout_s=10, what="b sees extra up")
            assert gw_b.fleet.get("extra").source == "shared"  # type: ignore[union-attr]
            assert "extra" in await backend(gw_b).read_registry()
            # a gateway started later finds it in the registry hash
            async with running_gateway(config(sims[:1], redis_server_url, prefix)) as gw_c:
                assert gw_c.fleet.get("extra") is not None
            async with session.delete(gw_a.url + "/admin/replicas/extra") as response:
                assert response.status == 200
            await eventually(lambda: gw_b.fleet.get("extra") is None, what="b dropped extra")
            assert await backend(gw_b).read_registry() == {}
    finally:
        await delete_prefix(redis_server_url, prefix)


def _up(gateway: Gateway, replica_id: str) -> bool:
    replica = gateway.fleet.get(replica_id)
    return replica is not None and replica.up
