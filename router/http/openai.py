"""The OpenAI-compatible endpoints: parse, validate, call the routing core, forward, record.

The POST endpoints are the data plane, answered on the edge server (`serve_openai`); the model
list is an ordinary route of the control application."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from router.core import Endpoint
from router.errors import RouterError
from router.http.appstate import STATE, GatewayState
from router.http.edge import EdgeRequest, EdgeResponse
from router.http.errors import send_error
from router.http.validation import parse_json_object, validate
from router.proxy.forward import Outcome
from router.proxy.headers import new_request_id, read_client_headers

__all__ = ["OPENAI_ENDPOINTS", "add_openai_routes", "serve_openai"]


async def serve_openai(
    state: GatewayState, endpoint: Endpoint, request: EdgeRequest, response: EdgeResponse
) -> None:
    """Answer one OpenAI request: parse, validate, route, forward; record its outcome.

    The edge server has already read the whole body and refused one over the size limit.
    """
    loop = state.loop or asyncio.get_running_loop()
    client = read_client_headers(request.raw_headers, state.session_header)
    outcome = Outcome(started=loop.time(), request_id=client.request_id or new_request_id())
    status = 500
    try:
        try:
            body = parse_json_object(request.body)
            parsed = validate(endpoint, body)
            core = state.core
            model = core.resolve_model(parsed.model)
            outcome.model = model
            session_key = client.session or parsed.user
            ctx = core.prepare(endpoint, body, model, session_key=session_key)
            await state.require_proxy().forward(request, response, ctx, outcome, client)
        except RouterError as exc:
            send_error(response, exc, outcome.request_id)
        status = 499 if outcome.client_gone else response.status
    except asyncio.CancelledError:
        status = 499  # the client went away (nginx's convention)
        raise
    finally:
        state.metrics.request_done(
            outcome.model, outcome.replica, status, loop.time() - outcome.started
        )


async def list_models(request: web.Request) -> web.Response:
    """The union of the models served by replicas that are up (their own cards, merged)."""
    fleet = request.app[STATE].fleet
    data: list[dict[str, Any]] = []
    for model, replicas in sorted(fleet.up_models().items()):
        card = dict(replicas[0].model_cards.get(model) or {"id": model, "object": "model"})
        card.setdefault("object", "model")
        card.setdefault("owned_by", "fleet-router")
        data.append(card)
    return web.Response(
        body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
    )


# The data plane: answered by the edge server itself (router.http.dispatch), never relayed.
OPENAI_ENDPOINTS: dict[str, Endpoint] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embeddings",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}


def add_openai_routes(app: web.Application) -> None:
    """The control application's OpenAI route (the model list)."""
    app.router.add_get("/v1/models", list_models)
