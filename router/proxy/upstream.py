"""The proxy's HTTP/1.1 client: pooled keep-alive connections to replicas, parsed by httptools.

Why not aiohttp's client: on the proxy's hot path it cost more than everything else the router
does — routing, validation, metrics and aiohttp's own server — put together (a request through
`ClientSession` builds a `ClientRequest`, a `ClientResponse`, a `StreamReader`, timer and trace
contexts, and walks the connector's bookkeeping).  This client does only what a proxy needs,
with llhttp (through httptools, the parser uvicorn uses) doing all the parsing:

- one request at a time per connection, its head and body written in one call;
- the response head, then its body chunks as they arrive (chunked framing decoded by the
  parser; the proxy re-frames for its own client);
- keep-alive reuse, last-in first-out, so the warmest connection serves next; a reused
  connection that the replica had already closed (its keep-alive timeout racing our send) is
  replaced by a fresh one once, before any response byte, so the race never reaches the
  circuit breaker;
- back-pressure: reading from the replica pauses while more than `_HIGH_WATER` bytes wait for
  a slow client;
- caps on open connections, per replica and in all (waiting for a free one, as aiohttp's
  connector does), a connect timeout, TCP_NODELAY, TLS for https replicas.

Timeouts after connecting (first byte, idle, total) are the proxy's own (router.proxy.forward);
closing a response (`abort`) drops its connection, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import socket
import ssl
from dataclasses import dataclass
from typing import ClassVar, Final, cast
from urllib.parse import urlsplit

import httptools

from router.proxy.wakeup import Wakeup

__all__ = [
    "ConnectFailed",
    "ConnectTimedOut",
    "Disconnected",
    "Origin",
    "TransportError",
    "UpstreamPool",
    "UpstreamResponse",
]

# Body bytes buffered for a slow reader before reading from the replica pauses.
_HIGH_WATER: Final = 256 * 1024
# Request bodies below this go out with their head in one write (one copy, one syscall).
_ONE_WRITE_MAX: Final = 64 * 1024


class TransportError(Exception):
    """A request to a replica failed below HTTP (the proxy's retry loop catches these; they
    never reach a client as such).  `kind` is the proxy's metric label for it."""

    kind: ClassVar[str] = "disconnect"


class ConnectFailed(TransportError):
    """The replica refused the connection, or its address does not resolve."""

    kind = "connect"


class ConnectTimedOut(TransportError):
    """No connection within the connect timeout."""

    kind = "timeout_connect"


class Disconnected(TransportError):
    """The connection closed, or the replica sent something that is not HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a replica listens, and what every request to it starts with."""

    host: str
    port: int
    tls: bool
    path_prefix: bytes  # the replica URL's own path, if it has one ("" usually)
    host_header: bytes
    unix_path: str | None = None  # a Unix socket instead of host:port

    def __hash__(self) -> int:
        # The pool looks its origin up on every request; the dataclass's own __hash__ (all
        # fields, interpreted even in the compiled build) cost more than the lookup itself.
        return hash((self.host, self.port, self.unix_path))

    def request_head(
        self, method: bytes, target: bytes, header_lines: bytes = b"", content_length: int = 0
    ) -> bytes:
        """A request's head for this origin: its path prefix, Host, the given header lines."""
        return b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n" % (
            method,
            self.path_prefix,
            target,
            self.host_header,
            header_lines,
            content_length,
        )

    @classmethod
    def unix(cls, path: str) -> Origin:
        """A server on a Unix socket (the gateway's own control application)."""
        return cls(host="localhost", port=0, tls=False, path_prefix=b"",
                   host_header=b"localhost", unix_path=path)  # fmt: skip

    @classmethod
    def of(cls, url: str) -> Origin:
        """The origin of a replica base URL such as `http://10.0.0.7:8000` (parsed once per
        URL: callers ask on every request)."""
        return _origin_of(url)


@functools.lru_cache(maxsize=4096)  # replicas come and go (DNS discovery): stay bounded
def _origin_of(url: str) -> Origin:
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    netloc = f"[{host}]" if ":" in host else host
    default_port = port == (443 if tls else 80)
    host_header = netloc if default_port else f"{netloc}:{port}"
    return Origin(
        host=host,
        port=port,
        tls=tls,
        path_prefix=parts.path.rstrip("/").encode(),
        host_header=host_header.encode("idna"),
    )


class UpstreamResponse:
    """One response from a replica: its head at once, then body chunks as they arrive.

    Exactly one of `release` (body read to the end: the connection may serve again) or `abort`
    (anything else: the connection is closed) must end it; both are idempotent.
    """

    __slots__ = (
        "_buffer",
        "_buffered",
        "_conn",
        "_done",
        "_error",
        "_head_done",
        "_loop",
        "_paused",
        "_wakeup",
        "headers",
        "keep_alive",
        "reason",
        "received_any",
        "status",
    )

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._conn: _Connection | None = conn
        self._loop = loop
        self._wakeup = Wakeup(loop)  # the reader waits here for bytes, the end or an error
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._head_done = False
        self._done = False
        self._error: TransportError | None = None
        self.received_any = False
        self.status = 0
        self.reason = ""
        self.headers: list[tuple[bytes, bytes]] = []  # as received, in order
        self.keep_alive = False

    # --- reading (the proxy's side) ------------------------------------------------------

    async def read_chunk(self) -> bytes:
        """Whatever body bytes have arrived (waiting for some); b"" at the end of the body."""
        while not self._buffer:
            if self._done:
                return b""
            if self._error is not None:
                raise self._error
            await self._wakeup.arm()
        chunk = self._buffer[0] if len(self._buffer) == 1 else b"".join(self._buffer)
        self._buffer.clear()
        self._buffered = 0
        if self._paused and self._conn is not None:
            self._paused = False
            self._conn.resume_reading()
        return chunk

    async def read_all(self, limit: int = 1 << 20) -> bytes:
        """The rest of the body, up to `limit` bytes (error payloads; the rest is dropped)."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.read_chunk():
            if size < limit:
                parts.append(chunk[: limit - size])
            size += len(chunk)
        return b"".join(parts)

    @property
    def complete(self) -> bool:
        """The whole body has arrived."""
        return self._done

    def release(self) -> None:
        """The exchange is over: keep the connection for the next request if it can serve
        one (the body was read to its end and the replica keeps it alive), else close it."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(reusable=self._done and self.keep_alive and not self._buffer)

    def abort(self) -> None:
        """Close the connection now (the replica sees the client go and aborts the request)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(reusable=False)

    async def wait_head(self) -> None:
        """Until the head is in, with the first body bytes or the end (see `on_head`)."""
        while not self._head_done:
            if self._error is not None:
                raise self._error
            await self._wakeup.arm()

    # --- feeding (the connection's side) -------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        self.reason = reason.decode("latin-1")

    def on_head(self, status: int, keep_alive: bool) -> None:
        # Nothing read from the headers here: a whole answer (the usual case) needs none of
        # it; the properties below look when asked.  No wake-up either: the reader has nothing
        # to do with a head alone (the proxy sends nothing before the first body byte), so it
        # wakes once, with the first body bytes or the end, not twice.
        self.status = status
        self.keep_alive = keep_alive
        self._head_done = True

    @property
    def content_length(self) -> int | None:
        """The declared Content-Length, if there is a valid one."""
        value = self._header(b"content-length")
        return int(value) if value is not None and value.strip().isdigit() else None

    @property
    def content_type(self) -> bytes:
        return self._header(b"content-type") or b""

    def _header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def _framed(self) -> bool:
        """Whether the body's end is in the data (a length, chunks, or no body) rather than
        where the connection closes."""
        if self.status in (204, 304) or self._header(b"content-length") is not None:
            return True
        return b"chunked" in (self._header(b"transfer-encoding") or b"").lower()

    def on_body(self, body: bytes) -> None:
        self._buffer.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause_reading()
        self._wakeup.set()

    def on_complete(self) -> None:
        self._done = True
        self._wakeup.set()

    def on_lost(self, exc: Exception | None) -> None:
        if self._done or self._error is not None:
            return  # complete, or already failed with a more precise error
        if self._head_done and exc is None and not self._framed():
            self._done = True  # the body ends where the connection does
        else:
            reason = f": {exc}" if exc else ""
            self._error = Disconnected(f"the replica closed the connection{reason}")
        self._wakeup.set()

    def on_bad_response(self, message: str) -> None:
        if not self._done:
            self._error = Disconnected(f"malformed response from the replica: {message}")
            self._wakeup.set()


class _Connection(asyncio.Protocol):
    """One keep-alive TCP (or TLS) connection to a replica, carrying one response at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: UpstreamResponse | None = None
        self._interim = False  # parsing a 1xx answer (e.g. 103 Early Hints): not the response
        self._untrusted = False  # the replica sent more than one answer to one request
        self.closed = False
        self.holds_slot = True  # counted in the pool's open connections until released once

    def send(self, response: UpstreamResponse, head: bytes, body: bytes) -> None:
        assert self._transport is not None
        self._response = response
        if len(body) < _ONE_WRITE_MAX:
            self._transport.write(head + body)
        else:  # no copy of a large body just to write it in one call
            self._transport.write(head)
            self._transport.write(body)

    def finish(self, *, reusable: bool) -> None:
        self._response = None
        if reusable and not self.closed and not self._untrusted:
            # The same parser reads the next response: llhttp parses a keep-alive
            # connection's messages one after another.
            self._pool._idle_again(self)
        else:
            self.close()

    def close(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.close()  # connection_lost follows and does the bookkeeping

    def pause_reading(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.resume_reading()

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small SSE chunks must leave at once, not wait for an ACK (Nagle).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:
            self.close()  # bytes nobody asked for: this connection can no longer be trusted
            return
        response.received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.close()
            response.on_bad_response(str(exc))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response, self._response = self._response, None
        if response is not None:
            response.on_lost(exc)
        self._pool._closed(self)

    # --- httptools callbacks ---------------------------------------------------------------
    # Each is a no-op unless a response is being read from a trustworthy connection.

    def on_message_begin(self) -> None:
        response = self._response
        if response is not None and response.complete:
            # A second answer to one request: keep the first, never reuse the connection.
            self._untrusted = True

    def on_status(self, reason: bytes) -> None:
        if self._response is not None and not self._untrusted:
            self._response.on_status(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response is not None and not self._untrusted:
            response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None or self._untrusted:
            return
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200:
            # An interim answer (Expect is never sent, but 103 Early Hints may come): skip it.
            self._interim = True
            response.headers.clear()
            return
        response.on_head(status, parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self._response is not None and not self._untrusted:
            self._response.on_body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        elif self._response is not None and not self._untrusted:
            self._response.on_complete()


class _OriginConnections:
    __slots__ = ("idle", "open")

    def __init__(self) -> None:
        self.idle: collections.deque[_Connection] = collections.deque()
        self.open = 0


class UpstreamPool:
    """Keep-alive connections to every replica, bounded in all (`limit`) and per replica
    (`limit_per_origin`); 0 means no bound."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        limit: int = 0,
        limit_per_origin: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._limit = limit
        self._limit_per_origin = limit_per_origin
        self._ssl_context = ssl_context
        self._origins: dict[Origin, _OriginConnections] = {}
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def open_connections(self) -> int:
        return self._open

    def idle_connections(self, origin: Origin) -> int:
        conns = self._origins.get(origin)
        return 0 if conns is None else sum(not c.closed for c in conns.idle)

    async def send(self, origin: Origin, head: bytes, body: bytes) -> UpstreamResponse:
        """Send one request (its head, then `body`) and return once the response head and the
        first body bytes (or the end of the response) are in.

        Raises a `TransportError`; the caller must `release` or `abort` the response.
        """
        loop = self._loop
        if loop is None:  # bound on first use (a lookup per request costs a getpid syscall)
            loop = self._loop = asyncio.get_running_loop()
        conn, reused = await self._acquire(origin)
        response = await self._exchange(conn, loop, head, body, stale_ok=reused)
        if response is None:
            # The replica closed this idle connection as we reused it: once more, fresh.
            conn = await self._connect_new(origin)
            response = await self._exchange(conn, loop, head, body, stale_ok=False)
            assert response is not None
        return response

    @staticmethod
    async def _exchange(
        conn: _Connection,
        loop: asyncio.AbstractEventLoop,
        head: bytes,
        body: bytes,
        *,
        stale_ok: bool,
    ) -> UpstreamResponse | None:
        """One request on `conn`, up to its response head.  None when `stale_ok` and the
        connection turned out closed before any byte came back (worth one fresh try)."""
        response = UpstreamResponse(conn, loop)
        conn.send(response, head, body)
        try:
            await response.wait_head()
        except Disconnected:
            response.abort()
            if stale_ok and not response.received_any:
                return None
            raise
        except BaseException:
            response.abort()
            raise
        return response

    async def close(self) -> None:
        """Close the idle connections now; one in use closes when its response is released or
        aborted.  The pool cannot be used afterwards."""
        self._closing = True
        for conns in self._origins.values():
            for conn in list(conns.idle):
                conn.close()
            conns.idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        # Let connection_lost callbacks run before the loop goes away.
        await asyncio.sleep(0)

    # --- connections -----------------------------------------------------------------------

    async def _acquire(self, origin: Origin) -> tuple[_Connection, bool]:
        while True:
            if self._closing:
                raise Disconnected("the gateway is shutting down")
            conns = self._origins.get(origin)
            if conns is None:
                conns = self._origins[origin] = _OriginConnections()
            idle = conns.idle
            while idle:
                conn = idle.pop()
                if not conn.closed:
                    return conn, True
            if self._limit_per_origin and conns.open >= self._limit_per_origin:
                await self._wait_for_slot()
                continue
            if self._limit and self._open >= self._limit:
                # Make room by closing another replica's idle connection if there is one
                # (its connection_lost frees the slot and wakes us), else wait for one.
                self._close_one_idle()
                await self._wait_for_slot()
                continue
            return await self._connect_new(origin), False

    async def _connect_new(self, origin: Origin) -> _Connection:
        conns = self._origins.setdefault(origin, _OriginConnections())
        conns.open += 1
        self._open += 1
        # Made before connecting, so a failed or cancelled connect frees its slot exactly once
        # (asyncio then also calls connection_lost; uvloop does not).
        conn = _Connection(self, origin)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if origin.unix_path is not None:
                    await loop.create_unix_connection(lambda: conn, origin.unix_path)
                elif origin.tls:
                    context = self._ssl_context or ssl.create_default_context()
                    await loop.create_connection(
                        lambda: conn,
                        origin.host,
                        origin.port,
                        ssl=context,
                        server_hostname=origin.host,
                    )
                else:
                    await loop.create_connection(lambda: conn, origin.host, origin.port)
        except TimeoutError:
            self._closed(conn)
            raise ConnectTimedOut(
                f"no connection to {origin.host}:{origin.port} within the connect timeout"
            ) from None
        except OSError as exc:  # refused, unreachable, name resolution (socket.gaierror)
            self._closed(conn)
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        except BaseException:
            self._closed(conn)
            raise
        return conn

    def _idle_again(self, conn: _Connection) -> None:
        if self._closing:
            conn.close()
            return
        self._origins[conn.origin].idle.append(conn)
        self._wake_waiters()

    def _closed(self, conn: _Connection) -> None:
        """`conn` is closed (or never opened): free its slot, once."""
        conn.closed = True
        if conn.holds_slot:
            conn.holds_slot = False
            self._origins[conn.origin].open -= 1
            self._open -= 1
            self._wake_waiters()

    def _close_one_idle(self) -> None:
        """At the global cap: close the longest-idle connection of any replica, if one is."""
        for conns in self._origins.values():
            while conns.idle:
                conn = conns.idle.popleft()
                if not conn.closed:
                    conn.close()
                    return

    async def _wait_for_slot(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _wake_waiters(self) -> None:
        # Caps are rarely reached; waking every waiter to re-check keeps this simple and fair
        # enough (they re-queue in order if there is still no slot).
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
