"""Which headers cross the proxy, in each direction.

Headers stay the bytes they came in as (`(name, value)` pairs from the parser, in order,
repeats included) and leave as ready-made header lines: nothing is decoded and re-encoded on
the way through, and a name is compared in lower case against the drop lists below.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = [
    "HOP_BY_HOP",
    "REPLICA_HEADER",
    "REQUEST_ID_HEADER",
    "ClientHeaders",
    "RawHeaders",
    "downstream_headers",
    "header_lines",
    "new_request_id",
    "read_client_headers",
    "relayed_request_headers",
    "relayed_response_headers",
    "request_id_of",
    "upstream_headers",
]

RawHeaders = Sequence[tuple[bytes, bytes]]

REPLICA_HEADER = "x-fleet-replica"
REQUEST_ID_HEADER = "x-request-id"

# RFC 9110 §7.6.1 connection-specific headers, plus the legacy ones proxies also drop.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Recomputed by our own HTTP stack on each side.
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"x-request-id"}
# Proxied requests: X-Forwarded-For is rebuilt with the peer appended.
_REQUEST_DROP_WITH_PEER = _REQUEST_DROP | {b"x-forwarded-for"}
_RESPONSE_DROP = HOP_BY_HOP | {b"content-length", b"date", b"server", b"x-request-id"}
# The gateway's own control application answers with the request id it was sent: kept.
_RELAY_RESPONSE_DROP = _RESPONSE_DROP - {b"x-request-id"}


def header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """`Name: value\\r\\n` lines for headers given as text."""
    return b"".join(
        f"{name}: {value}\r\n".encode("utf-8", "surrogateescape") for name, value in headers
    )


class _RequestIds:
    """Request ids: a random per-process prefix and a counter.  Unique (a forked worker draws a
    new prefix), not secret, and far cheaper than 128 fresh random bits, whose formatting
    alone cost more than routing a request."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._prefix = f"{random.SystemRandom().getrandbits(64):016x}"
        self._counter = itertools.count()

    def new(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


_REQUEST_IDS = _RequestIds()
os.register_at_fork(after_in_child=_REQUEST_IDS.reset)


def new_request_id() -> str:
    """A fresh request id: 32 hex digits, unique across processes and restarts."""
    return _REQUEST_IDS.new()


def request_id_of(incoming: RawHeaders) -> str:
    """The client's X-Request-Id, or a fresh one: every answer of the router carries one."""
    for key, value in incoming:
        if key.lower() == b"x-request-id":
            return value.decode("utf-8", "surrogateescape")
    return new_request_id()


class ClientHeaders(NamedTuple):
    """What the proxy takes from a client's headers, read in one pass."""

    lines: bytes  # to forward: all but hop-by-hop, Host, Content-Length, Expect, the two below
    request_id: str | None  # X-Request-Id
    forwarded_for: bytes  # the incoming X-Forwarded-For chain (b"" when absent)
    session: str | None  # the value of the configured session header


def read_client_headers(incoming: RawHeaders, session_header: bytes) -> ClientHeaders:
    """One pass over a request's headers (`session_header` in lower case)."""
    lines = []
    request_id = session = None
    chain: list[bytes] = []
    hop_named = False
    for key, value in incoming:
        lower = key.lower()
        if lower in _REQUEST_DROP_WITH_PEER:
            if lower == b"x-request-id":
                request_id = request_id or value.decode("utf-8", "surrogateescape")
            elif lower == b"x-forwarded-for":
                chain.append(value)
            elif lower == b"connection":
                hop_named = True
            continue
        if lower == session_header and session is None:
            session = value.decode("utf-8", "surrogateescape")
        lines.append(b"%s: %s\r\n" % (key, value))
    if hop_named:  # rare: Connection names more headers to drop
        lines = _kept_lines(incoming, _REQUEST_DROP_WITH_PEER)
    return ClientHeaders(b"".join(lines), request_id, b", ".join(chain), session)


def upstream_headers(client: ClientHeaders, request_id: str, peer: str | None) -> bytes:
    """The client's header lines as sent to the replica: the request id set, the peer appended
    to X-Forwarded-For."""
    chain = client.forwarded_for
    if peer:
        chain = chain + b", " + peer.encode() if chain else peer.encode()
    forwarded = b"X-Forwarded-For: %s\r\n" % chain if chain else b""
    rid = request_id.encode("utf-8", "surrogateescape")
    return b"%sX-Request-Id: %s\r\n%s" % (client.lines, rid, forwarded)


def downstream_headers(upstream: RawHeaders, replica_id: str, request_id: str) -> bytes:
    """The replica's header lines as sent to the client, naming the replica and the request."""
    lines = _kept_lines(upstream, _RESPONSE_DROP)
    lines.append(
        f"{REPLICA_HEADER}: {replica_id}\r\n{REQUEST_ID_HEADER}: {request_id}\r\n".encode(
            "utf-8", "surrogateescape"
        )
    )
    return b"".join(lines)


def relayed_request_headers(incoming: RawHeaders, request_id: str) -> bytes:
    """A request's header lines as relayed to the gateway's own control application, with
    `request_id` (`request_id_of` the request), which the control application echoes."""
    lines = _kept_lines(incoming, _REQUEST_DROP)
    lines.append(b"X-Request-Id: %s\r\n" % request_id.encode("utf-8", "surrogateescape"))
    return b"".join(lines)


def relayed_response_headers(upstream: RawHeaders) -> bytes:
    """The control application's answer header lines as relayed to the client."""
    return b"".join(_kept_lines(upstream, _RELAY_RESPONSE_DROP))


def _kept_lines(headers: RawHeaders, drop: frozenset[bytes]) -> list[bytes]:
    for key, value in headers:
        if key.lower() == b"connection":
            # Headers named in Connection are hop-by-hop too (RFC 9110 §7.6.1).
            drop = drop | {t.strip().lower() for t in value.split(b",") if t.strip()}
    return [b"%s: %s\r\n" % (key, value) for key, value in headers if key.lower() not in drop]
