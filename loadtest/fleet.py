"""What a comparison runs against: simulated replicas and a router in front of them, in-process.

:func:`running_fleet` starts the replicas, :func:`running_ready_gateway` our gateway (yielded
once it knows every replica's KV capacity), :func:`running_peer_router` a peer's router
(sglang-router, vllm-router) as a subprocess.  ``fleet-loadtest compare``, the demo,
:mod:`loadtest.quality` and through it ``benchmarks/routing_quality.py`` and the integration
tests start what they measure here, so they all measure it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from router.app import Gateway
    from router.config import RouterConfig

__all__ = [
    "FleetSettings",
    "capacity_known",
    "running_fleet",
    "running_peer_router",
    "running_ready_gateway",
]


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """The simulated fleet to start (ignored when ``replicas`` are given)."""

    count: int = 4
    time_scale: float = 0.05
    num_gpu_blocks: int | None = None
    seed: int = 0  # replica i gets seed + i
    extra: tuple[tuple[str, Any], ...] = ()  # more SimSettings fields, the same for every replica
    replicas: tuple[str, ...] = ()  # existing replicas to use instead of fresh ones


@asynccontextmanager
async def running_fleet(fleet: FleetSettings) -> AsyncIterator[tuple[str, ...]]:
    """The replicas' base URLs: ``fleet.replicas`` as given, or fresh sim replicas stopped on
    exit."""
    if fleet.replicas:
        yield fleet.replicas
        return
    # Imported here: a run against existing replicas needs no simulator.
    from replicas.sim import SimSettings, running_replica

    async with AsyncExitStack() as stack:
        urls = []
        for i in range(fleet.count):
            sim = SimSettings(
                port=0,
                time_scale=fleet.time_scale,
                num_gpu_blocks=fleet.num_gpu_blocks,
                seed=fleet.seed + i,
            )
            if fleet.extra:
                sim = sim.replace(**dict(fleet.extra))
            replica = await stack.enter_async_context(running_replica(sim))
            urls.append(replica.url)
        yield tuple(urls)


async def capacity_known(gateway: Gateway, timeout_s: float = 10.0) -> bool:
    """Wait until the gateway has read every replica's KV capacity from its ``/metrics``.

    Policies that weigh cache pressure route blind until then.  False after ``timeout_s``
    (replicas that do not export it, e.g. an old vLLM).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not all(r.stats.num_gpu_blocks for r in gateway.fleet):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@asynccontextmanager
async def running_ready_gateway(config: RouterConfig) -> AsyncIterator[Gateway]:
    """Our gateway for ``config``, yielded once it knows the replicas' KV capacity (or after
    :func:`capacity_known`'s timeout, so a fleet that does not export it still runs)."""
    from router.app import running_gateway

    async with running_gateway(config) as gateway:
        await capacity_known(gateway)
        yield gateway


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _peer_ready(
    url: str, workers: int, timeout_s: float, proc: asyncio.subprocess.Process
) -> None:
    """Ready when every worker is registered and healthy (registration is asynchronous, and
    ``/health`` answers before it is done); a router without ``/workers``: when healthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"exited with status {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with session.get(url + "/workers") as response:
                    if response.status == 200:
                        listed = (await response.json()).get("workers", [])
                        if sum(1 for w in listed if w.get("is_healthy")) >= workers:
                            return
                    elif response.status == 404:
                        async with session.get(url + "/health") as health:
                            if health.status == 200:
                                return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"not ready after {timeout_s:.0f}s")


@asynccontextmanager
async def running_peer_router(
    module: str,
    policy: str,
    workers: Sequence[str],
    *,
    log_path: str,
    python: str = sys.executable,
    ready_timeout_s: float = 60.0,
) -> AsyncIterator[str]:
    """A peer router (``python -m <module>.launch_router``, e.g. ``sglang_router``) with
    ``policy`` in front of ``workers``; yields its URL once every worker is registered.

    ``python`` may be another venv's.  It never downloads: ``HF_ENDPOINT`` points at a closed
    local port.  Its output goes to ``log_path``.
    """
    port = _free_port()
    # PYTHONPATH is ours, not the peer's (its python may be another venv's).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    args = [
        python, "-m", f"{module}.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
        "--worker-urls", *workers,
    ]  # fmt: skip
    log = await asyncio.to_thread(open, log_path, "wb")
    try:
        proc = await asyncio.create_subprocess_exec(*args, stdout=log, stderr=log, env=env)
    finally:
        log.close()  # the child keeps its own descriptor
    url = f"http://127.0.0.1:{port}"
    try:
        await _peer_ready(url, len(workers), ready_timeout_s, proc)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
