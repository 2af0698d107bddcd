"""Which headers cross the proxy, in each direction."""

from __future__ import annotations

from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "HOP_BY_HOP",
    "REPLICA_HEADER",
    "REQUEST_ID_HEADER",
    "copy_downstream_headers",
    "downstream_headers",
    "upstream_headers",
]

REPLICA_HEADER = "x-fleet-replica"
REQUEST_ID_HEADER = "x-request-id"

# RFC 9110 §7.6.1 connection-specific headers, plus the legacy ones proxies also drop.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by our own HTTP stack on each side.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect", REQUEST_ID_HEADER}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server", REQUEST_ID_HEADER}


def _connection_tokens(headers: CIMultiDictProxy[str]) -> Iterable[str]:
    # Headers named in Connection are hop-by-hop too (RFC 9110 §7.6.1).
    for value in headers.getall("connection", ()):
        for token in value.split(","):
            token = token.strip().lower()
            if token:
                yield token


def upstream_headers(
    incoming: CIMultiDictProxy[str], request_id: str, peer: str | None
) -> CIMultiDict[str]:
    """The client's headers as sent to the replica: hop-by-hop dropped, request id set."""
    drop = _REQUEST_DROP
    if "connection" in incoming:
        drop = drop | frozenset(_connection_tokens(incoming))
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in incoming.items():
        if key.lower() not in drop:
            out.add(key, value)
    out[REQUEST_ID_HEADER] = request_id
    if peer:
        previous = incoming.get("x-forwarded-for")
        out["X-Forwarded-For"] = f"{previous}, {peer}" if previous else peer
    return out


def downstream_headers(
    upstream: CIMultiDictProxy[str], replica_id: str, request_id: str
) -> CIMultiDict[str]:
    """The replica's headers as sent to the client, naming the replica and the request id."""
    out: CIMultiDict[str] = CIMultiDict()
    copy_downstream_headers(out, upstream, replica_id, request_id)
    return out


def copy_downstream_headers(
    out: CIMultiDict[str], upstream: CIMultiDictProxy[str], replica_id: str, request_id: str
) -> None:
    """Add `downstream_headers` to `out` (a response's own headers: no intermediate copy)."""
    drop = _RESPONSE_DROP
    if "connection" in upstream:
        drop = drop | frozenset(_connection_tokens(upstream))
    add = out.add
    for key, value in upstream.items():
        if key.lower() not in drop:
            add(key, value)
    out[REPLICA_HEADER] = replica_id
    out[REQUEST_ID_HEADER] = request_id
