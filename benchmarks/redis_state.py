"""Shared state in Redis: what it costs per request, and how fast a new instance warms up.

    python benchmarks/redis_state.py            # full run (about a minute)
    python benchmarks/redis_state.py --quick    # smaller, for a smoke check
    python benchmarks/redis_state.py --only request-path --replicas 4,64

Uses REDIS_URL when set, else starts a private redis-server on a free port.

1. Request-path cost: the side effects the routing core adds per request for shared state
   (`StateSync.routed` after the decision, `StateSync.completed` after the response), with the
   in-process backend and with the Redis backend (its flusher and reader running on the same
   event loop), 8k-token prompts of a shared-prefix workload, for each fleet size in
   `--replicas` (work that grows with the fleet shows up there).  Also the whole process CPU per
   request, background flushing included.
2. End to end through a gateway: the same requests, one at a time, alternating between a gateway
   with the in-process backend and one with the Redis backend, in front of the same fast sim
   replicas; client-side latency p50/p99 and the difference.
3. Warm-up: an instance has 100k blocks indexed; a new instance joins (snapshot + stream tail)
   and, for comparison, one replays the whole change stream without a snapshot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import aiohttp
import redis.asyncio as aioredis

from loadtest.routing_node import RoutingNode, routing_node
from replicas.sim import SimSettings, running_replica
from router.app import running_gateway
from router.config import ReplicaSpec, RouterConfig
from router.policies.base import RoutingRequest
from router.prefix.index import IndexSettings
from router.state import MemoryBackend, RedisBackend, RedisSettings, StateBackend

REPLICAS = ("r0", "r1", "r2", "r3")
MODEL = "m"


@contextlib.asynccontextmanager
async def redis_url() -> AsyncIterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no Redis: set REDIS_URL or put redis-server on PATH")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir]
        proc = await asyncio.create_subprocess_exec(
            binary, *args, stdout=asyncio.subprocess.DEVNULL
        )
        try:
            url = f"redis://127.0.0.1:{port}/0"
            for _ in range(100):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                await asyncio.sleep(0.05)
            yield url
        finally:
            proc.terminate()
            await proc.wait()


def specs(replicas: Sequence[str]) -> tuple[ReplicaSpec, ...]:
    return tuple(
        ReplicaSpec(rid, f"http://127.0.0.1:{40000 + i}") for i, rid in enumerate(replicas)
    )


def make_node(
    backend: StateBackend, capacity_blocks: int, replicas: Sequence[str] = REPLICAS
) -> RoutingNode:
    index = IndexSettings(default_capacity_blocks=capacity_blocks, max_blocks=10**7)
    return routing_node(backend, specs(replicas), policy="round_robin", index=index)


def workload(
    seed: int, groups: int, per_group: int, prefix_blocks: int, own_blocks: int
) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        system = tuple(rng.getrandbits(64) for _ in range(prefix_blocks))
        for _ in range(per_group):
            out.append(system + tuple(rng.getrandbits(64) for _ in range(own_blocks)))
    rng.shuffle(out)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def request_path(url: str, requests: int, fleet_sizes: Sequence[int]) -> None:
    print("\n## 1. request-path cost of the state backend (8k-token prompts, 512 blocks)")
    prompts = workload(seed=1, groups=32, per_group=max(1, requests // 32), prefix_blocks=480,
                       own_blocks=32)  # fmt: skip
    rows = []
    for size in fleet_sizes:
        replicas = tuple(f"r{i}" for i in range(size))
        for kind in ("memory", "redis"):
            rows.append((size, kind, *await _request_path_run(url, kind, replicas, prompts)))
    print(
        "| replicas | backend | hooks p50 µs | hooks p99 µs"
        " | CPU µs/request (index, hooks, background) |"
    )
    print("|---|---|---|---|---|")
    for size, kind, p50, p99, cpu_us in rows:
        print(f"| {size} | {kind} | {p50:.1f} | {p99:.1f} | {cpu_us:.0f} |")
    for i in range(0, len(rows), 2):
        added = rows[i + 1][2] - rows[i][2]
        print(
            f"{rows[i][0]} replicas: added p50 on the request path (redis - memory): {added:.1f} µs"
        )


async def _request_path_run(
    url: str, kind: str, replicas: Sequence[str], prompts: list[tuple[int, ...]]
) -> tuple[float, float, float]:
    """(hooks p50 µs, hooks p99 µs, process CPU µs per request) for one backend and fleet."""
    prefix = f"bench-{os.getpid()}-{kind}:"
    backend: StateBackend = (
        MemoryBackend()
        if kind == "memory"
        else RedisBackend(RedisSettings(url=url, key_prefix=prefix))
    )
    node = make_node(backend, capacity_blocks=1 << 20, replicas=replicas)
    await backend.start(node.sync)
    samples: list[float] = []
    cpu0 = time.process_time()
    for i, hashes in enumerate(prompts):
        rid = replicas[i % len(replicas)]
        request = RoutingRequest(
            model=MODEL,
            block_hashes=hashes,
            prompt_units=len(hashes) * 64,
            prompt_tokens=len(hashes) * 16,
        )
        matched = node.index.match(MODEL, hashes).get(rid, 0)
        node.index.insert(MODEL, hashes, rid)
        t0 = time.perf_counter_ns()
        node.sync.routed(request, rid, matched)
        node.sync.completed(request, rid)
        samples.append((time.perf_counter_ns() - t0) / 1000)
        if i % 8 == 7:
            await asyncio.sleep(0.001)  # requests arrive over time; background work runs
    await backend.flush()
    cpu = time.process_time() - cpu0
    await backend.stop()
    if isinstance(backend, RedisBackend):
        await _drop(url, prefix)
    return pct(samples, 0.5), pct(samples, 0.99), cpu / len(prompts) * 1e6


async def end_to_end(url: str, rounds: int) -> None:
    print("\n## 2. end to end through a gateway (1 fast sim replica x 4, sequential requests)")
    rng = random.Random(2)
    systems = [" ".join(f"w{rng.randrange(10_000)}" for _ in range(1_200)) for _ in range(8)]
    prompts = [f"{rng.choice(systems)} question {i}" for i in range(rounds)]
    sims = []
    async with contextlib.AsyncExitStack() as stack:
        for i in range(4):
            sims.append(
                await stack.enter_async_context(
                    running_replica(SimSettings(port=0, model="sim-model", seed=i, time_scale=1e-4))
                )
            )
        replicas = tuple(f"r{i}={s.url}" for i, s in enumerate(sims))
        prefix = f"bench-{os.getpid()}-e2e:"
        base = RouterConfig(
            host="127.0.0.1",
            port=0,
            replicas=replicas,
            sim_replicas=0,
            policy="kv_aware",
            seed=1,
            health_interval_s=0.5,
            scrape_interval_s=0.5,
        )
        gw_mem = await stack.enter_async_context(running_gateway(base))
        gw_red = await stack.enter_async_context(
            running_gateway(replace(base, redis_url=url, redis_prefix=prefix))
        )
        for _ in range(200):
            if all(r.up for g in (gw_mem, gw_red) for r in g.fleet):
                break
            await asyncio.sleep(0.05)
        latencies: dict[str, list[float]] = {"memory": [], "redis": []}
        pair_diffs: list[float] = []  # per pair of adjacent blocks: median(redis) - median(memory)
        # Blocks of 20 requests per gateway, alternating, so that a gateway's background work
        # (its Redis flushes land a few ms after a request) is paid by its own requests, and
        # the difference is taken between adjacent blocks (robust to drift on a busy machine).
        block = 20
        async with aiohttp.ClientSession() as session:
            for start in range(0, len(prompts), block):
                order = [("memory", gw_mem), ("redis", gw_red)]
                if (start // block) % 2:
                    order.reverse()
                medians: dict[str, float] = {}
                for kind, gateway in order:
                    values = []
                    for i, prompt in enumerate(prompts[start : start + block]):
                        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1}
                        t0 = time.perf_counter()
                        endpoint = gateway.url + "/v1/completions"
                        async with session.post(endpoint, json=body) as resp:
                            await resp.read()
                            assert resp.status == 200, resp.status
                        if start > 0 and i > 0:  # first block and block switches: warm-up
                            values.append((time.perf_counter() - t0) * 1000)
                    if values:
                        latencies[kind] += values
                        medians[kind] = statistics.median(values)
                if len(medians) == 2:
                    pair_diffs.append(medians["redis"] - medians["memory"])
        await _drop(url, prefix)
    print("| gateway backend | p50 ms | p99 ms |")
    print("|---|---|---|")
    for kind, values in latencies.items():
        print(f"| {kind} | {pct(values, 0.5):.3f} | {pct(values, 0.99):.3f} |")
    added = statistics.median(pair_diffs) * 1000
    print(
        f"added p50 end to end (redis - memory, median over {len(pair_diffs)} block pairs):"
        f" {added:.0f} µs"
    )


async def warm_up(url: str, blocks_target: int) -> None:
    print(f"\n## 3. warm-up of a new instance with ~{blocks_target // 1000}k blocks indexed")
    prefix = f"bench-{os.getpid()}-warm:"
    settings = RedisSettings(url=url, key_prefix=prefix, stream_maxlen=1_000_000,
                             snapshot_interval_s=3600, max_pending_changes=10**6,
                             warmup_timeout_s=600)  # fmt: skip
    # groups of a 100-block system prompt + 25 prompts with 16 private blocks: 500 blocks/group
    groups = max(1, blocks_target // 500)
    prompts = workload(seed=3, groups=groups, per_group=25, prefix_blocks=100, own_blocks=16)
    a = make_node(RedisBackend(settings, instance_id="writer"), capacity_blocks=1 << 20)
    await a.backend.start(a.sync)
    for i, hashes in enumerate(prompts):
        rid = REPLICAS[(i * 7) % 4]
        request = RoutingRequest(model=MODEL, block_hashes=hashes, prompt_tokens=len(hashes) * 16)
        a.index.insert(MODEL, hashes, rid)
        a.sync.routed(request, rid, 0)
        if i % 200 == 199:
            await a.backend.flush()
    await a.backend.flush()
    assert isinstance(a.backend, RedisBackend)
    await a.backend.wait_caught_up(timeout_s=60)
    t0 = time.perf_counter()
    await a.backend.write_snapshot()
    snapshot_s = time.perf_counter() - t0
    client = aioredis.Redis.from_url(url)
    snapshot_bytes = await client.strlen(a.backend.keys.snapshot)
    tail = workload(seed=4, groups=4, per_group=25, prefix_blocks=100, own_blocks=16)
    for i, hashes in enumerate(tail):
        rid = REPLICAS[i % 4]
        a.index.insert(MODEL, hashes, rid)
        a.sync.routed(RoutingRequest(model=MODEL, block_hashes=hashes), rid, 0)
    await a.backend.flush()
    stream_entries = await client.xlen(a.backend.keys.changes)
    blocks = a.index.blocks

    async def join(instance_id: str) -> tuple[float, bool]:
        """A new instance starts: (seconds to warm up, whether it holds what `a` holds)."""
        node = make_node(RedisBackend(settings, instance_id=instance_id), capacity_blocks=1 << 20)
        t0 = time.perf_counter()
        await node.backend.start(node.sync)
        took_s = time.perf_counter() - t0
        same = node.index.stats().held_blocks == a.index.stats().held_blocks
        await node.backend.stop()
        return took_s, same

    join_s, same = await join("joiner")
    await client.delete(a.backend.keys.snapshot)
    replay_s, same_replay = await join("replayer")
    await a.backend.stop()
    await client.aclose()
    await _drop(url, prefix)
    mb = snapshot_bytes / 1e6
    rows = [
        ("blocks indexed (trie nodes)", f"{blocks:,}"),
        ("change-stream entries / prompts", f"{stream_entries:,} / {len(prompts) + len(tail):,}"),
        ("snapshot: fill + encode + SET", f"{snapshot_s * 1000:.0f} ms, {mb:.2f} MB"),
        (f"join: snapshot + {len(tail)}-prompt tail", f"{join_s * 1000:.0f} ms (same: {same})"),
        ("join without snapshot: replay", f"{replay_s * 1000:.0f} ms (same: {same_replay})"),
    ]
    print("| figure | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


async def _drop(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


SECTIONS = ("request-path", "end-to-end", "warm-up")


async def _main(args: argparse.Namespace) -> None:
    sections = args.only or SECTIONS
    async with redis_url() as url:
        print(f"Redis: {url}")
        if "request-path" in sections:
            sizes = [int(n) for n in args.replicas.split(",")]
            await request_path(url, 640 if args.quick else 4_000, sizes)
        if "end-to-end" in sections:
            await end_to_end(url, 60 if args.quick else 1_000)
        if "warm-up" in sections:
            await warm_up(url, 10_000 if args.quick else 100_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section")
    parser.add_argument(
        "--replicas", default="4,64", help="fleet sizes of the request-path section (comma list)"
    )
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
