"""The simulated replica over real HTTP: vLLM's wire format, limits, disconnects, info routes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from replicas.sim import SimSettings, running_replica, start_replica
from tests.conftest import free_port
from tests.replicas.conftest import StartReplica

MODEL = SimSettings().model


async def _post(url: str, body: Any, *, raw: bytes | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else json.dumps(body).encode()
        async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()


def _sse_events(body: bytes) -> list[bytes]:
    """Split a raw SSE body the strict way: every event is exactly `data: ...` + blank line."""
    assert body.endswith(b"\n\n"), body[-50:]
    events = body[:-2].split(b"\n\n")
    for event in events:
        assert event.startswith(b"data: "), event
        assert b"\n" not in event, event
    return [e[len(b"data: ") :] for e in events]


async def test_completion_stream_bytes_have_vllm_format(sim_replica: StartReplica) -> None:
    replica = await sim_replica()
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox jumps over the lazy dog",
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{replica.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    events = _sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 6  # one chunk per generated token
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("cmpl-")
    for chunk in chunks:
        assert chunk["object"] == "text_completion"
        assert chunk["model"] == MODEL
        assert isinstance(chunk["created"], int)
        (choice,) = chunk["choices"]
        assert choice["index"] == 0 and isinstance(choice["text"], str) and choice["text"]
        assert "usage" not in chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]


async def test_chat_stream_role_first_and_include_usage_last(sim_replica: StartReplica) -> None:
    replica = await sim_replica()
    body = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, raw = await _post(f"{replica.url}/v1/chat/completions", body)
    assert status == 200
    events = _sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["id"].startswith("chatcmpl-") for c in chunks)
    first, *content, usage_chunk = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(content) == 4
    assert all("role" not in c["choices"][0]["delta"] for c in content)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_non_streaming_shapes(sim_replica: StartReplica) -> None:
    replica = await sim_replica()
    status, raw = await _post(
        f"{replica.url}/v1/completions",
        {"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True},
    )
    assert status == 200
    body = json.loads(raw)
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    status, raw = await _post(
        f"{replica.url}/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "echo": True}
    )
    assert status == 200 and json.loads(raw)["choices"][0]["text"].startswith("Hello there")

    status, raw = await _post(
        f"{replica.url}/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
         "ignore_eos": True},
    )  # fmt: skip
    assert status == 200
    body = json.loads(raw)
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"]) > 0
    assert body["usage"]["completion_tokens"] == 2


async def test_repeated_2k_prefix_reports_cached_tokens(sim_replica: StartReplica) -> None:
    replica = await sim_replica()
    shared = list(range(1000, 1000 + 2048))  # 128 full blocks of 16
    first = shared + list(range(5000, 5100))
    second = shared + list(range(7000, 7037))
    for prompt, expected in ((first, 0), (second, 2048)):
        status, raw = await _post(
            f"{replica.url}/v1/completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        )
        assert status == 200, raw
        usage = json.loads(raw)["usage"]
        assert usage["prompt_tokens"] == len(prompt)
        assert usage["prompt_tokens_details"]["cached_tokens"] == expected
    # a shared prefix that is not block-aligned is reported block-aligned, as vLLM does
    third = shared[:1000] + list(range(9000, 9100))
    status, raw = await _post(
        f"{replica.url}/v1/completions", {"prompt": third, "max_tokens": 1, "ignore_eos": True}
    )
    assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 992


async def test_stop_string_cuts_output_and_reports_stop(sim_replica: StartReplica) -> None:
    replica = await sim_replica()
    base = {"prompt": "Tell me a story", "max_tokens": 40, "ignore_eos": True, "seed": 7}
    _, raw = await _post(f"{replica.url}/v1/completions", base)
    full = json.loads(raw)["choices"][0]["text"]
    assert len(full) > 60
    stop = full[41:47]  # spans a token boundary
    expected = full[: full.index(stop)]
    _status, raw = await _post(f"{replica.url}/v1/completions", {**base, "stop": [stop, "@@@"]})
    choice = json.loads(raw)["choices"][0]
    assert choice["text"] == expected
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop

    # streaming: the concatenated deltas equal the non-streamed text, stop string excluded
    _, raw = await _post(f"{replica.url}/v1/completions", {**base, "stop": stop, "stream": True})
    chunks = [json.loads(e) for e in _sse_events(raw)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # the engine request was cut short: nothing stays running
    await _wait_until(lambda: replica.engine.stats().num_running == 0)


async def test_min_tokens_and_ignore_eos(sim_replica: StartReplica) -> None:
    # Output lengths drawn from a fixed distribution of 3 tokens unless told otherwise.
    replica = await sim_replica(output_len_kind="fixed", output_len_mean=3)
    url = f"{replica.url}/v1/completions"

    async def usage_of(body: dict[str, Any]) -> tuple[int, str]:
        status, raw = await _post(url, {"prompt": "Count to ten", **body})
        assert status == 200, raw
        parsed = json.loads(raw)
        return parsed["usage"]["completion_tokens"], parsed["choices"][0]["finish_reason"]

    assert await usage_of({"max_tokens": 50}) == (3, "stop")  # the simulated EOS
    assert await usage_of({"max_tokens": 2}) == (2, "length")  # capped by max_tokens
    assert await usage_of({"max_tokens": 50, "min_tokens": 9}) == (9, "stop")
    assert await usage_of({"max_tokens": 50, "ignore_eos": True}) == (50, "length")


async def test_output_length_is_reproducible(sim_replica: StartReplica) -> None:
    replica = await sim_replica(output_len_mean=20)
    url = f"{replica.url}/v1/completions"
    answers = []
    for _ in range(2):
        _status, raw = await _post(url, {"prompt": "Same prompt", "max_tokens": 500, "seed": 3})
        answers.append(json.loads(raw)["choices"][0]["text"])
    assert answers[0] == answers[1]
    _, raw = await _post(url, {"prompt": "Same prompt", "max_tokens": 500, "seed": 4})
    assert json.loads(raw)["choices"][0]["text"] != answers[0]


async def _wait_until(cond: Any, timeout_s: float = 10.0) -> None:
    """Poll a condition on engine state (the engine has no change notification to wait on)."""
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_disconnect_mid_stream_aborts_and_frees_blocks(sim_replica: StartReplica) -> None:
    # time_scale 1: a 3000-token answer would take ~20 s, so the client leaves long before.
    replica = await sim_replica(time_scale=1.0, num_gpu_blocks=2048)
    prompt = list(range(100, 100 + 1000))
    body = {"prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    session = aiohttp.ClientSession()
    try:
        resp = await session.post(f"{replica.url}/v1/completions", json=body)
        for _ in range(3):
            assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
        stats = replica.engine.stats()
        assert stats.num_running == 1 and stats.num_used_blocks > 60
        resp.close()  # drop the connection mid-stream
    finally:
        await session.close()
    await _wait_until(lambda: replica.engine.stats().num_running == 0)
    stats = replica.engine.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_free_blocks == stats.num_gpu_blocks
    async with aiohttp.ClientSession() as s, s.get(f"{replica.url}/metrics") as r:
        text = await r.text()
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0' in text
    assert 'finished_reason="abort"' in text
    abort_line = next(
        line for line in text.splitlines()
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line
    )  # fmt: skip
    assert abort_line.endswith(" 1.0")


async def test_disconnect_non_streaming_aborts(sim_replica: StartReplica) -> None:
    replica = await sim_replica(time_scale=1.0)
    body = {"prompt": "wait for me", "max_tokens": 3000, "ignore_eos": True}
    session = aiohttp.ClientSession()
    try:
        task = asyncio.create_task(session.post(f"{replica.url}/v1/completions", json=body))
        await _wait_until(lambda: replica.engine.stats().num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await session.close()
    await _wait_until(lambda: replica.engine.stats().num_running == 0)
    assert replica.engine.stats().num_used_blocks == 0


BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": [1, -3]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, True]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2.0]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2**70]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x" * 40_000, "max_tokens": 10}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 40_000}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5},
     400, "max_tokens"),
    ("/v1/embeddings", {"input": 5}, 400, "input"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]  # fmt: skip


async def test_bad_requests_get_openai_errors(sim_replica: StartReplica) -> None:
    # 8192 tokens of context: a 10k-token prompt is too long
    replica = await sim_replica(num_gpu_blocks=512)
    for path, body, status, param in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else None
        got, payload = await _post(replica.url + path, body, raw=raw)
        assert got == status, (path, body, payload)
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert error["message"]
        assert error["param"] == param, (path, body, error)
    # nothing got stuck in the engine
    assert replica.engine.stats().num_running == 0 and replica.engine.stats().num_waiting == 0


async def test_unknown_model_is_404_and_aliases_work(sim_replica: StartReplica) -> None:
    replica = await sim_replica(model="m-main", model_aliases=("m-alias",))
    for path, body in (
        ("/v1/completions", {"model": "nope", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/embeddings", {"model": "nope", "input": "x"}),
    ):
        status, raw = await _post(replica.url + path, body)
        assert status == 404
        assert json.loads(raw)["error"] == {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    status, raw = await _post(
        f"{replica.url}/v1/completions", {"model": "m-alias", "prompt": "x", "max_tokens": 1}
    )
    assert status == 200 and json.loads(raw)["model"] == "m-alias"
    async with aiohttp.ClientSession() as s, s.get(f"{replica.url}/nowhere") as r:
        assert r.status == 404
        assert json.loads(await r.read())["error"]["code"] == 404


async def test_info_routes(sim_replica: StartReplica) -> None:
    replica = await sim_replica(num_gpu_blocks=1000, block_size=16)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{replica.url}/health") as r:
            assert r.status == 200 and await r.read() == b""
        async with s.get(f"{replica.url}/ping") as r:
            assert r.status == 200
        async with s.get(f"{replica.url}/version") as r:
            assert isinstance((await r.json())["version"], str)
        async with s.get(f"{replica.url}/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list"
        (card,) = models["data"]
        assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "vllm"
        assert card["max_model_len"] == 16_000  # capped by the KV cache: 1000 blocks x 16
        for path in ("/get_model_info", "/model_info"):
            async with s.get(replica.url + path) as r:
                info = await r.json()
            assert info["model_path"] == MODEL and info["is_generation"] is True
        for path in ("/get_server_info", "/server_info"):
            async with s.get(replica.url + path) as r:
                info = await r.json()
            assert info["max_total_num_tokens"] == 16_000 and info["page_size"] == 16
            assert info["dp_size"] == 1 and info["context_length"] == 16_000
        async with s.post(f"{replica.url}/tokenize", json={"prompt": "abcdefgh"}) as r:
            tok = await r.json()
        assert tok["count"] == 2 and len(tok["tokens"]) == 2 and tok["max_model_len"] == 16_000
        async with s.post(
            f"{replica.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
        ) as r:
            chat_tok = await r.json()
        assert chat_tok["count"] > 10  # the chat template adds its header tokens
        generated = [1, 2, 3]  # output-table ids decode exactly
        async with s.post(f"{replica.url}/detokenize", json={"tokens": generated}) as r:
            text = (await r.json())["prompt"]
        async with s.post(f"{replica.url}/tokenize", json={"prompt": text}) as r:
            assert (await r.json())["tokens"] == generated
        async with s.post(f"{replica.url}/v1/embeddings", json={"input": ["a b", "c d"]}) as r:
            emb = await r.json()
        assert emb["object"] == "list" and [d["index"] for d in emb["data"]] == [0, 1]
        assert len(emb["data"][0]["embedding"]) == 1024
        assert emb["data"][0]["embedding"] != emb["data"][1]["embedding"]
        assert emb["usage"]["prompt_tokens"] == 2


async def test_two_replicas_in_one_process_and_restart_on_same_port() -> None:
    port = free_port()
    settings = SimSettings(port=port, time_scale=0.02, model="a")
    async with (
        running_replica(settings) as a,
        running_replica(SimSettings(port=0, time_scale=0.02, model="b")) as b,
    ):
        assert a.url == f"http://127.0.0.1:{port}" and a.port == port and b.port != port
        for replica, model in ((a, "a"), (b, "b")):
            status, raw = await _post(
                f"{replica.url}/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2}
            )
            assert status == 200, raw
        assert a.engine is not b.engine and a.registry is not b.registry
    again = await start_replica(settings)  # the port is free again at once
    try:
        status, _ = await _post(f"{again.url}/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 200
    finally:
        await again.stop()
        await again.stop()  # idempotent


async def test_static_batching_and_prefix_caching_off(sim_replica: StartReplica) -> None:
    replica = await sim_replica(scheduling="static", enable_prefix_caching=False, max_num_seqs=4)
    prompt = list(range(3000, 3000 + 256))
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True}
    results = await asyncio.gather(
        *(_post(f"{replica.url}/v1/completions", body) for _ in range(6))
    )
    for status, raw in results:
        assert status == 200, raw
        usage = json.loads(raw)["usage"]
        assert usage["completion_tokens"] == 5
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # caching is off
    stats = replica.engine.stats()
    assert stats.prefix_cache_hits == 0 and stats.num_running == 0


def _gauge(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("scheduling", ["static", "continuous"])
async def test_static_batching_reserves_kv_for_max_tokens_over_http(
    sim_replica: StartReplica, scheduling: str
) -> None:
    # 40 blocks of 16. Each request: 100 prompt tokens, max_tokens 200, an EOS drawn at 150.
    # Static batching reserves ceil((100 + 200 - 1) / 16) = 19 blocks per request up front
    # (the server passes max_tokens, not the drawn length: that would be 16), so 2 of the 4
    # run and hold 38 blocks; continuous batching admits up to max_num_seqs with the blocks they
    # use.
    replica = await sim_replica(
        scheduling=scheduling,
        num_gpu_blocks=40,
        max_num_seqs=4,
        max_model_len=640,
        output_len_kind="fixed",
        output_len_mean=150,
        time_scale=0.2,
    )
    prompts = [list(range(1000 * i, 1000 * i + 100)) for i in range(1, 6)]
    async with aiohttp.ClientSession() as session:
        responses = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 200, "stream": True}
            responses.append(await session.post(f"{replica.url}/v1/completions", json=body))
            if len(responses) == 1:  # the gate: the other four queue behind its batch
                await responses[0].content.readuntil(b"\n\n")
        gate, ours = responses[0], responses[1:]
        if scheduling == "static":
            await gate.read()  # its batch ends; the next one forms from the queue
        first_event = await ours[0].content.readuntil(b"\n\n")
        async with session.get(f"{replica.url}/metrics") as r:
            text = await r.text()
        stats = replica.engine.stats()
        bodies = [await r.read() for r in ours]
        bodies[0] = first_event + bodies[0]
        gate.release()
    if scheduling == "static":
        assert _gauge(text, "vllm:num_requests_running") == 2
        assert _gauge(text, "vllm:num_requests_waiting") == 2
        assert _gauge(text, "vllm:kv_cache_usage_perc") == pytest.approx(38 / 40)
        assert stats.num_used_blocks == 38
    else:  # the gate and three of ours, each with the blocks it has filled
        assert _gauge(text, "vllm:num_requests_running") == 4
        assert _gauge(text, "vllm:kv_cache_usage_perc") < 38 / 40
    for raw in bodies:  # everyone ends at the drawn EOS, well short of max_tokens
        chunks = [json.loads(e) for e in _sse_events(raw)[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert len(chunks) == 150
    # Reservation is what static batching buys: it never runs out of blocks mid-batch, while
    # continuous batching here admits four sequences that outgrow 40 blocks (each reaches 16).
    preemptions = replica.engine.stats().num_preemptions
    assert preemptions == 0 if scheduling == "static" else preemptions > 0


async def test_chat_role_chunk_waits_for_prefill(sim_replica: StartReplica) -> None:
    # vLLM sends the role chunk with the first engine output, so a router may read the first
    # body byte as "prefill done". Headers go out at once; the body must wait for the prefill.
    # Checked by event, not by wall clock: when the first body byte arrives, the replica has
    # already delivered the first token (its TTFT histogram counted it); a role chunk sent
    # early would arrive while the modelled prefill (~0.1 s here) is still running.
    replica = await sim_replica(time_scale=0.5)
    prompt_tokens = 6000
    body = {
        "messages": [{"role": "user", "content": "lorem ips " * (prompt_tokens * 4 // 10)}],
        "max_tokens": 2,
        "ignore_eos": True,
        "stream": True,
    }
    labels = {"model_name": replica.settings.model, "engine": "0"}

    def first_tokens() -> float | None:
        return replica.registry.get_sample_value("vllm:time_to_first_token_seconds_count", labels)

    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{replica.url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        first = await resp.content.readany()
        tokens_at_first_byte = first_tokens()
        rest = await resp.read()
    assert b'"role":"assistant"' in first.replace(b" ", b"")
    assert tokens_at_first_byte == 1
    assert rest.endswith(b"data: [DONE]\n\n")
