"""The streaming client: one aiohttp session, one OpenAI-style streamed request at a time per call.

For each request it records what vLLM's bench serve records and a little more: the send time,
every content chunk's arrival (the first one is TTFT), the end of the stream (E2E), output and
prompt tokens from the final usage chunk (``stream_options.include_usage``), cached prompt tokens
when the server reports them (``usage.prompt_tokens_details.cached_tokens``), the replica that
served it when a fleet-router is in front (``x-fleet-replica`` response header), and on failure
one cause out of a small fixed set (see :data:`ERROR_CAUSES`).

Times come from ``time.perf_counter()``; a record holds absolute values and the report subtracts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp
import orjson

from loadtest.workloads import RequestSpec

__all__ = [
    "ERROR_CAUSES",
    "REPLICA_HEADER",
    "RequestRecord",
    "StreamAccumulator",
    "StreamingClient",
    "build_payload",
]

REPLICA_HEADER = "x-fleet-replica"

# Failure causes: "http_<status>" for a non-200 answer, plus these.
ERROR_CAUSES = (
    "timeout",  # no answer / the stream stalled beyond the request timeout
    "connection",  # refused, reset, or the server went away mid-stream
    "stream_error",  # the server sent an error event inside the stream
    "incomplete_stream",  # the stream ended without `data: [DONE]`
    "no_content",  # the stream finished but carried no content at all
)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; times are ``perf_counter`` seconds."""

    spec: RequestSpec
    send_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)  # arrival of every content chunk
    end_s: float | None = None  # last byte of the stream (after `[DONE]`)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    replica: str | None = None
    status: int | None = None
    error: str | None = None  # a cause from ERROR_CAUSES or "http_<status>"; None when it succeeded
    error_detail: str = ""
    text: str = ""
    warmup: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.send_s if self.chunk_s else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.send_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output - 1), defined only when more than one token came back."""
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.output_tokens <= 1:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)


def build_payload(spec: RequestSpec, model: str) -> dict[str, Any]:
    """The JSON body for ``spec``: streamed, with usage, fixed output length when asked."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.messages is not None:
        body["messages"] = [{"role": role, "content": text} for role, text in spec.messages]
    else:
        body["prompt"] = spec.prompt
    if spec.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension: produce exactly max_tokens
    if spec.session is not None:
        body["user"] = spec.session  # OpenAI's end-user field; routers may key sessions on it
    return body


def _path(spec: RequestSpec) -> str:
    return "/v1/chat/completions" if spec.messages is not None else "/v1/completions"


def _chunk_text(choice: Mapping[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        content = delta.get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class StreamingClient:
    """One shared aiohttp session (TCP_NODELAY, unlimited pool) used by every request of a run.

    ``async with StreamingClient(model=m) as client: record = await client.send(url, spec)``.
    """

    def __init__(
        self,
        *,
        model: str,
        request_timeout_s: float = 300.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._model = model
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StreamingClient:
        # aiohttp sets TCP_NODELAY on every connection it makes (base_protocol.connection_made);
        # limit=0 so the client never queues requests behind its own pool.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, headers=self._headers
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self, base_url: str, spec: RequestSpec, *, warmup: bool = False
    ) -> RequestRecord:
        """Send ``spec`` to ``base_url``, stream the answer; request failures are recorded."""
        if self._session is None:
            raise RuntimeError("StreamingClient used outside `async with`")
        record = RequestRecord(spec=spec, warmup=warmup)
        body = orjson.dumps(build_payload(spec, self._model))
        url = base_url.rstrip("/") + _path(spec)
        record.send_s = time.perf_counter()
        try:
            async with self._session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as response:
                record.status = response.status
                record.replica = response.headers.get(REPLICA_HEADER)
                if response.status != 200:
                    record.error = f"http_{response.status}"
                    record.error_detail = (await response.text())[:500]
                    record.end_s = time.perf_counter()
                    return record
                await self._read_stream(response, record)
        except TimeoutError as exc:
            record.error, record.error_detail = "timeout", repr(exc)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            record.error, record.error_detail = "connection", repr(exc)
        if record.end_s is None:
            record.end_s = time.perf_counter()
        return record

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestRecord) -> None:
        stream = StreamAccumulator(record)
        async for raw in response.content:
            if not stream.feed(raw, time.perf_counter()):
                break
        stream.finish(time.perf_counter())


class StreamAccumulator:
    """Folds the lines of one SSE stream into a :class:`RequestRecord` (pure: no I/O, no clock)."""

    def __init__(self, record: RequestRecord) -> None:
        self._record = record
        self._parts: list[str] = []
        self._done = False

    def feed(self, raw: bytes, now_s: float) -> bool:
        """Take one line that arrived at ``now_s``; False once the stream has failed."""
        record = self._record
        line = raw.strip()
        if not line.startswith(b"data:"):
            return True  # blank separators, SSE comments (": ping"), event names
        data = line[5:].strip()
        if data == b"[DONE]":
            self._done = True
            return True
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            record.error = "stream_error"
            record.error_detail = data[:200].decode(errors="replace")
            return False
        if not isinstance(event, dict):
            return True
        if "error" in event:
            record.error, record.error_detail = "stream_error", str(event["error"])[:500]
            return False
        choices = event.get("choices") or []
        if choices and isinstance(choices[0], Mapping):
            text = _chunk_text(choices[0])
            if text:
                record.chunk_s.append(now_s)
                self._parts.append(text)
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            _read_usage(usage, record)
        return True

    def finish(self, now_s: float) -> None:
        """The stream ended at ``now_s``: set the end time, the text and any failure."""
        record = self._record
        record.end_s = now_s
        record.text = "".join(self._parts)
        if record.error is not None:
            return
        if not self._done:
            record.error = "incomplete_stream"
        elif not record.chunk_s:
            record.error = "no_content"
        elif record.output_tokens == 0:
            # No usage reported: fall back to one token per content chunk.
            record.output_tokens = len(record.chunk_s)


def _read_usage(usage: Mapping[str, Any], record: RequestRecord) -> None:
    completion = usage.get("completion_tokens")
    if isinstance(completion, int):
        record.output_tokens = completion
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        record.prompt_tokens = prompt
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        cached = details.get("cached_tokens")
        if isinstance(cached, int):
            record.cached_tokens = cached
