"""Which headers cross the proxy, in each direction.

Headers stay the bytes they came in as (`(name, value)` pairs from the parser, in order,
repeats included) and leave as ready-made header lines: nothing is decoded and re-encoded on
the way through, and a name is compared in lower case against the drop lists below.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "HOP_BY_HOP",
    "REPLICA_HEADER",
    "REQUEST_ID_HEADER",
    "RawHeaders",
    "downstream_headers",
    "header_lines",
    "header_value",
    "relayed_request_headers",
    "relayed_response_headers",
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
_REQUEST_DROP_WITH_PEER = _REQUEST_DROP | {b"x-forwarded-for"}
_RESPONSE_DROP = HOP_BY_HOP | {b"content-length", b"date", b"server", b"x-request-id"}
# The gateway's own control application: its request id is the client's, kept both ways.
_RELAY_REQUEST_DROP = _REQUEST_DROP - {b"x-request-id"}
_RELAY_RESPONSE_DROP = _RESPONSE_DROP - {b"x-request-id"}


def header_value(headers: RawHeaders, name: bytes) -> str | None:
    """The first value of header `name` (lower case), decoded; None when absent."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("utf-8", "surrogateescape")
    return None


def header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """`Name: value\\r\\n` lines for headers given as text."""
    return b"".join(
        f"{name}: {value}\r\n".encode("utf-8", "surrogateescape") for name, value in headers
    )


def upstream_headers(incoming: RawHeaders, request_id: str, peer: str | None) -> bytes:
    """The client's header lines as sent to the replica: hop-by-hop dropped, request id set,
    the peer appended to X-Forwarded-For."""
    drop = _REQUEST_DROP_WITH_PEER if peer else _REQUEST_DROP
    lines = _kept_lines(incoming, drop)
    lines.append(b"X-Request-Id: %s\r\n" % request_id.encode("utf-8", "surrogateescape"))
    if peer:
        previous = b", ".join(v for k, v in incoming if k.lower() == b"x-forwarded-for")
        chain = previous + b", " + peer.encode() if previous else peer.encode()
        lines.append(b"X-Forwarded-For: %s\r\n" % chain)
    return b"".join(lines)


def downstream_headers(upstream: RawHeaders, replica_id: str, request_id: str) -> bytes:
    """The replica's header lines as sent to the client, naming the replica and the request."""
    lines = _kept_lines(upstream, _RESPONSE_DROP)
    lines.append(
        f"{REPLICA_HEADER}: {replica_id}\r\n{REQUEST_ID_HEADER}: {request_id}\r\n".encode(
            "utf-8", "surrogateescape"
        )
    )
    return b"".join(lines)


def relayed_request_headers(incoming: RawHeaders) -> bytes:
    """A request's header lines as relayed to the gateway's own control application."""
    return b"".join(_kept_lines(incoming, _RELAY_REQUEST_DROP))


def relayed_response_headers(upstream: RawHeaders) -> bytes:
    """The control application's answer header lines as relayed to the client."""
    return b"".join(_kept_lines(upstream, _RELAY_RESPONSE_DROP))


def _kept_lines(headers: RawHeaders, drop: frozenset[bytes]) -> list[bytes]:
    for key, value in headers:
        if key.lower() == b"connection":
            # Headers named in Connection are hop-by-hop too (RFC 9110 §7.6.1).
            drop = drop | {t.strip().lower() for t in value.split(b",") if t.strip()}
    return [b"%s: %s\r\n" % (key, value) for key, value in headers if key.lower() not in drop]
