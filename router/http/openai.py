"""The OpenAI-compatible endpoints: parse, validate, call the routing core, forward, record."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from router.core import Endpoint
from router.errors import BadRequest, PayloadTooLarge, RouterError
from router.http.appstate import STATE, GatewayState
from router.http.errors import error_response
from router.http.validation import parse_json_object, validate
from router.proxy.forward import Outcome, request_id_of

__all__ = ["add_openai_routes"]


async def _read_body(request: web.Request, max_bytes: int) -> bytes:
    length = request.content_length
    if length is not None:
        if length > max_bytes:
            raise PayloadTooLarge(f"the request body has {length} bytes; the limit is {max_bytes}")
        try:
            # One read of a known length (request.read() loops, then copies the buffer).
            return await request.content.readexactly(length)
        except asyncio.IncompleteReadError:
            raise BadRequest("the request body is shorter than its Content-Length") from None
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:  # chunked body over the app's client_max_size
        raise PayloadTooLarge(f"the request body exceeds the limit of {max_bytes} bytes") from None


async def _serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state: GatewayState = request.app[STATE]
    loop = asyncio.get_running_loop()
    outcome = Outcome(started=loop.time(), request_id=request_id_of(request))
    status = 500
    try:
        try:
            raw = await _read_body(request, state.config.max_body_bytes)
            body = parse_json_object(raw)
            parsed = validate(endpoint, body)
            core = state.core
            model = core.resolve_model(parsed.model)
            outcome.model = model
            session_key = request.headers.get(state.config.session_header) or parsed.user
            ctx = core.prepare(endpoint, body, model, session_key=session_key)
            resp = await state.require_proxy().forward(request, raw, ctx, outcome)
        except RouterError as exc:
            resp = error_response(exc, outcome.request_id)
        status = 499 if outcome.client_gone else resp.status
        return resp
    except asyncio.CancelledError:
        status = 499  # the client went away (nginx's convention)
        raise
    finally:
        state.metrics.request_done(
            outcome.model, outcome.replica, status, loop.time() - outcome.started
        )


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "embeddings")


async def tokenize(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "tokenize")


async def detokenize(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "detokenize")


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


def add_openai_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", list_models)
