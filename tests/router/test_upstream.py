"""router.proxy.upstream: the proxy's pooled HTTP/1.1 client, against real sockets on 127.0.0.1.

The happy path runs against a real sim replica; the odd behaviours (stale keep-alive, garbage,
truncation, slow readers, hanging connects) against tiny raw `asyncio.start_server` replicas
scripted per test.  Every async test runs its body on a fresh event loop, once under asyncio's
default loop and once under uvloop (whose transports are not `asyncio.Transport` subclasses),
through the `run` fixture; every body is bounded by `BOUND_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import orjson
import pytest
import uvloop

from replicas.sim import SimSettings, start_replica
from router.proxy.headers import header_lines as encode_headers
from router.proxy.upstream import (
    ConnectFailed,
    ConnectTimedOut,
    Disconnected,
    Origin,
    TransportError,
    UpstreamPool,
    UpstreamResponse,
)
from tests.router.state.support import eventually

T = TypeVar("T")

BOUND_S = 10.0  # every test body, end to end
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}

Run = Callable[[Callable[[], Awaitable[Any]]], Any]


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Run:
    """`run(body)`: await `body()` on a fresh loop of the parametrized kind, within BOUND_S."""
    factory = LOOPS[request.param]

    def run_(body: Callable[[], Awaitable[T]]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(BOUND_S):
                return await body()

        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(bounded())

    return run_


# --- a scripted raw replica ----------------------------------------------------------------------


class ClientClosed(Exception):
    """The client closed the connection where the script expected a request."""


class Peer:
    """One connection the raw replica accepted (`index` counts from 0, in accept order)."""

    def __init__(
        self,
        server: RawServer,
        index: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.server = server
        self.index = index
        self.reader = reader
        self.writer = writer
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body) as received, in order
        self.eof = asyncio.Event()  # the client closed (FIN or RST)
        self.finished = asyncio.Event()  # the script is over and the server closed its side

    async def request(self) -> tuple[bytes, bytes]:
        """The next request's raw head (up to and including the blank line) and body."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            self.eof.set()
            raise ClientClosed from None
        except ConnectionResetError:
            self.eof.set()
            raise ClientClosed from None
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await self.reader.readexactly(length) if length else b""
        self.requests.append((head, body))
        return head, body

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_eof(self) -> None:
        """Wait for the client to close this connection; it must send nothing meanwhile."""
        try:
            rest = await self.reader.read()
        except ConnectionResetError:
            rest = b""
        assert rest == b"", f"unexpected bytes from the client: {rest[:80]!r}"
        self.eof.set()

    async def serve_forever(self, answer: Callable[[Peer, bytes, bytes], bytes]) -> None:
        """Answer requests one after another (keep-alive) until the client closes."""
        for _ in range(1000):
            head, body = await self.request()
            await self.send(answer(self, head, body))
        raise AssertionError("more than 1000 requests on one connection")


Script = Callable[[Peer], Awaitable[None]]


class RawServer:
    """A raw HTTP/1.1 "replica" on 127.0.0.1 that runs `script(peer)` for each connection."""

    def __init__(self, script: Script) -> None:
        self._script = script
        self.peers: list[Peer] = []
        self.signal = asyncio.Event()  # set by a test to release a waiting script
        self.errors: list[BaseException] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def accepted(self) -> int:
        return len(self.peers)

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.origin = Origin.of(self.url)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(self, len(self.peers), reader, writer)
        self.peers.append(peer)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._script(peer)
        except (ClientClosed, ConnectionError):
            pass  # the client went away: several tests make it do so
        except asyncio.CancelledError:
            pass  # the server is stopping
        except Exception as exc:  # a failed assertion in the script: raised at exit
            self.errors.append(exc)
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await writer.wait_closed()
            peer.finished.set()

    async def __aexit__(self, exc_type: Any, *_: Any) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for _ in range(100):
            if not self._tasks:
                break
            await asyncio.sleep(0.01)
        await self._server.wait_closed()
        if exc_type is None and self.errors:
            raise self.errors[0]


def ok(body: bytes, extra: bytes = b"") -> bytes:
    """A 200 response with a Content-Length body."""
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def which(peer: Peer, head: bytes, body: bytes) -> bytes:
    """Answer naming the connection and the request's number on it: b"<conn>/<request>"."""
    return ok(b"%d/%d" % (peer.index, len(peer.requests) - 1))


async def keep_alive(peer: Peer) -> None:
    await peer.serve_forever(which)


# --- the client side -----------------------------------------------------------------------------


def request_head(
    origin: Origin,
    method: bytes = b"GET",
    target: bytes = b"/",
    headers: bytes = b"",
    body: bytes = b"",
) -> bytes:
    """A request head as router.proxy.forward builds it."""
    return b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n" % (
        method,
        origin.path_prefix,
        target,
        origin.host_header,
        headers,
        len(body),
    )


class Client:
    """An UpstreamPool plus bookkeeping so that a failing test still closes every connection."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.responses: list[UpstreamResponse] = []

    async def send(self, origin: Origin, head: bytes, body: bytes = b"") -> UpstreamResponse:
        response = await self.pool.send(origin, head, body)
        self.responses.append(response)
        return response

    async def get(self, origin: Origin, target: bytes = b"/") -> UpstreamResponse:
        return await self.send(origin, request_head(origin, target=target))


@contextlib.asynccontextmanager
async def pooled(**settings: Any) -> AsyncIterator[Client]:
    settings.setdefault("connect_timeout_s", 5.0)
    client = Client(UpstreamPool(**settings))
    try:
        yield client
    finally:
        for response in client.responses:
            response.abort()
        await client.pool.close()
        for _ in range(200):  # connection_lost callbacks, before the loop goes away
            if client.pool.open_connections <= 0:
                break
            await asyncio.sleep(0.01)


async def read_body(response: UpstreamResponse, max_chunks: int = 100_000) -> bytes:
    parts = []
    for _ in range(max_chunks):
        chunk = await response.read_chunk()
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
    raise AssertionError(f"body still not over after {max_chunks} chunks")


async def read_at_least(response: UpstreamResponse, size: int) -> bytes:
    """Body bytes until at least `size` have arrived (a write may arrive in pieces)."""
    got = b""
    for _ in range(100):
        chunk = await response.read_chunk()
        assert chunk, f"body ended after {got!r}"
        got += chunk
        if len(got) >= size:
            return got
    raise AssertionError(f"only {len(got)} bytes after 100 chunks")


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait for `predicate` (a few loop turns first: callbacks usually settle in those)."""
    for _ in range(5):
        if predicate():
            return
        await asyncio.sleep(0)
    await eventually(predicate, timeout_s, what)


async def settled(pool: UpstreamPool) -> None:
    """Wait until every closed connection's connection_lost ran (no connection open)."""
    await until(lambda: pool.open_connections == 0, "no connection open")


# --- Origin and header lines ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "host", "port", "tls", "prefix", "host_header"),
    [
        ("http://10.0.0.7:8000", "10.0.0.7", 8000, False, b"", b"10.0.0.7:8000"),
        ("http://replica", "replica", 80, False, b"", b"replica"),
        ("http://replica:80", "replica", 80, False, b"", b"replica"),
        ("https://replica", "replica", 443, True, b"", b"replica"),
        ("https://replica:443/", "replica", 443, True, b"", b"replica"),
        ("https://replica:80", "replica", 80, True, b"", b"replica:80"),
        ("http://replica:443", "replica", 443, False, b"", b"replica:443"),
        (
            "http://Replica.Example:9000/",
            "replica.example",
            9000,
            False,
            b"",
            b"replica.example:9000",
        ),
        ("http://h:8000/vllm/v1/", "h", 8000, False, b"/vllm/v1", b"h:8000"),
        ("http://h:8000/prefix//", "h", 8000, False, b"/prefix", b"h:8000"),
        ("http://h:8000/prefix", "h", 8000, False, b"/prefix", b"h:8000"),
        ("http://[::1]:8000", "::1", 8000, False, b"", b"[::1]:8000"),
        ("http://[::1]", "::1", 80, False, b"", b"[::1]"),
        ("https://[fd00::7]/v1", "fd00::7", 443, True, b"/v1", b"[fd00::7]"),
        ("http://bücher.example:81", "bücher.example", 81, False, b"", b"xn--bcher-kva.example:81"),
    ],
)
def test_origin_of(
    url: str, host: str, port: int, tls: bool, prefix: bytes, host_header: bytes
) -> None:
    origin = Origin.of(url)
    assert (origin.host, origin.port, origin.tls) == (host, port, tls)
    assert origin.path_prefix == prefix
    assert origin.host_header == host_header


def test_origins_of_one_url_are_one_pool_key() -> None:
    a, b = Origin.of("http://127.0.0.1:8000/"), Origin.of("http://127.0.0.1:8000")
    assert a == b and hash(a) == hash(b)
    assert Origin.of("http://127.0.0.1:8001") != a
    assert Origin.of("https://127.0.0.1:8000") != a


def test_encode_headers() -> None:
    assert encode_headers([]) == b""
    # Order and repeats kept; bytes that came in as non-UTF-8 (surrogateescape) go out as they were.
    headers = [
        ("Content-Type", "application/json"),
        ("X-A", "1"),
        ("X-A", "2"),
        ("X-B", "caf\udcc3\udca9 \udcff"),
    ]
    assert encode_headers(headers) == (
        b"Content-Type: application/json\r\nX-A: 1\r\nX-A: 2\r\nX-B: caf\xc3\xa9 \xff\r\n"
    )


# --- the happy path: a real sim replica ----------------------------------------------------------


def test_sim_replica_completion_then_stream_on_one_connection(run: Run) -> None:
    async def body() -> None:
        replica = await start_replica(SimSettings(host="127.0.0.1", port=0, time_scale=0.002))
        try:
            origin = Origin.of(replica.url)
            json_type = encode_headers([("Content-Type", "application/json")])
            async with pooled() as client:
                request = {
                    "model": SimSettings().model,
                    "prompt": "hello",
                    "max_tokens": 5,
                    "ignore_eos": True,
                }
                payload = orjson.dumps(request)
                head = request_head(origin, b"POST", b"/v1/completions", json_type, payload)
                response = await client.send(origin, head, payload)
                assert response.status == 200
                assert response.content_length is not None
                answer = await read_body(response)
                assert len(answer) == response.content_length
                assert orjson.loads(answer)["usage"]["completion_tokens"] == 5
                assert response.complete
                response.release()
                assert client.pool.idle_connections(origin) == 1

                payload = orjson.dumps({**request, "stream": True})
                head = request_head(origin, b"POST", b"/v1/completions", json_type, payload)
                response = await client.send(origin, head, payload)
                assert response.status == 200
                assert client.pool.idle_connections(origin) == 0  # the idle one serves
                assert client.pool.open_connections == 1
                assert response.content_length is None  # chunked
                stream = await read_body(response)
                events = [e for e in stream.split(b"\n\n") if e]
                assert events[-1] == b"data: [DONE]"
                tokens = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
                assert len(tokens) == 5  # chunk framing decoded: every event parses
                assert tokens[-1]["choices"][0]["finish_reason"] == "length"
                response.release()
                assert client.pool.idle_connections(origin) == 1
                assert client.pool.open_connections == 1
        finally:
            await replica.stop()

    run(body)


# --- keep-alive ----------------------------------------------------------------------------------


def test_keep_alive_reuses_one_connection(run: Run) -> None:
    async def body() -> None:
        async with RawServer(keep_alive) as server, pooled() as client:
            pool = client.pool
            assert (pool.open_connections, pool.idle_connections(server.origin)) == (0, 0)
            first = await client.get(Origin.of(server.url))
            assert (pool.open_connections, pool.idle_connections(server.origin)) == (1, 0)
            assert await read_body(first) == b"0/0"
            first.release()
            assert (pool.open_connections, pool.idle_connections(server.origin)) == (1, 1)
            # A new Origin object of the same URL finds the same idle connection.
            second = await client.get(Origin.of(server.url))
            assert pool.idle_connections(server.origin) == 0
            assert await read_body(second) == b"0/1"  # connection 0, its second request
            second.release()
            assert server.accepted == 1
            assert (pool.open_connections, pool.idle_connections(server.origin)) == (1, 1)
            await pool.close()
            await server.peers[0].eof.wait()  # close() closed the idle connection
            await settled(pool)

    run(body)


def test_idle_connections_are_reused_last_in_first_out(run: Run) -> None:
    async def body() -> None:
        async with RawServer(keep_alive) as server, pooled() as client:
            a = await client.get(server.origin)
            b = await client.get(server.origin)  # a is busy: a second connection
            assert (await read_body(a), await read_body(b)) == (b"0/0", b"1/0")
            a.release()
            b.release()
            assert client.pool.idle_connections(server.origin) == 2
            c = await client.get(server.origin)
            assert await read_body(c) == b"1/1"  # the warmest (last released) serves next
            c.release()
            assert server.accepted == 2

    run(body)


# --- bodies --------------------------------------------------------------------------------------


def test_content_length_body_and_head(run: Run) -> None:
    head = (
        b"HTTP/1.1 200 Fine Thanks\r\nX-One: 1\r\nContent-Length: 5\r\n"
        b"X-Raw: caf\xc3\xa9 \xff\r\nx-one: 2\r\n\r\n"
    )

    async def script(peer: Peer) -> None:
        await peer.serve_forever(lambda *_: head + b"hello")

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            for _ in range(2):
                response = await client.get(server.origin)
                assert (response.status, response.reason) == (200, "Fine Thanks")
                # Bytes as received: order, case and repeats kept, nothing decoded.
                assert response.headers == [
                    (b"X-One", b"1"),
                    (b"Content-Length", b"5"),
                    (b"X-Raw", b"caf\xc3\xa9 \xff"),
                    (b"x-one", b"2"),
                ]
                assert response.content_length == 5
                assert response.keep_alive
                assert await read_body(response) == b"hello"
                assert response.complete
                response.release()
                assert client.pool.idle_connections(server.origin) == 1
            assert server.accepted == 1

    run(body)


def test_chunked_body_is_decoded_and_the_connection_reused(run: Run) -> None:
    async def script(peer: Peer) -> None:
        for _ in range(2):
            await peer.request()
            await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await peer.send(b"5\r\nhello\r\n")
            await peer.send(b"6;ext=1\r\n world\r\n")
            await peer.send(b"0\r\n\r\n")
        await peer.until_eof()

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            for _ in range(2):
                response = await client.get(server.origin)
                assert response.content_length is None
                assert await read_body(response) == b"hello world"  # no chunk framing
                assert response.complete
                response.release()
                assert client.pool.idle_connections(server.origin) == 1
            assert server.accepted == 1

    run(body)


def test_body_until_close(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ")
        await peer.send(b"part two")
        # returning closes: the end of the body

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            response = await client.get(server.origin)
            assert response.content_length is None
            assert not response.keep_alive
            assert await read_body(response) == b"part one, part two"
            assert response.complete
            response.release()
            assert client.pool.idle_connections(server.origin) == 0
            await settled(client.pool)
            again = await client.get(server.origin)
            assert await read_body(again) == b"part one, part two"
            again.release()
            assert server.accepted == 2

    run(body)


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n"],
    ids=["204", "304"],
)
def test_statuses_without_body(run: Run, head: bytes) -> None:
    async def script(peer: Peer) -> None:
        await peer.serve_forever(lambda *_: head)

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            for _ in range(2):
                response = await client.get(server.origin)
                assert response.status == int(head[9:12])
                assert await response.read_chunk() == b""
                assert response.complete
                response.release()
                assert client.pool.idle_connections(server.origin) == 1
            assert server.accepted == 1

    run(body)


def test_empty_content_length_body(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.serve_forever(lambda *_: ok(b""))

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            for _ in range(2):
                response = await client.get(server.origin)
                assert response.content_length == 0
                assert await response.read_chunk() == b""
                assert response.complete
                response.release()
                assert client.pool.idle_connections(server.origin) == 1
            assert server.accepted == 1

    run(body)


def test_read_all_keeps_up_to_limit_and_drains_the_rest(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.serve_forever(lambda *_: ok(b"0123456789"))

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            response = await client.get(server.origin)
            assert await response.read_all(limit=4) == b"0123"
            assert response.complete
            response.release()
            assert client.pool.idle_connections(server.origin) == 1  # read to the end
            response = await client.get(server.origin)
            assert await response.read_all() == b"0123456789"
            response.release()
            assert server.accepted == 1

    run(body)


# --- streaming -----------------------------------------------------------------------------------

FRAMINGS = {
    # framing: (head fields, part one, part two with the end)
    "chunked": (b"Transfer-Encoding: chunked\r\n", b"5\r\npart1\r\n", b"5\r\npart2\r\n0\r\n\r\n"),
    "content-length": (b"Content-Length: 10\r\n", b"part1", b"part2"),
    "until-close": (b"", b"part1", b"part2"),
}


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
def test_chunks_arrive_as_they_are_sent(run: Run, framing: str) -> None:
    fields, one, two = FRAMINGS[framing]

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\n%s\r\n%s" % (fields, one))
        await peer.server.signal.wait()  # until the client has read part one
        await peer.send(two)
        if framing != "until-close":
            await peer.until_eof()

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            response = await client.get(server.origin)
            assert await read_at_least(response, 5) == b"part1"
            assert not response.complete
            server.signal.set()
            assert await read_body(response) == b"part2"
            assert response.complete
            response.release()
            reusable = framing != "until-close"
            assert client.pool.idle_connections(server.origin) == int(reusable)

    run(body)


# --- closing -------------------------------------------------------------------------------------


def test_connection_close_from_the_replica_is_honoured(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(ok(b"bye", b"Connection: close\r\n"))
        await peer.until_eof()  # the client closes it: the replica does not

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            response = await client.get(server.origin)
            assert not response.keep_alive
            assert await read_body(response) == b"bye"
            response.release()
            assert client.pool.idle_connections(server.origin) == 0
            await server.peers[0].eof.wait()
            await settled(client.pool)
            again = await client.get(server.origin)
            assert await read_body(again) == b"bye"
            again.release()
            assert server.accepted == 2

    run(body)


def test_idle_connection_closed_by_the_replica_is_not_used(run: Run) -> None:
    async def script(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(ok(b"first"))
            await asyncio.sleep(0.05)  # a keep-alive timeout, without Connection: close
            return
        await peer.serve_forever(lambda *_: ok(b"fresh"))

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            first = await client.get(server.origin)
            assert await read_body(first) == b"first"
            first.release()
            assert client.pool.idle_connections(server.origin) == 1
            await server.peers[0].finished.wait()
            second = await client.get(server.origin)
            assert await read_body(second) == b"fresh"
            second.release()
            assert server.accepted == 2
            assert client.pool.idle_connections(server.origin) == 1

    run(body)


def test_reused_connection_closed_before_any_answer_is_replaced_once(run: Run) -> None:
    async def script(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(ok(b"first"))
            await peer.request()  # the keep-alive timeout races this request: closed unanswered
            return
        await peer.serve_forever(lambda *_: ok(b"fresh"))

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            first = await client.get(server.origin)
            assert await read_body(first) == b"first"
            first.release()
            origin = server.origin
            payload = b'{"prompt": "again"}'
            head = request_head(origin, b"POST", b"/v1/completions", b"", payload)
            second = await client.send(origin, head, payload)
            assert await read_body(second) == b"fresh"
            second.release()
            assert server.accepted == 2
            # The stale connection did get the request; the fresh one got the same bytes.
            assert server.peers[0].requests[1] == (head, payload)
            assert server.peers[1].requests == [(head, payload)]

    run(body)


def test_replacement_of_a_stale_connection_is_tried_only_once(run: Run) -> None:
    async def script(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(ok(b"first"))
        await peer.request()  # then close, unanswered (on every connection)

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            first = await client.get(server.origin)
            assert await read_body(first) == b"first"
            first.release()
            with pytest.raises(Disconnected) as caught:
                await client.get(server.origin)
            assert caught.value.kind == "disconnect"
            assert server.accepted == 2  # the stale one, then one fresh: no third
            await settled(client.pool)

    run(body)


def test_reused_connection_that_started_answering_is_not_retried(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(ok(b"first"))
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Le")  # then close mid-head

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            first = await client.get(server.origin)
            assert await read_body(first) == b"first"
            first.release()
            with pytest.raises(Disconnected):
                await client.get(server.origin)
            assert server.accepted == 1
            await settled(client.pool)

    run(body)


def test_fresh_connection_closed_without_answer_raises(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()  # then close, unanswered

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            with pytest.raises(Disconnected) as caught:
                await client.get(server.origin)
            assert isinstance(caught.value, TransportError)
            assert caught.value.kind == "disconnect"
            assert server.accepted == 1  # no retry on a fresh connection
            await settled(client.pool)
            assert client.pool.idle_connections(server.origin) == 0

    run(body)


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\na\r\n0123456789\r\n",
    ],
    ids=["content-length", "chunked"],
)
def test_body_cut_short_raises(run: Run, response: bytes) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(response)  # then close before the end of the body

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            upstream = await client.get(server.origin)
            assert upstream.status == 200
            with pytest.raises(Disconnected):
                await read_body(upstream)
            assert not upstream.complete
            upstream.release()  # not reusable: closes (already closed); no double count
            await settled(client.pool)
            assert client.pool.idle_connections(server.origin) == 0

    run(body)


# --- connect errors ------------------------------------------------------------------------------


def test_connection_refused(run: Run) -> None:
    async def body() -> None:
        # A bound socket that does not listen: connects to its port are refused, and no other
        # process can take the port meanwhile.
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            origin = Origin.of(f"http://127.0.0.1:{holder.getsockname()[1]}")
            async with pooled() as client:
                for _ in range(2):
                    with pytest.raises(ConnectFailed) as caught:
                        await client.get(origin)
                    assert caught.value.kind == "connect"
                    assert isinstance(caught.value, TransportError)
                    assert client.pool.open_connections == 0

    run(body)


@contextlib.contextmanager
def hanging_listener() -> Iterator[int]:
    """A port whose connects hang: it listens with a backlog of 0, never accepts, and its accept
    queue is filled first (Linux then drops further SYNs)."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.socket())
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(8):
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
        yield port


def test_connect_timeout(run: Run) -> None:
    async def body() -> None:
        with hanging_listener() as port:
            origin = Origin.of(f"http://127.0.0.1:{port}")
            async with (
                RawServer(keep_alive) as server,
                pooled(connect_timeout_s=0.2, limit=1, limit_per_origin=1) as client,
            ):
                # Twice: the first timed-out connect gave its slot back (limits of 1).
                for _ in range(2):
                    started = time.monotonic()
                    with pytest.raises(ConnectTimedOut) as caught:
                        await client.get(origin)
                    assert time.monotonic() - started >= 0.15
                    assert caught.value.kind == "timeout_connect"
                    assert isinstance(caught.value, TransportError)
                    assert client.pool.open_connections == 0
                # And the global slot serves another replica.
                response = await client.get(server.origin)
                assert await read_body(response) == b"0/0"
                response.release()

    run(body)


# --- malformed responses -------------------------------------------------------------------------


def test_malformed_response_head(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await peer.until_eof()

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            with pytest.raises(Disconnected) as caught:
                await client.get(server.origin)
            await server.peers[0].eof.wait()  # the connection was closed
            await settled(client.pool)
            assert server.accepted == 1
            assert "malformed" in str(caught.value)

    run(body)


def test_malformed_chunk_mid_body(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await peer.server.signal.wait()
        await peer.send(b"zz\r\nnot a chunk\r\n")
        await peer.until_eof()

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            response = await client.get(server.origin)
            assert await read_at_least(response, 5) == b"hello"
            server.signal.set()
            with pytest.raises(Disconnected) as caught:
                await read_body(response)
            assert not response.complete
            await server.peers[0].eof.wait()
            response.abort()
            await settled(client.pool)
            assert "malformed" in str(caught.value)

    run(body)


def test_bytes_after_the_response_do_not_join_it(run: Run) -> None:
    """A replica that sends more than one response for one request: the extra bytes must not
    become part of the answer, and the connection is no longer trusted."""

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(
            ok(b"ok") + b"HTTP/1.1 201 Extra\r\nX-Extra: 1\r\nContent-Length: 3\r\n\r\nbad"
        )
        await peer.until_eof()

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            try:
                response = await client.get(server.origin)
                seen: object = (response.status, response.headers, await read_body(response))
                response.release()
            except Disconnected:
                seen = Disconnected
            assert seen in ((200, [(b"Content-Length", b"2")], b"ok"), Disconnected)
            await server.peers[0].eof.wait()
            assert client.pool.idle_connections(server.origin) == 0

    run(body)


def test_bytes_on_an_idle_connection_close_it(run: Run) -> None:
    async def script(peer: Peer) -> None:
        if peer.index == 0:
            await peer.request()
            await peer.send(ok(b"first"))
            await peer.server.signal.wait()  # released: the connection is idle now
            await peer.send(ok(b"nobody asked"))
            await peer.until_eof()
            return
        await peer.serve_forever(lambda *_: ok(b"fresh"))

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            first = await client.get(server.origin)
            assert await read_body(first) == b"first"
            first.release()
            assert client.pool.idle_connections(server.origin) == 1
            server.signal.set()
            await server.peers[0].eof.wait()
            await until(lambda: client.pool.idle_connections(server.origin) == 0, "idle dropped")
            second = await client.get(server.origin)
            assert await read_body(second) == b"fresh"
            second.release()
            assert server.accepted == 2

    run(body)


# --- ending a response early ---------------------------------------------------------------------


async def partial_then_wait(peer: Peer) -> None:
    await peer.request()
    await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789")
    await peer.until_eof()  # a generating replica: it notices the client leave


def test_abort_mid_body_closes_the_connection(run: Run) -> None:
    async def body() -> None:
        async with RawServer(partial_then_wait) as server, pooled() as client:
            response = await client.get(server.origin)
            assert await read_at_least(response, 10) == b"0123456789"
            response.abort()
            await server.peers[0].eof.wait()  # vLLM would abort the request here
            await settled(client.pool)
            response.abort()  # idempotent, and release after abort does nothing
            response.release()
            assert client.pool.open_connections == 0
            assert client.pool.idle_connections(server.origin) == 0

    run(body)


def test_release_before_the_end_of_the_body_closes(run: Run) -> None:
    async def body() -> None:
        async with RawServer(partial_then_wait) as server, pooled() as client:
            response = await client.get(server.origin)
            assert await read_at_least(response, 10) == b"0123456789"
            response.release()
            await server.peers[0].eof.wait()
            await settled(client.pool)
            assert client.pool.idle_connections(server.origin) == 0
            response.release()
            assert client.pool.open_connections == 0
            again = await client.get(server.origin)
            assert await read_at_least(again, 10) == b"0123456789"
            again.abort()
            assert server.accepted == 2

    run(body)


def test_release_with_unread_body_closes(run: Run) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(ok(b"never read"))
        await peer.until_eof()

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            response = await client.get(server.origin)
            await until(lambda: response.complete, "the whole body arrived")
            response.release()  # complete, but its bytes were never read
            await server.peers[0].eof.wait()
            assert client.pool.idle_connections(server.origin) == 0
            await settled(client.pool)

    run(body)


# --- back-pressure -------------------------------------------------------------------------------

TOTAL = 16 << 20
PIECE = 64 << 10


def test_slow_reader_pauses_reading_from_the_replica(run: Run) -> None:
    written = 0

    async def script(peer: Peer) -> None:
        nonlocal written
        # A small send buffer on the replica's side: its drain() blocks soon after the client
        # stops reading (the kernel's own buffers then hold little).
        sock = peer.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIECE)
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % TOTAL)
        for i in range(TOTAL // PIECE):
            await peer.send(bytes([i % 256]) * PIECE)
            written += PIECE
        await peer.serve_forever(lambda *_: ok(b"again"))

    expected = hashlib.sha256()
    for i in range(TOTAL // PIECE):
        expected.update(bytes([i % 256]) * PIECE)

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            response = await client.get(server.origin)
            received = hashlib.sha256()
            first = await response.read_chunk()
            received.update(first)
            size = len(first)
            # Read nothing more until the replica stops making progress.
            samples: list[int] = []
            for _ in range(100):
                await asyncio.sleep(0.05)
                samples.append(written)
                if len(samples) >= 5 and len(set(samples[-5:])) == 1:
                    break
            else:
                pytest.fail(f"the replica never stalled: wrote {samples[-10:]}")
            assert written < TOTAL // 2, f"the client buffered {written} bytes"
            waiting = await response.read_chunk()  # what the pool holds for the reader
            assert len(waiting) <= 1 << 20, f"{len(waiting)} bytes buffered in the pool"
            received.update(waiting)
            size += len(waiting)
            for _ in range(TOTAL):  # reading resumes: the rest arrives
                chunk = await response.read_chunk()
                if not chunk:
                    break
                received.update(chunk)
                size += len(chunk)
            assert size == TOTAL
            assert received.digest() == expected.digest()
            assert response.complete
            response.release()
            assert client.pool.idle_connections(server.origin) == 1
            again = await client.get(server.origin)  # the resumed connection serves again
            assert await read_body(again) == b"again"
            again.release()
            assert server.accepted == 1

    run(body)


# --- caps ----------------------------------------------------------------------------------------


def test_limit_per_origin_waits_for_the_connection_then_reuses_it(run: Run) -> None:
    async def body() -> None:
        async with RawServer(keep_alive) as server, pooled(limit_per_origin=1) as client:
            first = await client.get(server.origin)
            second = asyncio.create_task(client.get(server.origin))
            await asyncio.sleep(0.05)
            assert not second.done()
            assert server.accepted == 1 and len(server.peers[0].requests) == 1
            assert await read_body(first) == b"0/0"
            first.release()
            response = await second
            assert await read_body(response) == b"0/1"
            response.release()
            assert server.accepted == 1
            assert client.pool.open_connections == 1

    run(body)


def test_limit_per_origin_slot_freed_by_abort(run: Run) -> None:
    async def body() -> None:
        async with RawServer(keep_alive) as server, pooled(limit_per_origin=1) as client:
            first = await client.get(server.origin)
            second = asyncio.create_task(client.get(server.origin))
            await asyncio.sleep(0.05)
            assert not second.done()
            first.abort()
            response = await second
            assert await read_body(response) == b"1/0"  # a new connection
            response.release()
            assert client.pool.open_connections == 1

    run(body)


def test_cancelled_waiter_takes_no_slot(run: Run) -> None:
    async def body() -> None:
        async with RawServer(keep_alive) as server, pooled(limit_per_origin=1) as client:
            first = await client.get(server.origin)
            waiting = asyncio.create_task(client.get(server.origin))
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert await read_body(first) == b"0/0"
            first.release()
            response = await client.get(server.origin)
            assert await read_body(response) == b"0/1"
            response.release()
            assert server.accepted == 1

    run(body)


def test_global_limit_across_origins(run: Run) -> None:
    async def body() -> None:
        async with (
            RawServer(keep_alive) as one,
            RawServer(keep_alive) as two,
            pooled(limit=1) as client,
        ):
            first = await client.get(one.origin)
            other = asyncio.create_task(client.get(two.origin))
            await asyncio.sleep(0.05)
            assert not other.done()
            assert two.accepted == 0
            assert await read_body(first) == b"0/0"
            first.release()  # idle now: closed to make room for the other replica
            response = await other
            assert await read_body(response) == b"0/0"
            await one.peers[0].eof.wait()
            assert client.pool.open_connections == 1
            assert client.pool.idle_connections(one.origin) == 0
            response.release()
            assert client.pool.idle_connections(two.origin) == 1
            # And back: the idle connection to `two` makes room at once.
            again = await client.get(one.origin)
            assert await read_body(again) == b"1/0"
            again.release()
            await two.peers[0].eof.wait()
            assert client.pool.open_connections == 1

    run(body)


def test_cancel_during_connect_keeps_the_count(run: Run) -> None:
    """A send cancelled at any point (the client left, the first-byte timeout fired) gives its
    connection slot back exactly once."""

    async def body() -> None:
        async with RawServer(keep_alive) as server, pooled(limit_per_origin=1) as client:
            pool = client.pool
            for steps in range(40):
                await until(lambda: pool.open_connections <= 0, "the last attempt closed")
                task = asyncio.create_task(client.get(server.origin))
                for _ in range(steps):
                    await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    (await task).abort()
            await until(lambda: all(p.finished.is_set() for p in server.peers), "all closed")
            for _ in range(10):
                await asyncio.sleep(0)
            # The cap still holds: a second request waits while the first is in flight.
            first = await client.get(server.origin)
            second = asyncio.create_task(client.get(server.origin))
            await asyncio.sleep(0.05)
            open_now = pool.open_connections
            assert not second.done(), f"limit_per_origin=1 exceeded (open_connections={open_now})"
            first.abort()
            (await second).abort()
            await until(lambda: pool.open_connections <= 0, "all closed")
            assert pool.open_connections == 0

    run(body)


# --- closing the pool ----------------------------------------------------------------------------


def test_close_closes_idle_connections_and_refuses_sends(run: Run) -> None:
    async def body() -> None:
        async with RawServer(keep_alive) as server, pooled() as client:
            response = await client.get(server.origin)
            assert await read_body(response) == b"0/0"
            response.release()
            await client.pool.close()
            await server.peers[0].eof.wait()
            await settled(client.pool)
            assert client.pool.idle_connections(server.origin) == 0
            with pytest.raises(Disconnected):
                await client.get(server.origin)
            assert server.accepted == 1

    run(body)


def test_close_wakes_waiters_and_does_not_pool_responses_in_flight(run: Run) -> None:
    async def body() -> None:
        async with RawServer(keep_alive) as server, pooled(limit_per_origin=1) as client:
            in_flight = await client.get(server.origin)
            assert await read_body(in_flight) == b"0/0"
            waiting = asyncio.create_task(client.get(server.origin))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            await client.pool.close()
            with pytest.raises(Disconnected):
                await waiting
            in_flight.release()  # read to the end, but the pool is closed: closes
            await server.peers[0].eof.wait()
            await settled(client.pool)
            assert client.pool.idle_connections(server.origin) == 0
            assert server.accepted == 1

    run(body)


# --- the request as sent -------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 100, 64 * 1024 - 1, 64 * 1024, 300_000])
def test_request_arrives_exactly_as_given(run: Run, size: int) -> None:
    payload = (bytes(range(251)) * (size // 251 + 1))[:size]
    headers = encode_headers(
        [
            ("Content-Type", "application/json"),
            ("X-Request-Id", "req-1"),
            ("X-Forwarded-For", "10.0.0.1, 127.0.0.1"),
            ("X-Dup", "a"),
            ("X-Dup", "b"),
            ("X-Raw", "caf\udcc3\udca9"),
        ]
    )

    async def script(peer: Peer) -> None:
        await peer.serve_forever(lambda peer, head, body: ok(b"%d" % len(body)))

    async def body() -> None:
        async with RawServer(script) as server, pooled() as client:
            origin = server.origin
            target = b"/v1/chat/completions?stream=1&x=%20y"
            head = request_head(origin, b"POST", target, headers, payload)
            for _ in range(2):  # on a new connection, then on the same one
                response = await client.send(origin, head, payload)
                assert await read_body(response) == b"%d" % size
                response.release()
            assert server.accepted == 1
            assert server.peers[0].requests == [(head, payload)] * 2
            host = f"Host: 127.0.0.1:{server.port}\r\n".encode()
            assert head.startswith(b"POST " + target + b" HTTP/1.1\r\n" + host)
            assert b"\r\nX-Raw: caf\xc3\xa9\r\n" in head

    run(body)
