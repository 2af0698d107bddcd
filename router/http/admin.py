"""The admin API: list, add and remove replicas at run time.

Registered only when an admin token is configured (otherwise these paths are 404), and every
call needs `Authorization: Bearer <token>` (401 otherwise).
"""

from __future__ import annotations

import hmac

import orjson
from aiohttp import web

from router.config import parse_replica_spec
from router.errors import BadRequest, ConfigError, Unauthorized
from router.http.appstate import STATE, GatewayState
from router.http.validation import parse_json_object

__all__ = ["add_admin_routes"]


def _authorized_state(request: web.Request) -> GatewayState:
    state = request.app[STATE]
    token = state.config.admin_token
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if (
        token is None
        or scheme.lower() != "bearer"
        or not hmac.compare_digest(given.strip().encode(), token.encode())
    ):
        raise Unauthorized("a valid admin bearer token is required")
    return state


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


async def list_replicas(request: web.Request) -> web.Response:
    state = _authorized_state(request)
    return _json({"replicas": [r.describe() for r in state.fleet]})


async def add_replica(request: web.Request) -> web.Response:
    """Body `{"url": "http://host:port", "name": optional}`; answers 201 with its state."""
    state = _authorized_state(request)
    body = parse_json_object(await request.read())
    url, name = body.get("url"), body.get("name")
    if not isinstance(url, str) or (name is not None and not isinstance(name, str)):
        raise BadRequest('expected {"url": string, "name": optional string}', param="url")
    try:
        spec = parse_replica_spec(f"{name}={url}" if name else url)
    except ConfigError as exc:
        raise BadRequest(exc.message, param="url") from None
    replica = state.fleet.add(spec, source="admin")
    if state.health is not None:  # probe now so it serves at once when it is up
        await state.health.check(replica)
    return _json({"replica": replica.describe()}, status=201)


async def remove_replica(request: web.Request) -> web.Response:
    """`DELETE /admin/replicas/{id}` or `DELETE /admin/replicas?id=...` (for URL ids)."""
    state = _authorized_state(request)
    replica_id = request.match_info.get("replica_id") or request.query.get("id")
    if not replica_id:
        raise BadRequest("name the replica: /admin/replicas/{id} or ?id=", param="id")
    replica = state.fleet.remove(replica_id)
    return _json({"removed": replica.describe()})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/replicas", list_replicas)
    app.router.add_post("/admin/replicas", add_replica)
    app.router.add_delete("/admin/replicas", remove_replica)
    app.router.add_delete("/admin/replicas/{replica_id}", remove_replica)
