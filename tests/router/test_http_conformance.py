"""Black-box HTTP/1.1 conformance of the gateway's listening socket.

Server-agnostic on purpose: these tests speak raw bytes over `asyncio.open_connection` (answers
parsed with httptools, the same llhttp parser the proxy's upstream client uses) or use aiohttp's
*client*; they never import a server implementation nor reach into the app, so they hold
whichever HTTP server fronts the gateway.  Replicas are real sims on 127.0.0.1, or a raw asyncio
upstream that records exactly what the gateway sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httptools
import orjson
import pytest

from tests.router.conftest import StartGateway, StartSim, fast_config

# Every single socket read waits at most this long: a missing answer fails, it never hangs.
READ_TIMEOUT_S = 10.0
LONG = {"max_tokens": 4000, "ignore_eos": True}

Headers = Mapping[str, str] | Iterable[tuple[str, str]]


# --- a tiny HTTP/1.1 client on raw sockets ----------------------------------------------------


@dataclass
class Response:
    """One parsed response, as it came on the wire."""

    status: int = 0
    version: str = ""
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    keep_alive: bool = True
    chunks: int = 0  # chunk headers seen (chunked framing only; the last, empty one included)
    close_delimited: bool = False  # the body ended with the connection (no length, no chunks)

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def header_count(self, name: str) -> int:
        return sum(1 for k, _ in self.headers if k.lower() == name.lower())

    @property
    def chunked(self) -> bool:
        return "chunked" in (self.header("transfer-encoding") or "").lower()

    def json(self) -> Any:
        return orjson.loads(self.body)


class RawConnection:
    """A client connection: write request bytes, read responses in order (httptools)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.eof = False
        self._parser = httptools.HttpResponseParser(self)
        self._current: Response | None = None
        self._body = bytearray()
        self._headers_done = False
        self._done: list[Response] = []

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._current, self._body, self._headers_done = Response(), bytearray(), False

    def on_status(self, reason: bytes) -> None:
        assert self._current is not None
        self._current.reason += reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._current is not None
        self._current.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        assert self._current is not None
        self._current.status = self._parser.get_status_code()
        self._current.version = self._parser.get_http_version()
        self._current.keep_alive = bool(self._parser.should_keep_alive())
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_chunk_header(self) -> None:
        assert self._current is not None
        self._current.chunks += 1

    def on_message_complete(self) -> None:
        assert self._current is not None
        self._current.body = bytes(self._body)
        self._done.append(self._current)
        self._current = None

    # client side
    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def _feed(self, size: int) -> None:
        try:
            data = await asyncio.wait_for(self.reader.read(size), READ_TIMEOUT_S)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            raise AssertionError(f"nothing received for {READ_TIMEOUT_S}s") from None
        if data:
            self._parser.feed_data(data)
            return
        self.eof = True
        current = self._current
        if (
            current is not None
            and self._headers_done
            and current.header("content-length") is None
            and not current.chunked
        ):
            current.close_delimited = True
            self.on_message_complete()

    async def response(self, *, read_size: int = 1 << 16, pause_s: float = 0.0) -> Response:
        """The next complete response (reads of at most `read_size` bytes, `pause_s` apart)."""
        while not self._done:
            if self.eof:
                raise AssertionError("the server closed the connection before a full response")
            await self._feed(read_size)
            if pause_s and not self._done:
                await asyncio.sleep(pause_s)
        return self._done.pop(0)

    async def read_raw(self, size: int = 1 << 16) -> bytes:
        """Raw bytes, bypassing the parser (a test that stops reading mid-response)."""
        return await asyncio.wait_for(self.reader.read(size), READ_TIMEOUT_S)

    async def expect_eof(self) -> None:
        """The server closes the connection, sending nothing more."""
        assert not self._done, f"unexpected extra response {self._done[0].status}"
        if self.eof:
            return
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 16), READ_TIMEOUT_S)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            raise AssertionError("the server kept the connection open") from None
        assert data == b"", f"expected the connection to close, got {data[:200]!r}"
        self.eof = True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def connect(
    url: str, *, rcvbuf: int | None = None, limit: int = 1 << 16
) -> AsyncIterator[RawConnection]:
    """A raw connection to the gateway at `url` (optionally with a small receive buffer)."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(
            loop.sock_connect(sock, (parts.hostname, parts.port)), READ_TIMEOUT_S
        )
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
    except BaseException:
        sock.close()
        raise
    conn = RawConnection(reader, writer)
    try:
        yield conn
    finally:
        await conn.close()


def request(
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Headers = (),
    *,
    version: str = "HTTP/1.1",
    host: bool = True,
) -> bytes:
    """A request's bytes: Host and (unless Transfer-Encoding is given) Content-Length added."""
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    names = {k.lower() for k, _ in pairs}
    head = [f"{method} {path} {version}"]
    if host and "host" not in names:
        head.append("Host: 127.0.0.1")
    head += [f"{k}: {v}" for k, v in pairs]
    if body is not None and "transfer-encoding" not in names and "content-length" not in names:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")


def post_json(path: str, payload: Any, headers: Headers = (), **kwargs: Any) -> bytes:
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    return request(
        "POST",
        path,
        orjson.dumps(payload),
        [("Content-Type", "application/json"), *pairs],
        **kwargs,
    )


def get(path: str, headers: Headers = (), **kwargs: Any) -> bytes:
    return request("GET", path, None, headers, **kwargs)


def chunked(body: bytes, size: int) -> bytes:
    """`body` in Transfer-Encoding: chunked framing, `size` bytes a chunk."""
    out = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    )
    return out + b"0\r\n\r\n"


def events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e.strip()]


def stream_texts(body: bytes) -> list[str]:
    """The text deltas of a completions SSE body; checks every event and the final [DONE]."""
    found = events(body)
    assert found and found[-1] == b"data: [DONE]", found[-3:]
    texts: list[str] = []
    for event in found[:-1]:
        assert event.startswith(b"data: "), event[:100]
        payload = orjson.loads(event.removeprefix(b"data: "))
        assert payload["object"] == "text_completion", payload
        texts.extend(choice["text"] for choice in payload["choices"])
    return texts


def assert_openai_error(resp: Response, status: int) -> dict[str, Any]:
    assert resp.status == status, (resp.status, resp.body[:300])
    assert (resp.header("content-type") or "").startswith("application/json")
    payload = resp.json()
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return dict(error)


def assert_completion(resp: Response) -> dict[str, Any]:
    assert resp.status == 200, (resp.status, resp.body[:300])
    payload = resp.json()
    assert payload["object"] == "text_completion", payload
    assert isinstance(payload["choices"][0]["text"], str)
    return dict(payload)


def assert_length_framed(resp: Response) -> None:
    """A Content-Length answer whose length is exactly its body's."""
    assert not resp.chunked and resp.header_count("content-length") == 1, resp.headers
    assert int(resp.header("content-length") or -1) == len(resp.body)


async def sim_running(http: aiohttp.ClientSession, sim_url: str) -> float:
    """The sim's own `vllm:num_requests_running`, read from its /metrics."""
    async with http.get(sim_url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


async def poll(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Await `check()` until true, at most `timeout_s` (bounded: ~20 polls a second)."""
    for _ in range(int(timeout_s / 0.05) + 1):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not true after {timeout_s}s")


async def health_on(conn: RawConnection) -> None:
    """The connection is in sync: a GET /health on it gets its own 200."""
    conn.send(get("/health"))
    resp = await conn.response()
    assert resp.status == 200 and resp.json() == {"status": "ok"}, (resp.status, resp.body)


# --- 1. keep-alive, 2. pipelining --------------------------------------------------------------


async def test_keep_alive_serves_mixed_requests_in_order_on_one_connection(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as conn:
        for round_ in range(2):
            conn.send(post_json("/v1/completions", {"prompt": f"plain {round_}", "max_tokens": 4}))
            plain = await conn.response()
            assert_completion(plain)
            assert_length_framed(plain)
            assert plain.version == "1.1" and plain.keep_alive

            await health_on(conn)

            conn.send(
                post_json(
                    "/v1/completions",
                    {
                        "prompt": f"streamed {round_}",
                        "stream": True,
                        "max_tokens": 6,
                        "ignore_eos": True,
                    },
                )
            )
            streamed = await conn.response()
            assert streamed.status == 200
            assert (streamed.header("content-type") or "").startswith("text/event-stream")
            assert len("".join(stream_texts(streamed.body))) > 0

            conn.send(get("/v1/models"))
            models = await conn.response()
            assert models.status == 200
            assert [card["id"] for card in models.json()["data"]] == [sim.settings.model]

            conn.send(get("/metrics"))
            metrics = await conn.response()
            assert metrics.status == 200
            assert (metrics.header("content-type") or "").startswith("text/plain")
            assert b"fleet_router_requests_total" in metrics.body
        assert not conn.eof


async def test_pipelined_requests_are_answered_in_order(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as conn:
        # Two complete requests in one write (then a third burst mixing more kinds).
        conn.send(
            post_json(
                "/v1/completions", {"prompt": "one", "max_tokens": 3}, {"X-Request-Id": "pipe-1"}
            )
            + post_json(
                "/v1/completions", {"prompt": "two", "max_tokens": 3}, {"X-Request-Id": "pipe-2"}
            )
        )
        first, second = await conn.response(), await conn.response()
        assert_completion(first)
        assert_completion(second)
        assert first.header("x-request-id") == "pipe-1"
        assert second.header("x-request-id") == "pipe-2"

        conn.send(
            get("/health")
            + post_json(
                "/v1/completions",
                {"prompt": "three", "stream": True, "max_tokens": 3},
                {"X-Request-Id": "pipe-3"},
            )
            + get("/v1/models")
        )
        health, stream, models = [await conn.response() for _ in range(3)]
        assert health.status == 200 and health.json() == {"status": "ok"}
        assert stream.status == 200 and stream.header("x-request-id") == "pipe-3"
        stream_texts(stream.body)
        assert models.status == 200 and models.json()["object"] == "list"


# --- 3. chunked request bodies, 4. Expect: 100-continue ----------------------------------------


async def test_chunked_request_body_is_accepted(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    body = orjson.dumps({"prompt": "chunked " * 40, "max_tokens": 3})
    async with connect(gw.url) as conn:
        for size in (7, 64, len(body)):
            conn.send(
                request(
                    "POST",
                    "/v1/completions",
                    chunked(body, size),
                    {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
                )
            )
            resp = await conn.response()
            assert_completion(resp)
            assert resp.header("x-fleet-replica") == sim.url
        # A chunked body written in several pieces over time.
        conn.send(
            request(
                "POST",
                "/v1/completions",
                None,
                {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
            )
        )
        framed = chunked(body, 16)
        for i in range(0, len(framed), 50):
            conn.send(framed[i : i + 50])
            await asyncio.sleep(0.005)
        assert_completion(await conn.response())


async def test_expect_100_continue(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    body = orjson.dumps({"prompt": "may I?", "max_tokens": 3})
    async with connect(gw.url) as conn:
        for _ in range(2):  # twice on one connection
            head = request(
                "POST",
                "/v1/completions",
                None,
                {
                    "Content-Type": "application/json",
                    "Expect": "100-continue",
                    "Content-Length": str(len(body)),
                },
            )
            conn.send(head)  # the headers only: the body waits for the interim answer
            interim = await conn.response()
            assert interim.status == 100, (interim.status, interim.body[:200])
            assert interim.version == "1.1"
            assert interim.body == b""
            conn.send(body)
            assert_completion(await conn.response())


# --- 5. HTTP/1.0, 6. Connection: close -----------------------------------------------------------


async def test_http_10_without_keep_alive_gets_its_answer_then_the_close(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as conn:
        conn.send(get("/health", version="HTTP/1.0", host=False))
        resp = await conn.response()
        assert resp.status == 200 and resp.json() == {"status": "ok"}
        assert not resp.keep_alive
        await conn.expect_eof()
    async with connect(gw.url) as conn:
        conn.send(
            post_json("/v1/completions", {"prompt": "old", "max_tokens": 3}, version="HTTP/1.0")
        )
        assert_completion(await conn.response())
        await conn.expect_eof()
    async with connect(gw.url) as conn:
        # An HTTP/1.0 client cannot read chunked framing: the stream is length- or
        # close-delimited (the close follows either way).
        conn.send(
            post_json(
                "/v1/completions",
                {"prompt": "old stream", "stream": True, "max_tokens": 5},
                version="HTTP/1.0",
            )
        )
        resp = await conn.response()
        assert resp.status == 200
        assert not resp.chunked and resp.chunks == 0, resp.headers
        stream_texts(resp.body)
        await conn.expect_eof()


async def test_connection_close_from_the_client(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    for stream in (False, True):
        async with connect(gw.url) as conn:
            conn.send(
                post_json(
                    "/v1/completions",
                    {"prompt": "bye", "max_tokens": 3, "stream": stream},
                    {"Connection": "close"},
                )
            )
            resp = await conn.response()
            assert resp.status == 200
            if stream:
                stream_texts(resp.body)
            else:
                assert_completion(resp)
            assert "close" in (resp.header("connection") or "").lower()  # RFC 9112 §9.6
            await conn.expect_eof()
    async with connect(gw.url) as conn:
        conn.send(get("/health", {"Connection": "close"}))
        assert (await conn.response()).status == 200
        await conn.expect_eof()


# --- 7. malformed requests, 8. bodies over the limit, 9. oversized headers ---------------------


async def test_malformed_request_line_gets_400_and_the_gateway_keeps_serving(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as bystander:
        await health_on(bystander)  # an open keep-alive connection, before and after
        for garbage in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/9.Z\r\n\r\n", b"\x16\x03\x01\x00"):
            async with connect(gw.url) as conn:
                conn.send(garbage)
                resp = await conn.response()
                assert resp.status == 400, (garbage, resp.status, resp.body[:200])
                await conn.expect_eof()
        await health_on(bystander)
    async with connect(gw.url) as conn:
        conn.send(post_json("/v1/completions", {"prompt": "still here", "max_tokens": 2}))
        assert_completion(await conn.response())


async def _in_sync_after(conn: RawConnection, resp: Response) -> None:
    """After an error answer the connection either closes (as announced) or stays in sync."""
    if resp.keep_alive:
        await health_on(conn)
    else:
        await conn.expect_eof()


async def test_body_over_the_limit_gets_413(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url], max_body_bytes=1024))
    # The refused body is made of requests: a server that lost the framing would answer them.
    smuggled = get("/v1/smuggled")
    oversized = smuggled * (2048 // len(smuggled) + 1)
    async with connect(gw.url) as conn:
        conn.send(
            request("POST", "/v1/completions", oversized, {"Content-Type": "application/json"})
        )
        resp = await conn.response()
        error = assert_openai_error(resp, 413)
        assert "1024" in error["message"]
        assert error["code"] == "payload_too_large"  # router.errors.PayloadTooLarge's answer
        assert_length_framed(resp)
        await _in_sync_after(conn, resp)
    async with connect(gw.url) as conn:
        conn.send(
            request(
                "POST",
                "/v1/completions",
                chunked(oversized, 300),
                {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
            )
        )
        resp = await conn.response()
        assert_openai_error(resp, 413)
        await _in_sync_after(conn, resp)
    async with connect(gw.url) as conn:
        # Just under the limit is fine.
        body = orjson.dumps({"prompt": "y" * 900, "max_tokens": 2})
        assert len(body) <= 1024
        conn.send(request("POST", "/v1/completions", body, {"Content-Type": "application/json"}))
        assert_completion(await conn.response())


async def test_oversized_headers_get_a_4xx_and_the_gateway_keeps_serving(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as bystander:
        await health_on(bystander)
        for head, statuses in (
            (get("/health", {"X-Big": "a" * (100 * 1024)}), (400, 431)),  # one huge value
            # many ordinary headers, ~1 MiB in all
            (get("/health", {f"X-Many-{i}": "b" * 1000 for i in range(1000)}), (400, 431)),
            (get("/health?q=" + "c" * (100 * 1024)), (400, 414, 431)),  # a huge request target
        ):
            async with connect(gw.url) as conn:
                conn.send(head)
                resp = await conn.response()
                assert resp.status in statuses, (resp.status, resp.body[:200])
        await health_on(bystander)
    async with connect(gw.url) as conn:
        conn.send(post_json("/v1/completions", {"prompt": "after", "max_tokens": 2}))
        assert_completion(await conn.response())


# --- 10. routes, 11. invalid JSON, 12. request ids ---------------------------------------------


async def test_unknown_route_404_and_wrong_method_405_with_openai_bodies(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as conn:
        conn.send(get("/v1/nothing-here"))
        assert_openai_error(await conn.response(), 404)
        conn.send(post_json("/v2/completions", {"prompt": "x"}))  # a body to skip, too
        assert_openai_error(await conn.response(), 404)
        conn.send(get("/v1/completions"))
        resp = await conn.response()
        assert_openai_error(resp, 405)
        allow = {m.strip() for m in (resp.header("allow") or "").split(",")}
        assert "POST" in allow, resp.headers
        await health_on(conn)  # still in sync on the same connection


async def test_invalid_json_gets_400_and_the_connection_serves_again(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as conn:
        for bad in (b"{not json", b'{"messages": [', b"[1, 2]"):
            conn.send(
                request("POST", "/v1/chat/completions", bad, {"Content-Type": "application/json"})
            )
            resp = await conn.response()
            assert assert_openai_error(resp, 400)["type"] == "invalid_request_error"
            assert resp.keep_alive
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        conn.send(post_json("/v1/chat/completions", chat))
        resp = await conn.response()
        assert resp.status == 200 and resp.json()["object"] == "chat.completion"


async def test_request_id_is_echoed_or_generated_and_the_replica_is_named(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as conn:
        for stream in (False, True):
            conn.send(
                post_json(
                    "/v1/completions",
                    {"prompt": "id", "max_tokens": 2, "stream": stream},
                    {"X-Request-Id": f"client-id-{stream}"},
                )
            )
            resp = await conn.response()
            assert resp.status == 200
            assert resp.header("x-request-id") == f"client-id-{stream}"
            assert resp.header_count("x-request-id") == 1
            assert resp.header("x-fleet-replica") == sim.url
        generated = []
        for stream in (False, True):
            conn.send(
                post_json("/v1/completions", {"prompt": "id", "max_tokens": 2, "stream": stream})
            )
            resp = await conn.response()
            assert resp.status == 200 and resp.header("x-fleet-replica") == sim.url
            rid = resp.header("x-request-id")
            assert rid and len(rid) >= 16 and resp.header_count("x-request-id") == 1
            generated.append(rid)
        assert generated[0] != generated[1]
        # An error the gateway answers itself still carries the client's id.
        conn.send(request("POST", "/v1/completions", b"{nope", {"X-Request-Id": "bad-one"}))
        resp = await conn.response()
        assert_openai_error(resp, 400)
        assert resp.header("x-request-id") == "bad-one"


async def test_every_answer_of_the_router_itself_carries_a_request_id(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    """Not only proxied answers: the control routes, 404, 405 and refusals while parsing carry
    one too (the client's, echoed once; else a new one), so every line of a client's log can be
    matched with the router's."""
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    own_answers = [
        ("/health", 200),
        ("/metrics", 200),
        ("/v1/models", 200),
        ("/v1/nothing-here", 404),
        ("/v1/completions", 405),
    ]
    async with connect(gw.url) as conn:
        for i, (path, status) in enumerate(own_answers):
            conn.send(get(path, {"X-Request-Id": f"mine-{i}"}))
            resp = await conn.response()
            assert resp.status == status
            assert resp.header_count("x-request-id") == 1, (path, resp.headers)
            assert resp.header("x-request-id") == f"mine-{i}"
        generated = set()
        for path in ("/health", "/v1/nothing-here", "/v1/completions"):
            conn.send(get(path))
            resp = await conn.response()
            assert resp.header_count("x-request-id") == 1, (path, resp.headers)
            generated.add(resp.header("x-request-id"))
        assert len(generated) == 3 and all(rid and len(rid) == 32 for rid in generated)
    async with connect(gw.url) as conn:  # refused while parsing: no id to echo, a new one
        conn.send(b"GARBAGE\r\n\r\n")
        resp = await conn.response()
        assert resp.status == 400
        rid = resp.header("x-request-id")
        assert rid and len(rid) == 32


# --- 13. client disconnect, 14. slow reader, 15. many connections ------------------------------


async def test_client_disconnect_mid_stream_over_a_raw_socket_aborts_the_replica(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """test_streaming covers this with aiohttp's client; here the raw socket simply closes."""
    sim = await start_sim(time_scale=0.05)
    gw = await start_gateway(fast_config([sim.url]))

    async def running(expected: float) -> bool:
        return await sim_running(http, sim.url) == expected

    for round_ in range(2):
        async with connect(gw.url) as conn:
            conn.send(
                post_json("/v1/completions", {"prompt": f"long {round_}", "stream": True, **LONG})
            )
            seen = b""
            for _ in range(100):  # the head, then the first SSE event
                seen += await conn.read_raw()
                if b"data: " in seen:
                    break
            assert seen.startswith(b"HTTP/1.1 200"), seen[:200]
            assert b"data: " in seen
            await poll(lambda: running(1), 5, "the sim runs the request")
        # The socket is closed: the replica must stop generating.
        await poll(lambda: running(0), 5, "the sim aborted the request")
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    assert f'fleet_router_replica_in_flight{{replica="{sim.url}"}} 0.0' in text
    async with connect(gw.url) as conn:  # and the gateway serves on
        conn.send(post_json("/v1/completions", {"prompt": "after", "max_tokens": 2}))
        assert_completion(await conn.response())


async def test_slow_reader_gets_the_whole_stream_in_order(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    body = {
        "prompt": "slowly now",
        "stream": True,
        "max_tokens": 600,
        "ignore_eos": True,
        "seed": 11,
    }
    # The reference: the same request straight to the sim, read at full speed.
    async with http.post(sim.url + "/v1/completions", json=body) as direct:
        assert direct.status == 200
        expected = stream_texts(await direct.read())
    assert len(expected) == 600
    # A small receive buffer and small, spaced reads: the gateway must wait for the reader.
    async with connect(gw.url, rcvbuf=4096, limit=1024) as conn:
        conn.send(post_json("/v1/completions", body))
        resp = await conn.response(read_size=1024, pause_s=0.001)
        assert resp.status == 200
        assert resp.body.endswith(b"data: [DONE]\n\n")
        assert stream_texts(resp.body) == expected
        await health_on(conn)  # the connection is reusable after the stream


async def test_fifty_concurrent_keep_alive_connections(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    sims = [await start_sim(seed=i) for i in range(2)]
    gw = await start_gateway(fast_config([s.url for s in sims], policy="round_robin"))
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}

    async def client(n: int) -> list[int]:
        statuses: list[int] = []
        async with connect(gw.url) as conn:
            requests = (
                post_json(
                    "/v1/completions",
                    {"prompt": f"c{n}", "max_tokens": 3},
                    {"X-Request-Id": f"c{n}-0"},
                ),
                post_json(
                    "/v1/completions",
                    {"prompt": f"s{n}", "max_tokens": 3, "stream": True},
                    {"X-Request-Id": f"c{n}-1"},
                ),
                post_json("/v1/chat/completions", chat, {"X-Request-Id": f"c{n}-2"}),
            )
            for i, data in enumerate(requests):
                conn.send(data)
                resp = await conn.response()
                assert resp.header("x-request-id") == f"c{n}-{i}"  # its own answer, no cross-talk
                statuses.append(resp.status)
            assert not conn.eof
        return statuses

    results = await asyncio.wait_for(asyncio.gather(*(client(n) for n in range(50))), 60)
    assert [s for statuses in results for s in statuses] == [200] * 150


# --- 16. response framing, hop-by-hop headers ---------------------------------------------------


async def test_response_framing(start_sim: StartSim, start_gateway: StartGateway) -> None:
    """Non-streamed: exactly one Content-Length, equal to the body.  Streamed (a sim at real
    speed, so tokens arrive one by one): chunked, or delimited by closing the connection."""
    sim = await start_sim(time_scale=1.0)
    gw = await start_gateway(fast_config([sim.url]))
    async with connect(gw.url) as conn:
        conn.send(post_json("/v1/completions", {"prompt": "framed", "max_tokens": 5}))
        plain = await conn.response()
        assert_completion(plain)
        assert_length_framed(plain)
        for path in ("/health", "/v1/models", "/metrics"):
            conn.send(get(path))
            resp = await conn.response()
            assert resp.status == 200
            assert resp.chunked or int(resp.header("content-length") or -1) == len(resp.body)

        conn.send(
            post_json(
                "/v1/completions",
                {"prompt": "framed", "max_tokens": 8, "ignore_eos": True, "stream": True},
            )
        )
        streamed = await conn.response()
        assert streamed.status == 200
        assert streamed.header("content-length") is None, streamed.headers
        assert streamed.chunked or streamed.close_delimited
        if streamed.chunked:
            assert streamed.header_count("transfer-encoding") == 1
            assert streamed.chunks >= 2  # data chunks, then the last (empty) one
        assert len(stream_texts(streamed.body)) == 8


@dataclass
class Received:
    """One request a raw upstream received."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    @property
    def names(self) -> set[str]:
        return {k.lower() for k, _ in self.headers}


class _RequestCollector:
    """httptools callbacks collecting complete requests."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.done: list[Received] = []
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body = bytearray()

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", [], bytearray()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode("ascii")
        self.done.append(Received(method, self._url.decode(), self._headers, bytes(self._body)))


RAW_MODEL = "raw-model"
RAW_COMPLETION = orjson.dumps(
    {
        "id": "cmpl-raw",
        "object": "text_completion",
        "created": 1,
        "model": RAW_MODEL,
        "choices": [
            {
                "index": 0,
                "text": " raw",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)


def _raw_answer(req: Received) -> bytes:
    if req.method == "GET" and req.path == "/health":
        return b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    if req.method == "GET" and req.path == "/v1/models":
        body = orjson.dumps({"object": "list", "data": [{"id": RAW_MODEL, "object": "model"}]})
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
    if req.method == "POST" and req.path == "/v1/completions":
        # Hop-by-hop headers of its own, which must not reach the client either.
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Upstream: yes\r\n"
            b"Connection: keep-alive, X-Up-Hop\r\nX-Up-Hop: 1\r\nKeep-Alive: timeout=5\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(RAW_COMPLETION), RAW_COMPLETION)
        )
    return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


StartRawUpstream = Callable[[], Awaitable[tuple[str, list[Received]]]]


@pytest.fixture
async def start_raw_upstream() -> AsyncIterator[StartRawUpstream]:
    """A raw asyncio HTTP/1.1 upstream (/health, /v1/models, a fixed completion) recording
    every request exactly as received.  Returns its base URL and the list of requests."""
    servers: list[asyncio.Server] = []
    writers: set[asyncio.StreamWriter] = set()
    tasks: set[asyncio.Task[None]] = set()

    async def start() -> tuple[str, list[Received]]:
        seen: list[Received] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            tasks.add(task)
            writers.add(writer)
            collector = _RequestCollector()
            try:
                while data := await reader.read(1 << 16):
                    collector.parser.feed_data(data)
                    while collector.done:
                        req = collector.done.pop(0)
                        seen.append(req)
                        writer.write(_raw_answer(req))
                    await writer.drain()
            except (ConnectionError, httptools.HttpParserError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}", seen

    yield start
    for server in servers:
        server.close()
    for writer in writers:
        writer.close()
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    for server in servers:
        await server.wait_closed()


async def test_hop_by_hop_headers_are_not_forwarded(
    start_raw_upstream: StartRawUpstream, start_gateway: StartGateway
) -> None:
    url, seen = await start_raw_upstream()
    gw = await start_gateway(fast_config([url], scrape_interval_s=0))
    body = b'{"prompt": "hop",  "max_tokens": 1}'
    hop_headers = {
        "Content-Type": "application/json",
        "Authorization": "Bearer sk-test",
        "X-End-To-End": "kept",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "1",
        "Keep-Alive": "timeout=30",
        "Proxy-Connection": "keep-alive",
        "TE": "trailers",
    }
    async with connect(gw.url) as conn:
        conn.send(request("POST", "/v1/completions", body, {**hop_headers, "X-Request-Id": "h1"}))
        first = await conn.response()
        # The same request with a chunked body (de-chunked before it goes upstream).
        conn.send(
            request(
                "POST",
                "/v1/completions",
                chunked(body, 8),
                {**hop_headers, "Transfer-Encoding": "chunked"},
            )
        )
        second = await conn.response()

    for resp in (first, second):
        assert resp.status == 200 and resp.body == RAW_COMPLETION
        assert_length_framed(resp)
        assert resp.header("x-upstream") == "yes"
        assert resp.header("x-fleet-replica") == url
        # The upstream's hop-by-hop headers stay on the upstream hop.
        names = {k.lower() for k, _ in resp.headers}
        assert not names & {"x-up-hop", "keep-alive"}, resp.headers
        assert "x-up-hop" not in (resp.header("connection") or "").lower()

    forwarded = [r for r in seen if r.path == "/v1/completions"]
    assert len(forwarded) == 2
    for req, resp in zip(forwarded, (first, second), strict=True):
        assert req.method == "POST" and req.body == body  # the client's exact bytes
        assert req.header("authorization") == "Bearer sk-test"
        assert req.header("x-end-to-end") == "kept"
        assert req.header("content-type") == "application/json"
        assert not req.names & {
            "x-hop",
            "keep-alive",
            "proxy-connection",
            "te",
            "transfer-encoding",
        }, req.headers
        assert "x-hop" not in (req.header("connection") or "").lower()
        assert req.header("content-length") == str(len(body))
        # One request id end to end: the client's, or the one generated for the client.
        assert req.header("x-request-id") == resp.header("x-request-id")
    assert forwarded[0].header("x-request-id") == "h1"
