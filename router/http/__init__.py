"""The HTTP edge: OpenAI endpoints, operational endpoints, admin API, error answers."""

from router.http.admin import add_admin_routes
from router.http.appstate import STATE, GatewayState
from router.http.errors import error_middleware, error_response
from router.http.openai import add_openai_routes
from router.http.ops import add_ops_routes

__all__ = [
    "STATE",
    "GatewayState",
    "add_admin_routes",
    "add_openai_routes",
    "add_ops_routes",
    "error_middleware",
    "error_response",
]
