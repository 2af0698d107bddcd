"""JSONL request traces: replay a recorded arrival pattern, or save a workload for later.

One request per line::

    {"timestamp": 0.25, "prompt": "...", "max_tokens": 128}
    {"timestamp": 0.40, "messages": [{"role": "user", "content": "..."}], "max_tokens": 64}

``timestamp`` is seconds from the start of the trace (sorted on load); optional keys are
``ignore_eos`` (default true: produce exactly ``max_tokens``) and ``session`` (a conversation id).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from loadtest.workloads import Message, RequestSpec, Session, Turn, WorkloadError

__all__ = ["TraceError", "count_trace", "load_trace", "write_trace"]


class TraceError(WorkloadError):
    """A trace file is missing or a line of it is malformed."""


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    try:
        with Path(path).open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None


def _messages(raw: Any, where: str) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise TraceError(f"{where}: messages must be a non-empty list")
    out: list[Message] = []
    for item in raw:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("role"), str)
            and isinstance(item.get("content"), str)
        ):
            raise TraceError(f"{where}: each message needs string 'role' and 'content'")
        out.append((item["role"], item["content"]))
    return tuple(out)


def _parse(number: int, line: bytes, path: str, time_scale: float) -> Session:
    where = f"{path}:{number}"
    try:
        entry = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(entry, dict):
        raise TraceError(f"{where}: each line must be a JSON object")
    timestamp = entry.get("timestamp", 0.0)
    max_tokens = entry.get("max_tokens")
    if not isinstance(timestamp, int | float) or timestamp < 0:
        raise TraceError(f"{where}: timestamp must be a number >= 0")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise TraceError(f"{where}: max_tokens must be an integer >= 1")
    ignore_eos = entry.get("ignore_eos", True)
    if not isinstance(ignore_eos, bool):
        raise TraceError(f"{where}: ignore_eos must be true or false")
    session = entry.get("session")
    if session is not None and not isinstance(session, str):
        raise TraceError(f"{where}: session must be a string")
    if "messages" in entry:
        turn = Turn(
            user="",
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            messages=_messages(entry["messages"], where),
        )
    elif isinstance(entry.get("prompt"), str):
        turn = Turn(user=entry["prompt"], max_tokens=max_tokens, ignore_eos=ignore_eos)
    else:
        raise TraceError(f"{where}: needs a string 'prompt' or a 'messages' list")
    return Session(
        session_id=f"trace-{number}",
        turns=(turn,),
        at_s=float(timestamp) * time_scale,
        session_key=session,
    )


def load_trace(path: str, *, time_scale: float = 1.0) -> Iterator[Session]:
    """Sessions of the trace, sorted by timestamp (scaled by ``time_scale``)."""
    sessions = [_parse(n, line, path, time_scale) for n, line in _lines(path)]
    if not sessions:
        raise TraceError(f"trace {path} has no requests")
    sessions.sort(key=lambda s: s.at_s or 0.0)
    return iter(sessions)


def count_trace(path: str) -> int:
    """Number of requests in the trace (non-blank lines)."""
    return sum(1 for _ in _lines(path))


def write_trace(path: str, timed: Iterable[tuple[float, RequestSpec]]) -> int:
    """Write ``(timestamp_s, request)`` pairs as a trace; returns the number of lines."""
    count = 0
    with Path(path).open("wb") as handle:
        for timestamp, spec in timed:
            entry: dict[str, Any] = {"timestamp": round(timestamp, 6)}
            if spec.messages is not None:
                entry["messages"] = [{"role": r, "content": c} for r, c in spec.messages]
            else:
                entry["prompt"] = spec.prompt
            entry["max_tokens"] = spec.max_tokens
            if not spec.ignore_eos:
                entry["ignore_eos"] = False
            if spec.session is not None:
                entry["session"] = spec.session
            handle.write(orjson.dumps(entry) + b"\n")
            count += 1
    return count
