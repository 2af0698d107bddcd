"""Forward one request to a replica and stream its answer back, byte for byte.

- The request body goes upstream unchanged (router.proxy.upstream, our pooled HTTP/1.1 client);
  the answer's bytes go to the client as they arrive (`read_chunk()` → `write()`): no
  re-serialisation, no SSE buffering.  TCP_NODELAY is set on both sockets (upstream by our
  client, downstream by the edge server).
- Nothing is sent to the client before the replica's first body byte, so until then any failure
  (connect error, timeout, 5xx, 429) is retried on another replica not tried yet, with full-jitter
  backoff.  After the first byte there is no retry: a broken SSE stream ends with an SSE error
  event and `data: [DONE]`; a broken plain body closes the connection (never a silent truncation).
- Timeouts: connect (the upstream pool); first byte, total and idle-between-chunks by one
  `Deadline` per attempt in a coarse timing wheel (router.proxy.deadlines): no timer is armed
  per request, and the idle limit is checked lazily, never per chunk.
- Cancellation (the client went away, or shutdown) closes the upstream connection, which makes
  vLLM abort the request.  The `Lease` returns the replica's in-flight slot on every path.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from router.core import Lease, RouteContext, RoutingCore
from router.errors import NoHealthyReplica, UpstreamError, UpstreamTimeout, error_body
from router.fleet.replica import Replica
from router.http.edge import ClientGone, EdgeRequest, EdgeResponse
from router.metrics import RouterMetrics
from router.proxy.deadlines import Deadlines
from router.proxy.headers import ClientHeaders, RawHeaders, downstream_headers, upstream_headers
from router.proxy.retry import RetryPolicy, Timeouts
from router.proxy.sse import announces_role_only
from router.proxy.upstream import (
    ConnectTimedOut,
    Origin,
    TransportError,
    UpstreamPool,
    UpstreamResponse,
)

__all__ = ["Outcome", "Proxy"]

_SSE = b"text/event-stream"
_DONE = b"data: [DONE]\n\n"
_TIMEOUT_MESSAGES = {
    "timeout_first_byte": "no first byte within the first-byte timeout",
    "timeout_idle": "no data within the idle timeout",
    "timeout_total": "request exceeded the total timeout",
}


class Outcome:
    """What the edge records about one request (metric labels), filled in as it goes.

    A plain class, not a dataclass, as are the other per-request types: a dataclass's generated
    `__init__` stays interpreted even in the compiled build."""

    __slots__ = ("client_gone", "model", "replica", "request_id", "started")

    def __init__(self, started: float, request_id: str) -> None:
        self.started = started  # loop time the request arrived
        self.request_id = request_id
        self.model = "unknown"
        self.replica = "none"
        self.client_gone = False


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed attempt before any byte reached the client (so it may be retried)."""

    replica_id: str
    kind: str  # metric label: connect, disconnect, timeout_*, status_5xx, status_429
    message: str
    timeout: bool = False
    status: int | None = None
    body: bytes = b""
    headers: RawHeaders | None = None


class _RequestHead:
    """The request head every attempt sends, but for the replica's own Host and path prefix."""

    __slots__ = ("content_length", "headers", "method", "target")

    def __init__(self, method: bytes, target: bytes, headers: bytes, content_length: int) -> None:
        self.method = method
        self.target = target  # path and query, as the client sent them
        self.headers = headers  # header lines, hop-by-hop ones dropped
        self.content_length = content_length

    def for_origin(self, origin: Origin) -> bytes:
        return origin.request_head(self.method, self.target, self.headers, self.content_length)


class Proxy:
    """Sends requests to replicas chosen by the routing core; one per gateway."""

    def __init__(
        self,
        *,
        core: RoutingCore,
        pool: UpstreamPool,
        deadlines: Deadlines,
        timeouts: Timeouts,
        retry: RetryPolicy,
        metrics: RouterMetrics,
    ) -> None:
        self._core = core
        self._pool = pool  # connects within timeouts.connect_s; the other timeouts are ours
        self._deadlines = deadlines
        self._timeouts = timeouts
        self._retry = retry
        self._metrics = metrics
        self._ttft: dict[str, Any] = {}
        self._loop = asyncio.get_running_loop()

    async def forward(
        self,
        request: EdgeRequest,
        response: EdgeResponse,
        ctx: RouteContext,
        outcome: Outcome,
        client: ClientHeaders,
    ) -> None:
        """Answer `request` from a replica chosen for `ctx`, retrying before the first byte."""
        body = request.body
        # What every attempt's request head shares; the replica adds its Host and path prefix.
        head = _RequestHead(
            request.method.encode("ascii"),
            request.target.encode("utf-8", "surrogateescape"),
            upstream_headers(client, outcome.request_id, request.remote),
            len(body),
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
            failure = await self._attempt(response, replica, head, body, ctx, outcome)
            if failure is None:
                return
        assert failure is not None
        self._give_up(response, failure, outcome)

    def _give_up(self, response: EdgeResponse, failure: _Failure, outcome: Outcome) -> None:
        """After the last failed attempt: pass a 429 through, else 502/504."""
        if failure.status == 429 and failure.headers is not None:
            headers = downstream_headers(failure.headers, failure.replica_id, outcome.request_id)
            response.send(429, failure.body, headers)
            return
        if failure.timeout:
            raise UpstreamTimeout(failure.message)
        raise UpstreamError(failure.message)

    async def _attempt(
        self,
        response: EdgeResponse,
        replica: Replica,
        head: _RequestHead,
        body: bytes,
        ctx: RouteContext,
        outcome: Outcome,
    ) -> _Failure | None:
        """One attempt on `replica`: None once an answer went to the client (whole, streamed,
        or ended by an error event), else the failure that may be retried elsewhere."""
        loop = self._loop
        timeouts = self._timeouts
        now = loop.time()
        total_deadline = now + timeouts.total_s
        first_deadline = now + timeouts.first_byte_s
        # Until the first body byte the attempt is bound by the first-byte timeout (or the
        # total one, if sooner); then by the total one, with the idle watchdog.
        deadlines = self._deadlines
        if first_deadline < total_deadline:
            deadline = deadlines.arm(first_deadline, "timeout_first_byte")
        else:
            deadline = deadlines.arm(total_deadline, "timeout_total")
        upstream: UpstreamResponse | None = None
        last_chunk = b""
        with self._core.start(replica, ctx) as lease:
            try:
                origin = Origin.of(replica.url)
                upstream = await self._pool.send(origin, head.for_origin(origin), body)
                status = upstream.status
                if self._retry.retryable_status(status):
                    payload = await upstream.read_all()
                    return self._status_failure(lease, upstream, payload)
                first = await upstream.read_chunk()
                # Prefill is over at the first token: a chat stream's role-only first chunk
                # may come before it (not from vLLM; see router.proxy.sse).
                prefilling = ctx.endpoint == "chat" and announces_role_only(first)
                if not prefilling:
                    lease.first_byte()
                self._observe_ttft(ctx.request.model, loop.time() - outcome.started)
                headers = downstream_headers(
                    upstream.headers, replica.replica_id, outcome.request_id
                )
                if upstream.complete:
                    # The whole answer came at once (a non-streamed answer, as usual): head and
                    # body in one write.
                    response.send(status, first, headers, upstream.reason)
                    lease.record_success()
                    return None
                await response.start(
                    status, headers, upstream.reason, upstream.content_length, first
                )
                last_chunk = first
                deadlines.move(deadline, total_deadline, "timeout_total", timeouts.idle_s)
                write = response.write
                read_chunk = upstream.read_chunk
                while first:
                    deadline.waiting_since = loop.time()
                    chunk = await read_chunk()
                    deadline.waiting_since = None
                    if not chunk:
                        break
                    if prefilling and not announces_role_only(chunk):
                        prefilling = False
                        lease.first_byte()
                    await write(chunk)
                    last_chunk = chunk
                await response.end()
                lease.record_success()
                return None
            except ClientGone:
                # Not the replica's fault: no circuit verdict; closing upstream aborts it.
                outcome.client_gone = True
                if upstream is not None and upstream.complete:
                    lease.record_success()
                return None
            except asyncio.CancelledError:
                if not deadline.timed_out():
                    raise  # the client went away, or the gateway is shutting down
                kind, message, timed_out = deadline.kind, _TIMEOUT_MESSAGES[deadline.kind], True
            except TransportError as exc:
                kind, message = exc.kind, str(exc)
                timed_out = isinstance(exc, ConnectTimedOut)
            finally:
                deadlines.disarm(deadline)
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
            if not response.started:
                return _Failure(replica.replica_id, kind, message, timeout=timed_out)
            self._metrics.upstream_errors.labels(replica.replica_id, "stream_broken").inc()
            sse = upstream is not None and upstream.content_type.startswith(_SSE)
            await self._end_broken_stream(response, sse, last_chunk, message, timed_out)
            return None

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
        self, response: EdgeResponse, sse: bool, last_chunk: bytes, message: str, timed_out: bool
    ) -> None:
        """The replica failed after the first byte: tell the client instead of going silent."""
        if sse:
            error = UpstreamTimeout(message) if timed_out else UpstreamError(message)
            event = error_body(error.message, error.error_type, None, error.status)
            # Close a half-written event first so the error event parses on its own.
            prefix = b"" if not last_chunk or last_chunk.endswith(b"\n\n") else b"\n\n"
            try:
                await response.write(prefix + b"data: " + event + b"\n\n" + _DONE)
                await response.end()
                return
            except ClientGone:
                pass
        # A plain body cannot carry an error: drop the connection so the client sees a
        # truncated response rather than a short one that looks complete.
        response.abort()

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
