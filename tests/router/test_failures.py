"""Failures absorbed: killed replicas, 5xx, 429, stalls; 4xx never opens a circuit."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
from aiohttp import web

from router.fleet.circuit import CircuitState
from tests.conftest import free_port
from tests.router.conftest import (
    StartGateway,
    StartSim,
    StartUpstream,
    fast_config,
    wait_until,
)


async def _metric(http: aiohttp.ClientSession, url: str, prefix: str) -> float:
    """Sum of the samples of one series prefix in the gateway's /metrics."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))  # fmt: skip


async def test_replica_killed_under_load_then_readmitted(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    port = free_port()
    # The doomed replica serves 15 requests; the 16th kills it (every connection reset).
    doomed = await start_sim(port=port, time_scale=0.05, crash_after_requests=15)
    others = [await start_sim(time_scale=0.05, seed=i) for i in (1, 2)]
    # least_load: load balancing decides who serves, so the revived replica gets its turn
    gw = await start_gateway(
        fast_config([doomed.url, *(s.url for s in others)], policy="least_load")
    )
    statuses: Counter[int] = Counter()
    served: Counter[str] = Counter()

    async def client(worker: int) -> None:
        for i in range(10):
            async with http.post(
                gw.url + "/v1/completions",
                json={"prompt": f"w{worker} r{i}", "max_tokens": 30, "ignore_eos": True},
            ) as r:
                await r.read()
                statuses[r.status] += 1
                served[r.headers.get("x-fleet-replica", "none")] += 1

    await asyncio.gather(*(client(w) for w in range(12)))
    assert doomed.crashed
    assert statuses == {200: 120}  # zero client errors
    assert await _metric(http, gw.url, "fleet_router_retries_total") >= 1
    replica = gw.fleet.get(doomed.url)
    assert replica is not None
    await wait_until(lambda: not replica.up, 5)  # ejected
    assert await _metric(http, gw.url, f'fleet_router_replica_up{{replica="{doomed.url}"}}') == 0
    assert all(r.in_flight == 0 for r in gw.fleet)

    # It comes back on the same port: health checks and a half-open trial re-admit it.
    await doomed.stop()
    revived = await start_sim(port=port, time_scale=0.05, seed=9)
    assert revived.url == doomed.url
    await wait_until(lambda: replica.healthy, 5)
    back: set[str] = set()
    for i in range(40):
        async with http.post(gw.url + "/v1/completions",
                             json={"prompt": f"again {i}", "max_tokens": 2}) as r:  # fmt: skip
            assert r.status == 200
            back.add(r.headers["x-fleet-replica"])
        if revived.url in back:
            break
        await asyncio.sleep(0.05)
    assert revived.url in back
    assert replica.up and replica.circuit.state is CircuitState.CLOSED


async def test_replica_4xx_reaches_the_client_and_never_opens_the_circuit(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url], circuit_failure_threshold=2))
    for _ in range(10):
        async with http.post(gw.url + "/v1/completions",
                             json={"prompt": "x", "max_tokens": -1}) as r:  # fmt: skip
            assert r.status == 400
            assert r.headers["x-fleet-replica"] == sim.url  # the replica's own answer
            error = (await r.json())["error"]
            assert error["param"] == "max_tokens"
    replica = gw.fleet.get(sim.url)
    assert replica is not None
    assert replica.circuit.state is CircuitState.CLOSED
    assert replica.circuit.consecutive_failures == 0 and replica.up
    assert await _metric(http, gw.url, "fleet_router_upstream_errors_total") == 0
    assert await _metric(http, gw.url, "fleet_router_retries_total") == 0
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200


async def test_5xx_is_retried_elsewhere_and_opens_the_circuit(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    broken = await start_sim(failure_rate=1.0)
    good = await start_sim(seed=1)
    gw = await start_gateway(fast_config([broken.url, good.url], policy="round_robin",
                                         circuit_open_s=60))  # fmt: skip
    for i in range(20):
        async with http.post(gw.url + "/v1/completions",
                             json={"prompt": f"{i}", "max_tokens": 1}) as r:  # fmt: skip
            assert r.status == 200
            assert r.headers["x-fleet-replica"] == good.url
    replica = gw.fleet.get(broken.url)
    assert replica is not None and replica.circuit.state is CircuitState.OPEN
    # Threshold 2: exactly two failed attempts, then the circuit keeps traffic away.
    errors = f'fleet_router_upstream_errors_total{{kind="status_5xx",replica="{broken.url}"}}'
    assert await _metric(http, gw.url, errors) == 2
    assert await _metric(http, gw.url, "fleet_router_retries_total{model=") == 2
    assert await _metric(http, gw.url, f'fleet_router_circuit_state{{replica="{broken.url}"}}') == 2

    only_broken = await start_gateway(fast_config([broken.url]))
    async with http.post(only_broken.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 502
        error = (await r.json())["error"]
        assert error["type"] == "upstream_error" and "answered 500" in error["message"]


async def test_stall_before_first_byte_times_out_and_retries(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    stalled = await start_sim(stall_before_first_byte_s=10)
    good = await start_sim(seed=1)
    gw = await start_gateway(fast_config([stalled.url, good.url], policy="round_robin",
                                         first_byte_timeout_s=0.3))  # fmt: skip
    for i in range(4):
        async with http.post(
            gw.url + "/v1/completions",
            json={"prompt": f"{i}", "max_tokens": 1, "stream": i % 2 == 0},
        ) as r:
            assert r.status == 200
            assert r.headers["x-fleet-replica"] == good.url
            await r.read()
    assert await _metric(http, gw.url, "fleet_router_retries_total{model=") >= 1
    kind = (
        f'fleet_router_upstream_errors_total{{kind="timeout_first_byte",replica="{stalled.url}"}}'
    )
    assert await _metric(http, gw.url, kind) >= 1

    alone = await start_gateway(fast_config([stalled.url], first_byte_timeout_s=0.3))
    async with http.post(alone.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 504
        assert (await r.json())["error"]["code"] == "gateway_timeout"
    assert all(r.in_flight == 0 for r in alone.fleet)


async def test_unreachable_replica_is_never_routed_to(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    good = await start_sim()
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await start_gateway(fast_config([dead, good.url], policy="round_robin"))
    for i in range(6):
        async with http.post(gw.url + "/v1/completions",
                             json={"prompt": f"{i}", "max_tokens": 1}) as r:  # fmt: skip
            assert r.status == 200 and r.headers["x-fleet-replica"] == good.url
    assert await _metric(http, gw.url, "fleet_router_upstream_errors_total") == 0


async def test_429_is_retried_elsewhere_and_passed_through_when_all_are_saturated(
    start_upstream: StartUpstream, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    async def saturated(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "slow down", "type": "rate_limit", "param": None, "code": 429}},
            status=429,
            headers={"Retry-After": "2"},
        )

    async def fine(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    busy, ok = await start_upstream(saturated), await start_upstream(fine)
    gw = await start_gateway(fast_config([busy, ok], policy="round_robin"))
    for _ in range(4):
        async with http.post(gw.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200 and r.headers["x-fleet-replica"] == ok
    replica = gw.fleet.get(busy)
    assert replica is not None and replica.circuit.state is CircuitState.CLOSED

    alone = await start_gateway(fast_config([busy]))
    async with http.post(alone.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 429
        assert r.headers["Retry-After"] == "2"
        assert (await r.json())["error"]["message"] == "slow down"
