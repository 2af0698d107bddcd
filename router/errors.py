"""The one error hierarchy of the router.

Every error the router raises on purpose derives from `RouterError`; `router.http.errors` turns
any of them into an HTTP answer in one function, its body made by `error_body` (the one maker of
OpenAI-style error bodies, also used for the SSE error event of a broken stream).  The tree::

    RouterError                      500  internal_error
    ├── ConfigError                  (startup only: bad flags, env or YAML; never an HTTP answer)
    ├── BadRequest                   400  invalid_request_error (also: malformed HTTP)
    │   ├── PayloadTooLarge          413
    │   └── HeadTooLarge             431  (request line and headers over the edge's limit)
    ├── Unauthorized                 401  authentication_error
    ├── NotFound                     404  not_found_error
    │   └── UnknownModel             404  (code model_not_found)
    ├── MethodNotAllowed             405  invalid_request_error (with Allow)
    ├── Conflict                     409  conflict (e.g. a replica registered twice)
    ├── Unavailable                  503  service_unavailable
    │   └── NoHealthyReplica         503  (with Retry-After)
    └── UpstreamError                502  upstream_error (a replica failed after all retries)
        └── UpstreamTimeout          504  (connect, first byte, idle or total timeout)
"""

from __future__ import annotations

from typing import ClassVar

import orjson

__all__ = [
    "BadRequest",
    "ConfigError",
    "Conflict",
    "HeadTooLarge",
    "MethodNotAllowed",
    "NoHealthyReplica",
    "NotFound",
    "PayloadTooLarge",
    "RouterError",
    "Unauthorized",
    "Unavailable",
    "UnknownModel",
    "UpstreamError",
    "UpstreamTimeout",
    "error_body",
]


def error_body(message: str, error_type: str, param: str | None, code: str | int | None) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}`, the OpenAI error shape, as JSON."""
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )


class RouterError(Exception):
    """Base of every error the router raises on purpose."""

    # Class-level constants (ClassVar: one value per class, never per instance).
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        """This error's OpenAI-style answer body."""
        return error_body(self.message, self.error_type, self.param, self.code or self.status)


class ConfigError(RouterError):
    """Invalid settings (flags, environment or YAML); raised before anything starts."""


class BadRequest(RouterError):
    """The client sent something the router cannot route (invalid JSON, wrong types, ...)."""

    status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    """The request body exceeds `max_body_bytes`."""

    status = 413
    code = "payload_too_large"


class HeadTooLarge(BadRequest):
    """The request line and headers exceed the edge server's limit."""

    status = 431


class Unauthorized(RouterError):
    """A protected endpoint was called without the right bearer token."""

    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class NotFound(RouterError):
    """No such route or resource."""

    status = 404
    error_type = "not_found_error"


class UnknownModel(NotFound):
    """No replica of the fleet has ever served the requested model."""

    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")
        self.model = model


class MethodNotAllowed(RouterError):
    """The route exists, not with this method; `allow` lists the ones it takes."""

    status = 405
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow


class Conflict(RouterError):
    """The resource already exists (e.g. a replica with that id or URL)."""

    status = 409
    error_type = "conflict"


class Unavailable(RouterError):
    """The gateway cannot serve this now (e.g. it is shutting down)."""

    status = 503
    error_type = "service_unavailable"


class NoHealthyReplica(Unavailable):
    """The model is known but no replica serving it is up right now (answered with Retry-After)."""

    code = "no_healthy_replica"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(RouterError):
    """The chosen replicas failed (connection error, 5xx) and retries are exhausted."""

    status = 502
    error_type = "upstream_error"
    code = "bad_gateway"


class UpstreamTimeout(UpstreamError):
    """A replica did not connect, answer or continue its answer in time."""

    status = 504
    code = "gateway_timeout"
