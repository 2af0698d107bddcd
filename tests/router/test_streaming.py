"""Streaming passthrough: unbuffered, aborted upstream on disconnect, broken streams end loudly."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson
from aiohttp import web

from tests.router.conftest import (
    StartGateway,
    StartSim,
    StartUpstream,
    fast_config,
    wait_until,
)

LONG = {"max_tokens": 4000, "ignore_eos": True}


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


async def test_stream_is_not_buffered(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """At real GPU speed (time_scale 1) 40 tokens take ~0.3 s; the client must see the first
    chunk near the start and many separate chunks over time, not one lump at the end."""
    sim = await start_sim(time_scale=1.0)
    gw = await start_gateway(fast_config([sim.url]))
    loop = asyncio.get_running_loop()
    started = loop.time()
    arrivals: list[float] = []
    raw = b""
    async with http.post(gw.url + "/v1/completions", json={"prompt": "tell me", "stream": True,
                         "max_tokens": 40, "ignore_eos": True}) as resp:  # fmt: skip
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for chunk in resp.content.iter_any():
            arrivals.append(loop.time() - started)
            raw += chunk
    total = arrivals[-1]
    assert raw.endswith(b"data: [DONE]\n\n")
    assert len(_events(raw)) >= 41
    assert len(arrivals) >= 20  # chunks arrive separately, as the replica emits them
    assert arrivals[0] < total / 4, (arrivals[0], total)


async def test_client_disconnect_aborts_upstream(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(time_scale=0.05)
    gw = await start_gateway(fast_config([sim.url]))
    replica = gw.fleet.get(sim.url)
    assert replica is not None
    for stream in (True, False):
        body = {"prompt": "a long one", "stream": stream, **LONG}
        task = asyncio.create_task(http.post(gw.url + "/v1/completions", json=body))
        if stream:
            resp = await task
            assert (await resp.content.readany()).startswith(b"data: ")
        await wait_until(lambda: sim.engine.stats().num_running == 1, 5)
        assert replica.in_flight == 1
        # The client goes away mid-generation.
        if stream:
            resp.close()
        else:
            task.cancel()
        await wait_until(lambda: sim.engine.stats().num_running == 0, 5)
        await wait_until(lambda: replica.in_flight == 0, 5)
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    assert 'status="499"} 2.0' in text


async def test_stream_broken_mid_way_ends_with_an_sse_error_event(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """The replica dies during a stream (request 2 makes it crash: every connection is reset):
    the client of the stream gets an SSE error event and [DONE], never silence."""
    sim = await start_sim(time_scale=0.05, crash_after_requests=1)
    gw = await start_gateway(fast_config([sim.url], max_retries=1))
    chat = {"messages": [{"role": "user", "content": "go"}], "stream": True, **LONG}
    async with http.post(gw.url + "/v1/chat/completions", json=chat) as resp:
        first = await resp.content.readany()
        assert first.startswith(b"data: ")
        async with http.post(gw.url + "/v1/completions", json={"prompt": "x"}) as second:
            # No other replica to retry on: 502 with an OpenAI-style body.
            assert second.status == 502
            assert (await second.json())["error"]["type"] == "upstream_error"
        rest = await resp.content.read()
    events = _events(first + rest)
    assert events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2].removeprefix(b"data: "))
    assert error["error"]["type"] == "upstream_error"
    assert "replica" in error["error"]["message"]
    for event in events[:-1]:  # every event before [DONE] is one complete JSON object
        orjson.loads(event.removeprefix(b"data: "))
    replica = gw.fleet.get(sim.url)
    assert replica is not None and replica.in_flight == 0


async def test_idle_timeout_mid_stream_ends_with_an_sse_error_event(
    start_upstream: StartUpstream, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """An upstream that goes silent mid-stream hits the idle timeout: error event, [DONE]."""

    async def stall(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi')  # half an event
        await asyncio.sleep(30)
        return resp

    url = await start_upstream(stall)
    gw = await start_gateway(fast_config([url], idle_timeout_s=0.3))
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        raw = await asyncio.wait_for(r.content.read(), 5)
    events = _events(raw)
    assert events[0] == b'data: {"choices": [{"text": "a"}]}'
    assert events[1] == b'data: {"choi'  # passed through as it came, then closed off
    error = orjson.loads(events[2].removeprefix(b"data: "))["error"]
    assert error["code"] == 504 and "idle" in error["message"]
    assert events[3] == b"data: [DONE]" and len(events) == 4
    async with http.get(gw.url + "/metrics") as resp:
        assert 'kind="timeout_idle"' in await resp.text()


async def test_plain_body_broken_mid_way_is_not_passed_off_as_complete(
    start_upstream: StartUpstream, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """A non-SSE answer cut short: the client must see an error, not a short 'complete' body."""

    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b'{"partial": ')
        await asyncio.sleep(30)
        return resp

    url = await start_upstream(cut)
    gw = await start_gateway(fast_config([url], idle_timeout_s=0.3))
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 200
        try:
            body = await asyncio.wait_for(r.read(), 5)
        except aiohttp.ClientPayloadError:
            body = None
    assert body is None


async def test_tcp_nodelay_on_the_client_socket(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """Nagle's algorithm would hold small SSE events back ~40 ms: the served socket disables it."""
    sim = await start_sim(time_scale=0.05)
    gw = await start_gateway(fast_config([sim.url]))
    body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    async with http.post(gw.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        await r.content.readany()
        # The stream is open: its connection is one of the edge server's.
        sockets = [conn.socket for conn in gw.edge.connections if conn.busy]
        flags = [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets if s]
        await r.read()
    assert flags and all(flag != 0 for flag in flags)


async def test_plain_bodies_pass_unchanged_whole_or_in_pieces(
    start_upstream: StartUpstream, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """A Content-Length answer that arrives at once goes out as one response; one that arrives
    in pieces is streamed through.  Either way the bytes and the end-to-end headers are the
    replica's, and the in-flight gauge follows the request."""
    payload = b'{"id": "cmpl-1",  "choices": [{"text": "caf\\u00e9"}], "odd":  1}'
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        pieces = request.query.get("pieces") == "1"
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "X-Extra": "a"})
        resp.content_length = len(payload)
        await resp.prepare(request)
        if pieces:
            await resp.write(payload[:10])
            await release.wait()
        await resp.write(payload[10:] if pieces else payload)
        await resp.write_eof()
        return resp

    url = await start_upstream(answer)
    gw = await start_gateway(fast_config([url], policy="round_robin"))
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 200 and await r.read() == payload
        assert r.headers["X-Extra"] == "a" and r.headers["x-fleet-replica"] == url
        assert r.headers["Content-Length"] == str(len(payload))
    async with http.post(gw.url + "/v1/completions?pieces=1", json={"prompt": "x"}) as r:
        assert r.status == 200
        assert await r.content.readexactly(10) == payload[:10]  # streamed, not held back
        async with http.get(gw.url + "/metrics") as m:  # the gauge reads the live count
            assert f'fleet_router_replica_in_flight{{replica="{url}"}} 1.0' in await m.text()
        release.set()
        assert await r.read() == payload[10:]
    async with http.get(gw.url + "/metrics") as m:
        assert f'fleet_router_replica_in_flight{{replica="{url}"}} 0.0' in await m.text()
