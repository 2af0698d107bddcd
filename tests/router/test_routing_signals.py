"""What the routing core learns from each request: its true prompt length (token-id prompts) and
when its prefill is over (the first token, not a chat stream's role announcement)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.proxy.sse import announces_role_only
from tests.router.conftest import StartGateway, StartSim, fast_config, wait_until
from tests.router.test_gateway import assert_openai_error

# vLLM's role chunk, as serving_chat.py serialises it (model_dump_json(exclude_unset=True)).
ROLE = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
TOKEN = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}\n\n'
)
COMPLETION_TOKEN = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":"Hi","logprobs":null,"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (ROLE, True),
        (ROLE + ROLE.replace(b'"index":0', b'"index":1'), True),  # n = 2: one per choice
        (ROLE + TOKEN, False),  # the token came with it
        (TOKEN, False),
        (COMPLETION_TOKEN, False),
        (ROLE[:-1], False),  # cut mid-event
        (DONE, False),
        (b"data: {not json}\n\n", False),
        (b'data: {"choices": []}\n\n', False),
        (ROLE.replace(b'"content":""', b'"content":"x"'), False),
        (ROLE.replace(b'"finish_reason":null', b'"finish_reason":"length"'), False),
        (b'{"choices": [{"message": {"role": "assistant"}}]}', False),  # not SSE
        (b"", False),
    ],
)
def test_role_announcements_are_told_from_tokens(chunk: bytes, expected: bool) -> None:
    assert announces_role_only(chunk) is expected


PROMPT = "Summarise the following report. " * 16  # 512 characters ≈ 128 tokens


async def _scripted_replica(release: asyncio.Event) -> AsyncIterator[str]:
    """A replica that announces the chat role at once (before prefill, as some servers do) and
    sends the first token only when `release` is set; completions send the token first."""

    async def stream(request: web.Request, first: bytes | None, token: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if first is not None:
            await resp.write(first)
        await release.wait()
        await resp.write(token)
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def chat(request: web.Request) -> web.StreamResponse:
        return await stream(request, ROLE, TOKEN)

    async def completions(request: web.Request) -> web.StreamResponse:
        # The first token at once, then the rest when released.
        return await stream(request, COMPLETION_TOKEN, COMPLETION_TOKEN)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_prefill_ends_at_the_first_token_not_the_role_chunk(
    endpoint: str, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()
    scripted = _scripted_replica(release)
    url = await anext(scripted)
    try:
        gw = await start_gateway(fast_config([url]))  # kv_aware, the default
        core = gw.state.core
        if endpoint == "chat":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}
        else:
            path, body = "/v1/completions", {"prompt": PROMPT}
        async with http.post(gw.url + path, json={**body, "stream": True}) as resp:
            assert resp.status == 200
            first = await resp.content.readany()
            if endpoint == "chat":
                # The client has the role chunk, but no token yet: prefill is still pending.
                assert first == ROLE
                assert core.pending_prefill_tokens.get(url, 0) > 100
            else:
                assert first == COMPLETION_TOKEN
                assert core.pending_prefill_tokens.get(url, 0) == 0
            release.set()
            rest = await resp.read()
        assert (first + rest).endswith(DONE)
        await wait_until(lambda: core.pending_prefill_tokens.get(url, 0) == 0)
        if endpoint == "chat":
            assert first + rest == ROLE + TOKEN + DONE  # bytes untouched
    finally:
        await scripted.aclose()


async def test_chat_pending_prefill_clears_at_the_token_on_the_sim(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """Against the sim (whatever it does with the role chunk), a finished chat stream leaves no
    pending prefill behind and the router saw the whole prompt."""
    sim = await start_sim(model="m")
    gw = await start_gateway(fast_config([sim.url]))
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "max_tokens": 4, "ignore_eos": True}  # fmt: skip
    async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
    assert resp.status == 200 and raw.endswith(DONE)
    assert gw.state.core.pending_prefill_tokens.get(sim.url, 0) == 0


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def test_token_id_prompts_count_their_true_length(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(model="m")
    gw = await start_gateway(fast_config([sim.url]))  # character mode: 64 chars ≈ 16 tokens
    tokens = list(range(1000, 1640))  # 640 token ids = 40 blocks of 16 tokens
    for _ in range(2):
        body = {"model": "m", "prompt": tokens, "max_tokens": 1}
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
    assert usage["prompt_tokens"] == 640  # the replica agrees on the length
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    # Both requests count 640 prompt tokens (not 160); the second was predicted fully cached.
    assert _metric(text, "fleet_router_predicted_prompt_tokens_total") == 1280
    assert _metric(text, "fleet_router_predicted_hit_tokens_total") == 640
    index = gw.state.core.prefix_index
    assert index is not None and index.holds(sim.url) == 40


async def test_token_ids_out_of_range_are_a_400(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(model="m")
    gw = await start_gateway(fast_config([sim.url]))
    # 2^63 parses as an integer but does not fit the signed 64-bit ids the key is hashed from.
    body = {"model": "m", "max_tokens": 1, "prompt": [2**63] * 20}
    async with http.post(gw.url + "/v1/completions", data=orjson.dumps(body),
                         headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
        assert resp.status == 400
        error = assert_openai_error(await resp.json())
        assert error["param"] == "prompt"
