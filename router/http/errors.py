"""Errors to OpenAI-style HTTP answers, in one place.

Every error body has the shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler

from router.errors import MethodNotAllowed, NoHealthyReplica, RouterError, error_body
from router.proxy.headers import REQUEST_ID_HEADER

if TYPE_CHECKING:  # the edge server answers its own errors through send_error
    from router.http.edge import EdgeResponse

__all__ = ["error_headers", "error_middleware", "error_response", "send_error"]

log = logging.getLogger(__name__)


def error_headers(exc: RouterError, request_id: str | None = None) -> dict[str, str]:
    """The headers of any `RouterError`'s answer (Retry-After on 503, Allow on 405, the
    request id)."""
    headers = {"Content-Type": "application/json"}
    if isinstance(exc, NoHealthyReplica):
        headers["Retry-After"] = str(exc.retry_after_s)
    elif isinstance(exc, MethodNotAllowed):
        headers["Allow"] = exc.allow
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    return headers


def error_response(exc: RouterError, request_id: str | None = None) -> web.Response:
    """The control application's answer for any `RouterError`."""
    return web.Response(status=exc.status, body=exc.body(), headers=error_headers(exc, request_id))


def send_error(response: EdgeResponse, exc: RouterError, request_id: str | None = None) -> None:
    """The data plane's answer for any `RouterError` (same status, body and headers)."""
    response.send(exc.status, exc.body(), error_headers(exc, request_id))


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """OpenAI-style bodies for everything that escapes a handler (unknown routes, 405, bugs),
    and on every answer the request id the edge relayed (the client's, or one it made)."""
    response = await _answer(request, handler)
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is not None and not response.prepared:
        response.headers.setdefault(REQUEST_ID_HEADER, request_id)
    return response


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RouterError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.Response(
            status=exc.status,
            body=error_body(
                exc.reason
                if exc.status != 404
                else f"no route for {request.method} {request.path}",
                _TYPES.get(exc.status, "invalid_request_error"),
                None,
                exc.status,
            ),
            content_type="application/json",
            headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"},
        )
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.Response(
            status=500,
            body=error_body("internal router error", "internal_error", None, 500),
            content_type="application/json",
        )
