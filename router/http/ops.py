"""Operational endpoints: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.http.appstate import STATE

__all__ = ["add_ops_routes"]


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 once every configured (or, by default, every discovered) model has a
    replica up; 503 before that and while draining, so load balancers stop sending."""
    state = request.app[STATE]
    up = state.fleet.up_models()
    expected = set(state.config.models) or set(state.fleet.models())
    missing = sorted(m for m in expected if m not in up)
    ok = bool(expected) and not missing and not state.draining
    payload = {
        "ready": ok,
        "draining": state.draining,
        "models": {m: len(rs) for m, rs in sorted(up.items())},
        "missing": missing if expected else ["(no model discovered yet)"],
    }
    return _json(payload, 200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    for replica in state.fleet:  # circuit state moves with time: publish its current value
        state.fleet.publish(replica)
    resp = web.Response(body=generate_latest(state.metrics.registry))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


def add_ops_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
