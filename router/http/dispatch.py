"""What the edge server does with each request: the OpenAI POST endpoints are answered here
(the data plane); everything else is relayed to the gateway's aiohttp control application on
its private Unix socket, and its answer streamed back unchanged but for framing headers."""

from __future__ import annotations

from router.errors import MethodNotAllowed, Unavailable
from router.http.appstate import GatewayState
from router.http.edge import EdgeRequest, EdgeResponse
from router.http.errors import send_error
from router.http.openai import OPENAI_ENDPOINTS, serve_openai
from router.proxy.headers import (
    relayed_request_headers,
    relayed_response_headers,
    request_id_of,
)
from router.proxy.upstream import Origin, TransportError, UpstreamPool

__all__ = ["Dispatch"]


class Dispatch:
    """The edge server's handler for one gateway."""

    def __init__(self, state: GatewayState, pool: UpstreamPool, control: Origin) -> None:
        self._state = state
        self._pool = pool
        self._control = control

    async def __call__(self, request: EdgeRequest, response: EdgeResponse) -> None:
        endpoint = OPENAI_ENDPOINTS.get(request.path)
        if endpoint is None:
            await self._relay(request, response)
        elif request.method == "POST":
            await serve_openai(self._state, endpoint, request, response)
        else:
            message = f"{request.method} is not allowed on {request.path}; use POST"
            send_error(
                response,
                MethodNotAllowed(message, allow="POST"),
                request_id_of(request.raw_headers),
            )

    async def _relay(self, request: EdgeRequest, response: EdgeResponse) -> None:
        # A HEAD goes on as a GET (our client reads every answer's body); the edge then sends
        # only the head.
        method = b"GET" if request.method == "HEAD" else request.method.encode("ascii")
        request_id = request_id_of(request.raw_headers)
        head = self._control.request_head(
            method,
            request.target.encode("utf-8", "surrogateescape"),
            relayed_request_headers(request.raw_headers, request_id),
            len(request.body),
        )
        try:
            upstream = await self._pool.send(self._control, head, request.body)
        except TransportError as exc:  # only while the gateway shuts down
            message = f"the gateway's control application is unavailable: {exc}"
            send_error(response, Unavailable(message), request_id)
            return
        try:
            first = await upstream.read_chunk()
            headers = relayed_response_headers(upstream.headers)
            if upstream.complete:
                response.send(upstream.status, first, headers, upstream.reason)
                return
            await response.start(upstream.status, headers, upstream.reason, upstream.content_length)
            while first:
                await response.write(first)
                first = await upstream.read_chunk()
            await response.end()
        finally:
            if upstream.complete:
                upstream.release()
            else:
                upstream.abort()
