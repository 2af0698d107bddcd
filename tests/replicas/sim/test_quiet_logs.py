"""Clients that leave early, or do not speak HTTP/1.1, cost one debug line, not a traceback."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from replicas.sim import SimReplica
from tests.replicas.conftest import StartReplica


def _request(body: dict[str, object]) -> bytes:
    raw = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw


def _noisy(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def _engine_idle(replica: SimReplica) -> None:
    engine = replica.engine
    async with asyncio.timeout(10):
        while engine.has_unfinished():  # noqa: ASYNC110 - engine state has no event
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_gone_before_headers_is_quiet(
    sim_replica: StartReplica, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    replica = await sim_replica(time_scale=0.05)
    body = {"prompt": "hello " * 200, "max_tokens": 50, "ignore_eos": True, "stream": stream}
    for _ in range(20):
        # Send the request and half-close: the server sees EOF and closes the transport while
        # the handler is still tokenizing / queueing, i.e. before any header is written.
        reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
        writer.write(_request(body))
        writer.write_eof()
        await writer.drain()
        assert await reader.read() == b""  # closed without an answer
        writer.close()
        await writer.wait_closed()
    await _engine_idle(replica)
    assert _noisy(caplog) == []
    assert replica.engine.stats().num_used_blocks == 0  # every request was aborted and freed


async def test_http2_preface_probe_is_quiet(
    sim_replica: StartReplica, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    replica = await sim_replica()
    reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # HTTP/2 with prior knowledge
    await writer.drain()
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
    assert _noisy(caplog) == []
    (line,) = [r for r in caplog.records if r.name == "replicas.sim.http"]
    assert line.levelno == logging.DEBUG and "BadHttpMessage" in line.getMessage()
    assert "\n" not in line.getMessage()
    # and the replica still serves HTTP/1.1
    reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.1 200")
    writer.close()
    await writer.wait_closed()
