"""Which headers cross the proxy, in each direction."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
_REQUEST_DROP_WITH_PEER = _REQUEST_DROP | {"x-forwarded-for"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server", REQUEST_ID_HEADER}


def _connection_tokens(connection_values: Iterable[str]) -> frozenset[str]:
    # Headers named in Connection are hop-by-hop too (RFC 9110 §7.6.1).
    return frozenset(
        token
        for value in connection_values
        for token in (t.strip().lower() for t in value.split(","))
        if token
    )


def upstream_headers(
    incoming: CIMultiDictProxy[str], request_id: str, peer: str | None
) -> list[tuple[str, str]]:
    """The client's headers as sent to the replica: hop-by-hop dropped, request id set."""
    drop = _REQUEST_DROP_WITH_PEER if peer else _REQUEST_DROP
    if "connection" in incoming:
        drop = drop | _connection_tokens(incoming.getall("connection"))
    out = [(key, value) for key, value in incoming.items() if key.lower() not in drop]
    out.append(("X-Request-Id", request_id))
    if peer:  # the peer joins the chain (the incoming header itself was dropped above)
        previous = ", ".join(incoming.getall("x-forwarded-for", ()))
        out.append(("X-Forwarded-For", f"{previous}, {peer}" if previous else peer))
    return out


def downstream_headers(
    upstream: Sequence[tuple[str, str]], replica_id: str, request_id: str
) -> CIMultiDict[str]:
    """The replica's headers as sent to the client, naming the replica and the request id."""
    out: CIMultiDict[str] = CIMultiDict()
    copy_downstream_headers(out, upstream, replica_id, request_id)
    return out


def copy_downstream_headers(
    out: CIMultiDict[str], upstream: Sequence[tuple[str, str]], replica_id: str, request_id: str
) -> None:
    """Add `downstream_headers` to `out` (a response's own headers: no intermediate copy).
    `upstream` is the replica's header list, in order, repeats included."""
    drop = _RESPONSE_DROP
    connection = [value for key, value in upstream if key.lower() == "connection"]
    if connection:
        drop = drop | _connection_tokens(connection)
    add = out.add
    for key, value in upstream:
        if key.lower() not in drop:
            add(key, value)
    out[REPLICA_HEADER] = replica_id
    out[REQUEST_ID_HEADER] = request_id
