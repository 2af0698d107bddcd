"""The gateway's front door: a lean HTTP/1.1 server on asyncio protocols, parsed by httptools.

Why not aiohttp's web server for this: on the proxy's hot path its per-request machinery
(`web.Request`, the application's dispatch, `StreamResponse`'s header preparation and
writer) costs about as much CPU as everything the router itself does; sglang-router, in Rust,
spends less on a whole request than aiohttp spends before our handler runs.  So the socket
clients connect to is served here, and only the data plane — the OpenAI endpoints a
`hot_routes` table names — is answered here; every other request (health, readiness,
metrics, models, admin, unknown paths) is relayed over a private Unix socket to the aiohttp
control application, which keeps its routes, middleware and error bodies unchanged.

What the server does, per connection: llhttp parses the requests (chunked bodies decoded,
pipelined requests queued and answered in order); one task answers them one after another;
`Expect: 100-continue` is honoured; a declared or streamed body over `max_body_bytes` is
answered 413 and the connection closed; over-long heads 431; garbage 400 (the error bodies
are the OpenAI shape, from router.errors); a client that goes away cancels its request's task
(which closes the upstream connection, so vLLM aborts the request); writes honour the
transport's flow control; idle keep-alive connections close after `keepalive_timeout_s`.
Shutdown drains: stop accepting, close idle connections, let requests in flight finish (their
connections then close) for up to a timeout, then cancel what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from email.utils import formatdate
from typing import Any, Final, cast

import httptools

from router.errors import BadRequest, HeadTooLarge, PayloadTooLarge, RouterError
from router.http.errors import send_error
from router.proxy.headers import RawHeaders, header_lines, new_request_id, request_id_of
from router.proxy.wakeup import Wakeup
from router.tasks import stop_task

__all__ = ["ClientGone", "EdgeRequest", "EdgeResponse", "EdgeServer", "Handler"]

log = logging.getLogger(__name__)

# Request line and headers together; llhttp itself has no limit.
MAX_HEAD_BYTES: Final = 64 * 1024
# Complete pipelined requests queued behind the one being answered before reading pauses.
_MAX_QUEUED: Final = 16
_SWEEP_INTERVAL_S: Final = 1.0


class ClientGone(Exception):
    """Writing to the client failed: it closed the connection.  (Not a ConnectionResetError:
    mypyc cannot compile a subclass of that builtin, and nothing catches it as one.)"""


class EdgeRequest:
    """One parsed request: method, target, headers, the whole body, the peer's address."""

    __slots__ = ("body", "http_version", "keep_alive", "method", "path", "raw_headers",
                 "remote", "target")  # fmt: skip

    def __init__(
        self,
        method: str,
        target: str,
        raw_headers: RawHeaders,
        body: bytes,
        remote: str | None,
        keep_alive: bool,
        http_version: str,
    ) -> None:
        self.method = method
        self.target = target  # path and query, as sent
        self.path = target.partition("?")[0]
        self.raw_headers = raw_headers  # (name, value) bytes, as received
        self.body = body
        self.remote = remote
        self.keep_alive = keep_alive
        self.http_version = http_version


class _DateHeader:
    """The Date header value, formatted once a second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = 0
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode("ascii")
        return self._value


_DATE = _DateHeader()
_REASONS: Final = {
    100: "Continue", 200: "OK", 201: "Created", 202: "Accepted", 204: "No Content",
    301: "Moved Permanently", 302: "Found", 304: "Not Modified", 307: "Temporary Redirect",
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
    413: "Payload Too Large", 415: "Unsupported Media Type", 422: "Unprocessable Entity",
    429: "Too Many Requests", 431: "Request Header Fields Too Large", 499: "Client Closed Request",
    500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
    503: "Service Unavailable", 504: "Gateway Timeout",
}  # fmt: skip
# Framing is the server's: a handler's own copies of these are dropped.
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date"})
# A handler's headers: ready-made `Name: value\r\n` lines (no framing headers among them), or
# text pairs (framing headers dropped here).
Headers = bytes | Mapping[str, str] | Iterable[tuple[str, str]]


class EdgeResponse:
    """The answer to one request: `send` a whole one, or `start`, `write`..., `end` a stream
    (chunked unless a content length is given).  Writes raise `ClientGone` once the client
    has gone."""

    __slots__ = ("_chunked", "_conn", "_head_only", "_http10", "_keep_alive", "started",
                 "status")  # fmt: skip

    def __init__(
        self,
        conn: _EdgeConnection,
        keep_alive: bool,
        *,
        head_only: bool = False,
        http10: bool = False,
    ) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self._head_only = head_only  # the answer to a HEAD request: no body bytes
        self._http10 = http10  # an HTTP/1.0 client cannot read chunked framing
        self._chunked = False
        self.started = False
        self.status = 0

    def send(
        self,
        status: int,
        body: bytes,
        headers: Headers = b"",
        reason: str | None = None,
    ) -> None:
        """Answer with `body` whole: head and body in one write."""
        head = self._head(status, reason, headers, len(body))
        self._conn.write(head if self._head_only else head + body)

    async def start(
        self,
        status: int,
        headers: Headers = b"",
        reason: str | None = None,
        content_length: int | None = None,
        first: bytes = b"",
    ) -> None:
        """Send the head of a streamed answer (chunked unless its length is known; to an
        HTTP/1.0 client, delimited by closing the connection instead), with the body's `first`
        bytes in the same write: one send on the path to the client's first token."""
        self._chunked = content_length is None and not self._http10
        if content_length is None and self._http10:
            self._keep_alive = False
        head = self._head(status, reason, headers, content_length)
        if first and not self._head_only:
            head += b"%x\r\n%b\r\n" % (len(first), first) if self._chunked else first
        self._conn.write(head)
        await self._conn.drain()

    async def write(self, chunk: bytes) -> None:
        if not chunk or self._head_only:
            return
        if self._chunked:
            self._conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        else:
            self._conn.write(chunk)
        await self._conn.drain()

    async def end(self) -> None:
        """The end of a streamed answer."""
        if self._chunked and not self._head_only:
            self._conn.write(b"0\r\n\r\n")
        await self._conn.drain()

    def abort(self) -> None:
        """Drop the connection: a plain body that broke off must not look complete."""
        self._keep_alive = False
        self._conn.close()

    def _head(self, status: int, reason: str | None, headers: Headers, length: int | None) -> bytes:
        if self.started:
            raise RuntimeError("the response has already started")
        self.started = True
        self.status = status
        if isinstance(headers, bytes):
            lines = headers
        else:
            items = headers.items() if isinstance(headers, Mapping) else headers
            lines = header_lines((k, v) for k, v in items if k.lower() not in _FRAMING)
        if self._conn.closing:
            self._keep_alive = False
        if length is not None:
            framing = b"Content-Length: %d\r\n" % length
        elif self._chunked:
            framing = b"Transfer-Encoding: chunked\r\n"
        else:
            framing = b""  # the end of the body is the end of the connection
        if not self._keep_alive:
            connection = b"Connection: close\r\n"
        else:
            connection = b"Connection: keep-alive\r\n" if self._http10 else b""
        return b"HTTP/1.1 %d %s\r\nDate: %s\r\n%s%s%s\r\n" % (
            status,
            (reason or _REASONS.get(status, "Unknown")).encode("latin-1", "replace"),
            _DATE.get(),
            lines,
            framing,
            connection,
        )

    @property
    def keep_alive(self) -> bool:
        return self._keep_alive


Handler = Callable[[EdgeRequest, EdgeResponse], Awaitable[None]]


class _EdgeConnection(asyncio.Protocol):
    """One client connection: parse, queue, answer in order."""

    def __init__(self, server: EdgeServer) -> None:
        self._server = server
        self._loop = server.loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._remote: str | None = None
        self._queue: deque[EdgeRequest | RouterError] = deque()
        self._task: asyncio.Task[None] | None = None
        self._next_request = Wakeup(self._loop)  # the task waits here for a request
        self.busy = False  # answering a request
        self._paused_reading = False
        self._write_paused = False
        self._drained = Wakeup(self._loop)  # ... and here for the client to read
        self.closing = False  # answer what is in flight, then close (shutdown)
        self.closed = False
        self.idle_since = self._loop.time()
        # The message being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._rejected = False

    @property
    def socket(self) -> socket.socket | None:
        return None if self._transport is None else self._transport.get_extra_info("socket")

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self._remote = peer[0] if isinstance(peer, tuple) and peer else None
        self._server.connections.add(self)
        self._task = self._loop.create_task(self._serve())

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return  # the connection is closing after an error answer: ignore the rest
        self.idle_since = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(BadRequest("protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            # A callback's own exception comes back wrapped, as the error's context.
            cause = exc.__context__
            if isinstance(cause, RouterError):
                self._reject(cause)
            else:
                if cause is not None:
                    log.error("request parsing failed", exc_info=cause)
                self._reject(BadRequest(f"malformed HTTP request: {exc}"))

    def eof_received(self) -> bool:
        # A client's FIN is almost always a disconnect, not a half-close awaiting answers (HTTP
        # clients do not half-close): close, which cancels the request in flight so the replica
        # stops generating for nobody (aiohttp's server does the same).
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._server.connections.discard(self)
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()  # the client is gone: stop its request (and the upstream one)
        self._drained.fail(ClientGone("the client closed the connection"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._drained.set()

    # --- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge("the request line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise HeadTooLarge(f"the request head exceeds {MAX_HEAD_BYTES} bytes")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        limit = self._server.max_body_bytes
        for name, value in self._headers:
            lower = name.lower()
            if lower == b"content-length" and value.strip().isdigit() and int(value) > limit:
                raise PayloadTooLarge(
                    f"the request body has {int(value)} bytes; the limit is {limit}"
                )
            if lower == b"expect" and value.strip().lower() == b"100-continue":
                assert self._transport is not None
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._server.max_body_bytes:
            raise PayloadTooLarge(
                f"the request body exceeds the limit of {self._server.max_body_bytes} bytes"
            )
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = EdgeRequest(
            method=parser.get_method().decode("ascii", "replace"),
            target=self._url.decode("utf-8", "surrogateescape"),
            raw_headers=self._headers,
            body=body,
            remote=self._remote,
            keep_alive=parser.should_keep_alive(),
            http_version=parser.get_http_version(),
        )
        self._enqueue(request)

    # --- answering -------------------------------------------------------------------------

    def _reject(self, rejection: RouterError) -> None:
        self._rejected = True
        if self._transport is not None:
            self._transport.pause_reading()
        self._enqueue(rejection)

    def _enqueue(self, item: EdgeRequest | RouterError) -> None:
        self._queue.append(item)
        self._next_request.set()
        if len(self._queue) >= _MAX_QUEUED and not self._paused_reading:
            assert self._transport is not None
            self._paused_reading = True
            self._transport.pause_reading()

    async def _serve(self) -> None:
        """The connection's one task (not one per request): answer requests in order."""
        handle = self._server.handler
        try:
            while not self.closed:
                if not self._queue:
                    if self.closing:
                        break
                    await self._next_request.arm()
                    continue
                item = self._queue.popleft()
                if self._paused_reading and len(self._queue) < _MAX_QUEUED // 2:
                    self._paused_reading = False
                    if self._transport is not None and not self._rejected:
                        self._transport.resume_reading()
                if isinstance(item, RouterError):  # refused while parsing: answer, then close
                    send_error(EdgeResponse(self, keep_alive=False), item, new_request_id())
                    break
                keep_alive = item.keep_alive and not self.closing and not self._server.draining
                response = EdgeResponse(
                    self,
                    keep_alive,
                    head_only=item.method == "HEAD",
                    http10=item.http_version == "1.0",
                )
                self.busy = True
                try:
                    await handle(item, response)
                except (ClientGone, asyncio.CancelledError):
                    raise
                except Exception:
                    self._server.internal_error(item, response)
                finally:
                    self.busy = False
                    self.idle_since = self._loop.time()
                    self._server.note_idle()
                if not response.keep_alive:
                    break
        except ClientGone:
            pass
        finally:
            self.close()

    def write(self, data: bytes) -> None:
        if self.closed or self._transport is None or self._transport.is_closing():
            raise ClientGone("the client closed the connection")
        self._transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ClientGone("the client closed the connection")
        if not self._write_paused:
            return
        await self._drained.arm()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()


class EdgeServer:
    """Listens on a TCP socket and answers each request with `handler`."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        keepalive_timeout_s: float = 75.0,
        access_log: logging.Logger | None = None,
    ) -> None:
        self._handler = handler
        self.max_body_bytes = max_body_bytes
        self._keepalive_timeout_s = keepalive_timeout_s
        self._access_log = access_log
        self.connections: set[_EdgeConnection] = set()
        self.draining = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._quiet = asyncio.Event()  # set when draining and no request is in flight
        self.loop = asyncio.get_running_loop()

    async def start(
        self, host: str, port: int, *, reuse_port: bool = False, backlog: int = 4096
    ) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._server = await self.loop.create_server(
            lambda: _EdgeConnection(self),
            host,
            port,
            backlog=backlog,
            reuse_port=reuse_port or None,
        )
        self._sweeper = self.loop.create_task(self._sweep_idle())
        # uvloop's `sockets` is a list, not the tuple typeshed declares (mypyc checks it).
        sockets: Sequence[socket.socket] = cast(Any, self._server).sockets
        return int(sockets[0].getsockname()[1])

    def note_idle(self) -> None:
        """A connection finished its requests: the drain may be over."""
        if self.draining and not any(c.busy for c in self.connections):
            self._quiet.set()

    @property
    def handler(self) -> Handler:
        """What answers each request: the handler itself, or wrapped in the access log."""
        return self._handler if self._access_log is None else self._logged

    async def _logged(self, request: EdgeRequest, response: EdgeResponse) -> None:
        started = time.perf_counter()
        try:
            await self._handler(request, response)
        finally:
            assert self._access_log is not None
            self._access_log.info(
                '%s "%s %s HTTP/%s" %d %.6fs',
                request.remote or "-",
                request.method,
                request.target,
                request.http_version,
                response.status,
                time.perf_counter() - started,
            )

    def internal_error(self, request: EdgeRequest, response: EdgeResponse) -> None:
        """A handler failed unexpectedly: log it; a 500 if nothing was sent yet, else drop
        the connection (a half-sent answer must not look complete)."""
        log.exception("unhandled error on %s %s", request.method, request.path)
        if not response.started:
            send_error(
                response, RouterError("internal router error"), request_id_of(request.raw_headers)
            )
        else:
            response.abort()

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Stop accepting; let requests in flight finish for up to `drain_timeout_s`; close."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        await stop_task(self._sweeper)
        for conn in list(self.connections):
            conn.closing = True
            if not conn.busy:
                conn.close()
        if any(c.busy for c in self.connections):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._quiet.wait(), drain_timeout_s)
        for conn in list(self.connections):
            conn.close()  # connection_lost cancels whatever is still running
        await asyncio.sleep(0)
        if self._server is not None:
            await self._server.wait_closed()

    async def _sweep_idle(self) -> None:
        """Close keep-alive connections idle for longer than the keep-alive timeout."""
        while True:
            await asyncio.sleep(_SWEEP_INTERVAL_S)
            cutoff = self.loop.time() - self._keepalive_timeout_s
            for conn in list(self.connections):
                if not conn.busy and conn.idle_since < cutoff:
                    conn.close()
