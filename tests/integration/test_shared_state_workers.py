"""`fleet-router serve --workers N`: N processes on one port, sharing state through Redis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from replicas.sim import SimSettings, running_replica
from router.cli import main
from router.state import KeySchema
from tests.conftest import free_port
from tests.router.state.support import delete_prefix, eventually, unique_prefix


def test_workers_without_redis_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--workers", "2", "--replica", "http://127.0.0.1:9"])
    assert code == 2
    err = capsys.readouterr().err
    assert "workers = 2 needs --redis-url" in err


async def test_two_worker_processes_share_one_port_and_redis(redis_server_url: str) -> None:
    prefix = unique_prefix()
    port = free_port()
    async with running_replica(SimSettings(port=0, model="sim-model", time_scale=0.002)) as sim:
        args = ["-m", "router", "serve", "--workers", "2", "--host", "127.0.0.1"]
        args += ["--port", str(port), "--replica", f"r0={sim.url}", "--policy", "kv_aware"]
        args += ["--redis-url", redis_server_url, "--redis-prefix", prefix]
        args += ["--health-interval-s", "0.2", "--scrape-interval-s", "0.2"]
        args += ["--drain-timeout-s", "2"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        client = aioredis.Redis.from_url(redis_server_url)
        keys = KeySchema(prefix)
        try:

            async def serving() -> bool:
                # A worker's heartbeat appears while it starts up (state warm-up runs before the
                # socket is bound): ready means both heartbeats are there *and* both of those
                # processes listen on the port, so no connection can be refused from here on.
                pids = await _instance_pids(client, keys)
                workers = set(pids.values())
                return len(workers) == 2 and _listening_pids(port, workers) == workers

            await eventually(serving, timeout_s=60, what="2 workers live and listening")
            instance_ids = set((await _instance_pids(client, keys)).keys())
            # a new connection per request, so the kernel spreads them over both processes
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def one(i: int) -> int:
                    prompt = f"shared system prompt number {i % 3}. " * 8 + f"question {i}"
                    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
                    url = f"http://127.0.0.1:{port}/v1/completions"
                    async with session.post(url, json=body) as response:
                        await response.read()
                        return response.status

                await eventually(lambda: _equals(one(0), 200), timeout_s=30, what="workers ready")
                statuses = [await one(i) for i in range(1, 41)]
            assert statuses == [200] * 40

            async def counted() -> int:
                total = 0
                for rid in await client.smembers(keys.counter_replicas):
                    total += int(await client.hget(keys.counters(rid.decode()), "requests") or 0)
                return total

            await eventually(lambda: _equals(counted(), 41), timeout_s=10, what="counters")
            # both processes took requests: each published index changes to the shared stream
            origins = {
                fields[b"o"].decode()
                for _id, fields in await client.xrange(keys.changes, count=1000)
            }
            assert origins == instance_ids
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(30):
                    _out, err = await proc.communicate()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            await client.aclose()
        assert proc.returncode == 0, err.decode()
        assert await _instances_left(redis_server_url, keys) == 0  # heartbeats removed on exit
        await delete_prefix(redis_server_url, prefix)


async def _equals(value: object, expected: object) -> bool:
    return await value == expected  # type: ignore[misc]


async def _instance_pids(client: aioredis.Redis, keys: KeySchema) -> dict[str, int]:
    """Live instance id → its process id, from the heartbeat hashes."""
    out: dict[str, int] = {}
    head = len(keys.instance(""))
    async for key in client.scan_iter(match=keys.instance_pattern):
        pid = await client.hget(key, "pid")
        if pid is not None:
            out[key.decode()[head:]] = int(pid)
    return out


def _listening_pids(port: int, pids: Iterable[int]) -> set[int]:
    """Those of `pids` holding a TCP socket that listens on 127.0.0.1:`port` (Linux /proc)."""
    listening: set[str] = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                listening.add(f"socket:[{inode}]")
    found: set[int] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        with contextlib.suppress(OSError):  # the process may just have exited
            if any(os.readlink(fd) in listening for fd in fd_dir.iterdir()):
                found.add(pid)
    return found


async def _instances_left(url: str, keys: KeySchema) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        return len([k async for k in client.scan_iter(match=keys.instance_pattern)])
    finally:
        await client.aclose()
