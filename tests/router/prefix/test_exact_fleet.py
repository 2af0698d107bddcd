"""Exact mode and fleet membership: a replica removed through the admin API stops being consumed
(its KV events no longer reach the index), while the other replicas' events still do."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from router.app import KV_EVENTS
from tests.router.conftest import StartGateway, StartSim, fast_config, wait_until

MODEL = "sim-model"
AUTH = {"Authorization": "Bearer s3cret"}


def _prompt(i: int) -> str:
    return f"document {i}: " + "lorem ipsum dolor sit amet " * 20  # ~30 blocks of 16 tokens


async def test_admin_removal_stops_the_replicas_kv_events(
    tmp_path: Path,
    start_sim: StartSim,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    sims = [
        await start_sim(
            model=MODEL, seed=i, kv_events_endpoint=f"ipc://{tmp_path}/kv{i}", num_gpu_blocks=256
        )
        for i in range(2)
    ]
    config = fast_config(
        [f"r{i}={s.url}" for i, s in enumerate(sims)],
        tokenizer="sim",
        block_units=16,
        kv_events=tuple(f"r{i}=ipc://{tmp_path}/kv{i}" for i in range(2)),
        admin_token="s3cret",
    )
    gw = await start_gateway(config)
    consumer = gw.app[KV_EVENTS]
    index = gw.state.core.prefix_index
    assert index is not None

    async def direct(sim_url: str, i: int) -> None:
        """A request straight to a replica: only its KV events can tell the index about it."""
        body = {"model": MODEL, "prompt": _prompt(i), "max_tokens": 1}
        async with http.post(sim_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200

    # Both replicas' events reach the index (a SUB socket misses what is published before its
    # subscription has propagated, so send until each replica's events have arrived).
    for i in range(0, 100, 2):
        await asyncio.gather(direct(sims[0].url, i), direct(sims[1].url, i + 1))
        if index.holds("r0") > 0 and index.holds("r1") > 0:
            break
        await asyncio.sleep(0.05)
    await wait_until(lambda: index.holds("r0") > 0 and index.holds("r1") > 0)

    async with http.delete(gw.url + "/admin/replicas/r1", headers=AUTH) as resp:
        assert resp.status == 200
    assert {s.replica_id for s in consumer.sources} == {"r0"}
    assert "r1" not in consumer.describe()
    assert index.holds("r1") == 0

    # r1 keeps publishing; r0 too.  Once r0's new batches are applied (and a little longer, as
    # both arrive over the same kind of socket), nothing of r1's has come back into the index.
    seq_r0 = consumer.stats["r0"].last_seq
    assert seq_r0 is not None
    await asyncio.gather(
        direct(sims[0].url, 200), direct(sims[1].url, 201), direct(sims[1].url, 202)
    )
    assert await consumer.wait_for_seq("r0", seq_r0 + 1, timeout_s=5)
    await asyncio.sleep(0.2)
    assert index.holds("r1") == 0
    assert index.holds("r0") > 0
