"""Forward one request to a replica and stream its answer back, byte for byte.

- The request body goes upstream unchanged (router.proxy.upstream, our pooled HTTP/1.1 client);
  the answer's bytes go to the client as they arrive (`read_chunk()` → `write()`): no
  re-serialisation, no SSE buffering.  TCP_NODELAY is set on both sockets (upstream by our
  client, downstream by aiohttp's server).
- Nothing is sent to the client before the replica's first body byte, so until then any failure
  (connect error, timeout, 5xx, 429) is retried on another replica not tried yet, with full-jitter
  backoff.  After the first byte there is no retry: a broken SSE stream ends with an SSE error
  event and `data: [DONE]`; a broken plain body closes the connection (never a silent truncation).
- Timeouts: connect (the upstream pool), first byte and idle-between-chunks (one watchdog timer
  per attempt, re-armed lazily instead of once per chunk), total (`asyncio.timeout_at`).
- Cancellation (the client went away, or shutdown) closes the upstream connection, which makes
  vLLM abort the request.  The `Lease` returns the replica's in-flight slot on every path.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from router.core import Lease, RouteContext, RoutingCore
from router.errors import NoHealthyReplica, UpstreamError, UpstreamTimeout, error_body
from router.fleet.replica import Replica
from router.metrics import RouterMetrics
from router.proxy.headers import (
    REQUEST_ID_HEADER,
    copy_downstream_headers,
    downstream_headers,
    upstream_headers,
)
from router.proxy.retry import RetryPolicy, Timeouts
from router.proxy.sse import announces_role_only
from router.proxy.upstream import (
    ConnectTimedOut,
    Origin,
    TransportError,
    UpstreamPool,
    UpstreamResponse,
    encode_headers,
)

__all__ = ["Outcome", "Proxy", "request_id_of"]

_SSE = "text/event-stream"
_DONE = b"data: [DONE]\n\n"


def request_id_of(request: web.BaseRequest) -> str:
    """The client's X-Request-Id, or a fresh one."""
    return request.headers.get(REQUEST_ID_HEADER) or secrets.token_hex(16)


@dataclass(slots=True)
class Outcome:
    """What the edge records about one request (metric labels), filled in as it goes."""

    started: float  # loop time the request arrived
    request_id: str
    model: str = "unknown"
    replica: str = "none"
    client_gone: bool = False


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed attempt before any byte reached the client (so it may be retried)."""

    replica_id: str
    kind: str  # metric label: connect, disconnect, timeout_*, status_5xx, status_429
    message: str
    timeout: bool = False
    status: int | None = None
    body: bytes = b""
    headers: Sequence[tuple[str, str]] | None = None


@dataclass(frozen=True, slots=True)
class _RequestHead:
    """The request head every attempt sends, but for the replica's own Host and path prefix."""

    method: bytes
    target: bytes  # path and query, as the client sent them
    headers: bytes  # encoded header lines, hop-by-hop ones dropped
    content_length: int

    def for_origin(self, origin: Origin) -> bytes:
        return b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n" % (
            self.method,
            origin.path_prefix,
            self.target,
            origin.host_header,
            self.headers,
            self.content_length,
        )


class _ClientGone(Exception):
    """Writing to the client failed: it closed the connection."""


class _IdleWatchdog:
    """The idle timeout of a stream, with one timer per attempt instead of one per chunk.

    The streaming loop only stamps `since` (loop time it started waiting on the replica, or None
    while it writes to the client); the timer re-arms itself and, when a wait has lasted
    `limit_s`, fires the attempt's `asyncio.Timeout` at once.
    """

    __slots__ = ("_handle", "_loop", "_timer", "expired", "limit_s", "since")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, timer: asyncio.Timeout, limit_s: float
    ) -> None:
        self._loop = loop
        self._timer = timer
        self.limit_s = limit_s
        self.since: float | None = None
        self.expired = False
        self._handle = loop.call_at(loop.time() + limit_s, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        since = self.since
        if since is not None and now - since >= self.limit_s:
            self.expired = True
            self._timer.reschedule(now)
            return
        self._handle = self._loop.call_at((since or now) + self.limit_s, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


class Proxy:
    """Sends requests to replicas chosen by the routing core; one per gateway."""

    def __init__(
        self,
        *,
        core: RoutingCore,
        pool: UpstreamPool,
        timeouts: Timeouts,
        retry: RetryPolicy,
        metrics: RouterMetrics,
    ) -> None:
        self._core = core
        self._pool = pool  # connects within timeouts.connect_s; the other timeouts are ours
        self._timeouts = timeouts
        self._retry = retry
        self._metrics = metrics
        self._ttft: dict[str, Any] = {}
        self._origins: dict[str, Origin] = {}  # by replica base URL (parsed once)

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        ctx: RouteContext,
        outcome: Outcome,
    ) -> web.StreamResponse:
        """Answer `request` from a replica chosen for `ctx`, retrying before the first byte."""
        # What every attempt's request head shares; the replica adds its Host and path prefix.
        head = _RequestHead(
            method=request.method.encode("ascii"),
            target=request.rel_url.raw_path_qs.encode("utf-8", "surrogateescape"),
            headers=encode_headers(
                upstream_headers(request.headers, outcome.request_id, request.remote)
            ),
            content_length=len(body),
        )
        tried: list[str] = []
        failure: _Failure | None = None
        model = ctx.request.model
        for attempt in range(self._retry.max_retries + 1):
            if failure is not None:
                delay = self._retry.backoff.compute(attempt)
                if delay > 0:
                    await asyncio.sleep(delay)
            try:
                replica = self._core.choose(ctx, exclude=tried)
            except NoHealthyReplica:
                if failure is None:
                    raise
                break
            if failure is not None:
                self._metrics.retries.labels(model, failure.kind).inc()
            tried.append(replica.replica_id)
            outcome.replica = replica.replica_id
            result = await self._attempt(request, replica, head, body, ctx, outcome)
            if not isinstance(result, _Failure):
                return result
            failure = result
        assert failure is not None
        return self._give_up(failure, outcome)

    def _give_up(self, failure: _Failure, outcome: Outcome) -> web.StreamResponse:
        """After the last failed attempt: pass a 429 through, else 502/504."""
        if failure.status == 429 and failure.headers is not None:
            headers = downstream_headers(failure.headers, failure.replica_id, outcome.request_id)
            return web.Response(status=429, body=failure.body, headers=headers)
        if failure.timeout:
            raise UpstreamTimeout(failure.message)
        raise UpstreamError(failure.message)

    async def _attempt(
        self,
        request: web.Request,
        replica: Replica,
        head: _RequestHead,
        body: bytes,
        ctx: RouteContext,
        outcome: Outcome,
    ) -> web.StreamResponse | _Failure:
        loop = asyncio.get_running_loop()
        timeouts = self._timeouts
        now = loop.time()
        total_deadline = now + timeouts.total_s
        first_deadline = now + timeouts.first_byte_s
        # One timer per attempt: until the first body byte it is bound by the first-byte
        # timeout (or the total one, if sooner); then by the total one, with the idle watchdog.
        first_bound = first_deadline < total_deadline
        upstream: UpstreamResponse | None = None
        resp: web.StreamResponse | None = None
        watchdog: _IdleWatchdog | None = None
        last_chunk = b""
        with self._core.start(replica, ctx) as lease:
            try:
                async with asyncio.timeout_at(min(first_deadline, total_deadline)) as timer:
                    origin = self._origin(replica.url)
                    upstream = await self._pool.send(origin, head.for_origin(origin), body)
                    status = upstream.status
                    if self._retry.retryable_status(status):
                        payload = await upstream.read_all()
                        return self._status_failure(lease, upstream, payload)
                    first = await upstream.read_chunk()
                    # Prefill is over at the first token: a chat stream's role-only first
                    # chunk may come before it (not from vLLM; see router.proxy.sse).
                    prefilling = ctx.endpoint == "chat" and announces_role_only(first)
                    if not prefilling:
                        lease.first_byte()
                    self._observe_ttft(ctx.request.model, loop.time() - outcome.started)
                    if upstream.complete:
                        # The whole answer came at once (a non-streamed answer, as usual): one
                        # Response, written with its headers in one go after the handler.
                        whole = web.Response(status=status, reason=upstream.reason, body=first)
                        copy_downstream_headers(
                            whole.headers, upstream.headers, replica.replica_id, outcome.request_id
                        )
                        lease.record_success()
                        return whole
                    resp = web.StreamResponse(status=status, reason=upstream.reason)
                    copy_downstream_headers(
                        resp.headers, upstream.headers, replica.replica_id, outcome.request_id
                    )
                    if upstream.content_length is not None:
                        resp.content_length = upstream.content_length
                    try:
                        await resp.prepare(request)
                        if first:
                            await resp.write(first)
                    except ConnectionResetError:
                        raise _ClientGone from None
                    last_chunk = first
                    timer.reschedule(total_deadline)
                    watchdog = _IdleWatchdog(loop, timer, timeouts.idle_s)
                    write = resp.write
                    read_chunk = upstream.read_chunk
                    while first:
                        watchdog.since = loop.time()
                        chunk = await read_chunk()
                        watchdog.since = None
                        if not chunk:
                            break
                        if prefilling and not announces_role_only(chunk):
                            prefilling = False
                            lease.first_byte()
                        try:
                            await write(chunk)
                        except ConnectionResetError:
                            raise _ClientGone from None
                        last_chunk = chunk
                    try:
                        await resp.write_eof()
                    except ConnectionResetError:
                        raise _ClientGone from None
                lease.record_success()
                return resp
            except _ClientGone:
                # Not the replica's fault: no circuit verdict; closing upstream aborts it.
                outcome.client_gone = True
                if upstream is not None and upstream.complete:
                    lease.record_success()
                return resp if resp is not None else web.Response(status=499)
            except TimeoutError:
                timed_out = True
                if watchdog is not None:
                    kind = "timeout_idle" if watchdog.expired else "timeout_total"
                else:
                    kind = "timeout_first_byte" if first_bound else "timeout_total"
                message = {
                    "timeout_first_byte": "no first byte within the first-byte timeout",
                    "timeout_idle": "no data within the idle timeout",
                }.get(kind, "request exceeded the total timeout")
            except TransportError as exc:
                kind, message = exc.kind, str(exc)
                timed_out = isinstance(exc, ConnectTimedOut)
            finally:
                if watchdog is not None:
                    watchdog.cancel()
                if upstream is not None:
                    # Read to the end: the connection serves again; else closing it aborts
                    # the request on the replica.
                    if upstream.complete:
                        upstream.release()
                    else:
                        upstream.abort()
            # A failed attempt (only connection errors and timeouts reach here).
            lease.record_failure()
            self._metrics.upstream_errors.labels(replica.replica_id, kind).inc()
            message = f"replica {replica.replica_id}: {message}"
            if resp is None:
                return _Failure(replica.replica_id, kind, message, timeout=timed_out)
            self._metrics.upstream_errors.labels(replica.replica_id, "stream_broken").inc()
            await self._end_broken_stream(request, resp, last_chunk, message, timed_out)
            return resp

    def _status_failure(self, lease: Lease, upstream: UpstreamResponse, payload: bytes) -> _Failure:
        status = upstream.status
        rid = lease.replica.replica_id
        if status == 429:
            # Saturated, not broken: the circuit breaker must not eject it for this.
            lease.record_success()
            kind = "status_429"
        else:
            lease.record_failure()
            kind = "status_5xx"
        self._metrics.upstream_errors.labels(rid, kind).inc()
        detail = _error_message(payload)
        return _Failure(
            rid,
            kind,
            f"replica {rid} answered {status}" + (f": {detail}" if detail else ""),
            status=status,
            body=payload,
            headers=upstream.headers,
        )

    async def _end_broken_stream(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        last_chunk: bytes,
        message: str,
        timed_out: bool,
    ) -> None:
        """The replica failed after the first byte: tell the client instead of going silent."""
        if (resp.content_type or "").startswith(_SSE):
            error = UpstreamTimeout(message) if timed_out else UpstreamError(message)
            event = error_body(error.message, error.error_type, None, error.status)
            # Close a half-written event first so the error event parses on its own.
            prefix = b"" if not last_chunk or last_chunk.endswith(b"\n\n") else b"\n\n"
            try:
                await resp.write(prefix + b"data: " + event + b"\n\n" + _DONE)
                await resp.write_eof()
                return
            except ConnectionResetError:
                pass
        # A plain body cannot carry an error: drop the connection so the client sees a
        # truncated response rather than a short one that looks complete.
        resp.force_close()
        if request.transport is not None:
            request.transport.close()

    def _origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) > 4096:  # replicas come and go (DNS discovery): stay bounded
                self._origins.clear()
            origin = self._origins[url] = Origin.of(url)
        return origin

    def _observe_ttft(self, model: str, seconds: float) -> None:
        child = self._ttft.get(model)
        if child is None:
            child = self._ttft[model] = self._metrics.ttft.labels(model)
        child.observe(seconds)


def _error_message(payload: bytes) -> str:
    """The message of an OpenAI/vLLM error body, or a short prefix of whatever it is."""
    try:
        data = orjson.loads(payload)
        message = data["error"]["message"]
        if isinstance(message, str):
            return message[:500]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    return payload[:200].decode("utf-8", "replace").strip()
