"""Fixtures for the gateway tests: real sim replicas and real gateways on 127.0.0.1."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replicas.sim import SimReplica, SimSettings, start_replica
from router.app import Gateway, running_gateway
from router.config import RouterConfig
from tests.router.state.support import eventually

# Sim replicas run this many times faster than the modelled GPU: requests take milliseconds.
FAST = 0.002

StartSim = Callable[..., Awaitable[SimReplica]]
StartGateway = Callable[..., Awaitable[Gateway]]


def fast_config(replicas: list[str] | tuple[str, ...], **overrides: Any) -> RouterConfig:
    """Gateway settings for tests: quick health checks, scrapes, circuit and backoff."""
    settings: dict[str, Any] = {
        "replicas": tuple(replicas),
        "sim_replicas": 0,
        "health_interval_s": 0.1,
        "health_timeout_s": 1.0,
        "scrape_interval_s": 0.1,
        "circuit_failure_threshold": 2,
        "circuit_open_s": 0.3,
        "retry_backoff_base_s": 0.001,
        "retry_backoff_max_s": 0.005,
        "drain_timeout_s": 5.0,
        "seed": 7,
    }
    settings.update(overrides)
    return RouterConfig(**settings)


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """Start sim replicas (`await start_sim(model=..., ...)`); all are stopped at teardown."""
    started: list[SimReplica] = []

    async def start(**settings: Any) -> SimReplica:
        settings.setdefault("port", 0)
        settings.setdefault("time_scale", FAST)
        replica = await start_replica(SimSettings(**settings))
        started.append(replica)
        return replica

    yield start
    for replica in reversed(started):
        await replica.stop()


@pytest.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    """Start gateways (`await start_gateway(config)`); all are stopped at teardown."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(config: RouterConfig) -> Gateway:
            return await stack.enter_async_context(running_gateway(config))

        yield start


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
StartUpstream = Callable[[Handler], Awaitable[str]]


@pytest.fixture
async def start_upstream() -> AsyncIterator[StartUpstream]:
    """Start a minimal scripted upstream (/health, /v1/models listing `scripted`, and the given
    handler on /v1/completions) for behaviours a sim replica cannot produce on demand, such as
    a stream that stalls mid-way.  Returns its base URL."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        async def health(request: web.Request) -> web.Response:
            return web.Response()

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "scripted"}]})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `predicate` until true; fail the test after `timeout_s` (one poller: `eventually`)."""
    await eventually(predicate, timeout_s)
