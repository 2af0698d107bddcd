"""Fault injection: reproducible 5xx, a stall before the first byte, a crash after N requests."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from replicas.sim.faults import FaultInjector, decide
from tests.replicas.conftest import StartReplica


def _failures(seed: int, rate: float, n: int) -> list[bool]:
    return [
        decide(i, seed=seed, failure_rate=rate, stall_before_first_byte_s=0.0,
               crash_after_requests=None).fail
        for i in range(1, n + 1)
    ]  # fmt: skip


def test_failure_decisions_are_reproducible_and_follow_the_rate() -> None:
    a = _failures(seed=1, rate=0.2, n=2000)
    assert a == _failures(seed=1, rate=0.2, n=2000)
    assert a != _failures(seed=2, rate=0.2, n=2000)
    assert 0.16 < sum(a) / len(a) < 0.24
    assert not any(_failures(seed=1, rate=0.0, n=100))
    assert all(_failures(seed=1, rate=1.0, n=100))


def test_crash_decision_and_counter() -> None:
    injector = FaultInjector(crash_after_requests=2)
    assert [injector.next_request().crash for _ in range(4)] == [False, False, True, True]
    assert not FaultInjector().enabled


async def test_failure_rate_gives_openai_500s_on_the_predicted_requests(
    sim_replica: StartReplica,
) -> None:
    replica = await sim_replica(failure_rate=0.5, seed=3)
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(16):
            body = {"prompt": "hello", "max_tokens": 2}
            async with s.post(f"{replica.url}/v1/completions", json=body) as r:
                statuses.append(r.status)
                if r.status == 500:
                    error = json.loads(await r.read())["error"]
                    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert statuses == [500 if f else 200 for f in _failures(seed=3, rate=0.5, n=16)]
    assert 0 < statuses.count(500) < 16
    assert replica.engine.stats().num_running == 0


async def test_stall_before_first_byte(sim_replica: StartReplica) -> None:
    replica = await sim_replica(stall_before_first_byte_s=0.4)
    body = {"prompt": "hello", "max_tokens": 2, "stream": True}
    async with aiohttp.ClientSession() as s:
        started = time.monotonic()
        async with s.post(f"{replica.url}/v1/completions", json=body) as r:
            headers_after = time.monotonic() - started
            assert r.status == 200
            await r.read()
        assert headers_after >= 0.4  # nothing at all was sent before the stall ended
        # a client that gives up during the stall leaves nothing behind in the engine
        task = asyncio.create_task(s.post(f"{replica.url}/v1/completions", json=body))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The next request stalls as long and only then reaches the engine: once it is served,
        # a handler that had not been cancelled would have reached the engine too (an event,
        # not a guess at how long a busy machine takes).
        async with s.post(f"{replica.url}/v1/completions", json=body) as r:
            assert r.status == 200
            await r.read()
    stats = replica.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    served = sum(
        sample.value
        for family in replica.registry.collect()
        if family.name == "vllm:request_success"
        for sample in family.samples
        if sample.name.endswith("_total")
    )
    assert served == 2  # the first and the last; the cancelled one never reached the engine


async def test_crash_after_n_requests_kills_the_listener_and_streams(
    sim_replica: StartReplica,
) -> None:
    replica = await sim_replica(crash_after_requests=2, time_scale=1.0)
    long_body = {"prompt": "a long one", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        streaming = await s.post(f"{replica.url}/v1/completions", json=long_body)  # request 1
        await streaming.content.readuntil(b"\n\n")
        async with s.post(
            f"{replica.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}
        ) as r:
            assert r.status == 200  # request 2
        with pytest.raises(aiohttp.ClientError):  # request 3: the replica dies
            async with s.post(
                f"{replica.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}
            ) as r:
                await r.read()
        with pytest.raises(aiohttp.ClientError):  # the in-flight stream was cut, not finished
            async with asyncio.timeout(5):
                while True:
                    line = await streaming.content.readuntil(b"\n\n")
                    assert line != b"data: [DONE]\n\n"
        streaming.close()
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectorError):  # nothing listens any more
            await s.get(f"{replica.url}/health")
    assert replica.crashed
    async with asyncio.timeout(5):
        while replica.engine.stats().num_running:  # noqa: ASYNC110 - engine state has no event
            await asyncio.sleep(0.01)
