"""Graceful drain, the embedded default via the CLI (SIGTERM), and 1k concurrent requests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import aiohttp

from router.app import running_gateway
from tests.conftest import free_port
from tests.router.conftest import StartGateway, StartSim, fast_config

ROOT = Path(__file__).resolve().parents[2]
STREAM = {"prompt": "x", "stream": True, "max_tokens": 300, "ignore_eos": True}


async def _refused(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(url + "/health"):
            return False
    except aiohttp.ClientConnectionError:
        return True


async def test_drain_lets_in_flight_streams_finish_and_refuses_new_connections(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(time_scale=0.1)  # 300 tokens ≈ a quarter of a second
    async with running_gateway(fast_config([sim.url], drain_timeout_s=10)) as gw:
        resp = await http.post(gw.url + "/v1/completions", json=STREAM)
        first = await resp.content.readany()
        reader = asyncio.create_task(resp.content.read())
        url = gw.url

        async def probe() -> bool:
            await asyncio.sleep(0.05)  # the gateway is draining by now
            return await _refused(url)

        refused_while_draining = asyncio.create_task(probe())
    # Leaving the block returned only once the in-flight stream had finished.
    body = first + await asyncio.wait_for(reader, 1)
    resp.close()
    assert body.endswith(b"data: [DONE]\n\n")
    assert body.count(b"data: ") == 301  # 300 token events (the last one final) and [DONE]
    assert await refused_while_draining


async def test_cli_embedded_default_and_sigterm_drain(http: aiohttp.ClientSession) -> None:
    """`fleet-router serve` with no replica: 4 in-process sims; SIGTERM drains a live stream."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEET_ROUTER_SIM_TIME_SCALE": "0.1"}
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once; waited for off the loop below
        [sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                async with http.get(url + "/ready") as r:
                    if r.status == 200:
                        ready = await r.json()
                        break
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the embedded default never became ready")
        assert sum(ready["models"].values()) == 4  # four sim replicas serve the model
        resp = await http.post(url + "/v1/completions", json=STREAM)
        assert resp.status == 200
        first = await resp.content.readany()
        proc.send_signal(signal.SIGTERM)
        body = first + await asyncio.wait_for(resp.content.read(), 10)
        resp.close()
        assert body.endswith(b"data: [DONE]\n\n")
        code = await asyncio.to_thread(proc.wait, 20)
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log = proc.communicate(timeout=10)[0].decode()  # also closes the pipe
    assert "no replica configured: started 4 simulated replicas in-process" in log
    assert "draining" in log


async def test_a_thousand_concurrent_streams(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sims = [await start_sim(seed=i) for i in range(4)]
    gw = await start_gateway(fast_config([s.url for s in sims]))
    results: Counter[str] = Counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> None:
            body = {"prompt": f"request {i}", "stream": True, "max_tokens": 4, "ignore_eos": True}
            async with session.post(gw.url + "/v1/completions", json=body) as r:
                raw = await r.read()
                ok = r.status == 200 and raw.endswith(b"data: [DONE]\n\n")
                results["ok" if ok else f"bad {r.status}"] += 1
                results[r.headers.get("x-fleet-replica", "none")] += 0

        await asyncio.gather(*(one(i) for i in range(1000)))
    assert results["ok"] == 1000, results
    assert all(r.in_flight == 0 for r in gw.fleet)
    assert {r.replica_id for r in gw.fleet} == {s.url for s in sims}
