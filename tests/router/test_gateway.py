"""The gateway against real sim replicas: routing, endpoints, headers, errors, admin, metrics."""

from __future__ import annotations

from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from router.fleet.stats import parse_vllm_metrics
from tests.router.conftest import StartGateway, StartSim, fast_config

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def assert_openai_error(payload: Any) -> dict[str, Any]:
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


async def test_routes_completions_and_chat_and_names_the_replica(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sims = [await start_sim(seed=i) for i in range(3)]
    gw = await start_gateway(fast_config([s.url for s in sims], policy="round_robin"))
    served: Counter[str] = Counter()
    for i in range(6):
        async with http.post(
            gw.url + "/v1/completions",
            json={"prompt": f"hello {i}", "max_tokens": 3},
            headers={"X-Request-Id": f"rid-{i}"},
        ) as resp:
            assert resp.status == 200
            body = await resp.json()
            assert body["object"] == "text_completion"
            assert resp.headers["x-request-id"] == f"rid-{i}"
            served[resp.headers["x-fleet-replica"]] += 1
    assert served == {s.url: 2 for s in sims}  # round robin over the three

    async with http.post(
        gw.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["object"] == "chat.completion"
        assert len(resp.headers["x-request-id"]) == 32  # created when the client sent none
        assert resp.headers["x-fleet-replica"] in {s.url for s in sims}


async def test_request_body_and_headers_cross_unchanged(
    start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    """A capturing upstream sees the client's exact bytes and end-to-end headers, minus
    hop-by-hop ones, plus the request id; the client sees the upstream's bytes and headers."""
    seen: list[tuple[bytes, CIMultiDict[str]]] = []

    async def capture(request: web.Request) -> web.Response:
        seen.append((await request.read(), CIMultiDict(request.headers)))
        return web.Response(
            body=b'{"odd":  "answer"}',
            content_type="application/json",
            headers={"X-Upstream": "yes", "Keep-Alive": "timeout=5"},
        )

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "cap", "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    upstream = web.Application()
    upstream.router.add_post("/v1/completions", capture)
    upstream.router.add_get("/v1/models", models)
    upstream.router.add_get("/health", health)
    runner = web.AppRunner(upstream)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        gw = await start_gateway(fast_config([url]))
        raw = b'{ "prompt" :"caf\\u00e9  \\n x",   "max_tokens":1,"echo":true , "temperature": 0}'
        async with http.post(
            gw.url + "/v1/completions",
            data=raw,
            headers={"Content-Type": "application/json", "Authorization": "Bearer sk-x",
                     "X-Request-Id": "abc", "Connection": "keep-alive, X-Hop", "X-Hop": "1"},
        ) as resp:  # fmt: skip
            assert resp.status == 200
            assert await resp.read() == b'{"odd":  "answer"}'
            assert resp.headers["X-Upstream"] == "yes"
            assert "Keep-Alive" not in resp.headers
            assert resp.headers["x-fleet-replica"] == url
            assert resp.headers["x-request-id"] == "abc"
    finally:
        await runner.cleanup()
    body, headers = seen[0]
    assert body == raw
    assert headers["Authorization"] == "Bearer sk-x"
    assert headers["x-request-id"] == "abc"
    assert "X-Hop" not in headers


async def test_tokenize_detokenize_and_embeddings_are_forwarded(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url]))
    for path, body in (
        ("/tokenize", {"prompt": "hello world"}),
        ("/detokenize", {"tokens": [1, 2, 3]}),
        ("/v1/embeddings", {"input": "hello"}),
    ):
        async with http.post(gw.url + path, json=body) as resp:
            assert resp.status == 200
            via_router = await resp.json()
            assert resp.headers["x-fleet-replica"] == sim.url
        async with http.post(sim.url + path, json=body) as resp:
            direct = await resp.json()
        for answer in (via_router, direct):
            answer.pop("created", None), answer.pop("id", None)
        assert via_router == direct


async def test_models_health_ready_and_metrics(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sims = [await start_sim(model="m-a"), await start_sim(model="m-b")]
    gw = await start_gateway(fast_config([s.url for s in sims], models=("m-a", "m-b")))
    async with http.get(gw.url + "/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    assert sorted(card["id"] for card in models["data"]) == ["m-a", "m-b"]
    async with http.get(gw.url + "/health") as resp:
        assert resp.status == 200
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 200
        assert (await resp.json())["models"] == {"m-a": 1, "m-b": 1}

    async with http.post(gw.url + "/v1/completions", json={"model": "m-a", "prompt": "x",
                                                            "max_tokens": 2}) as resp:  # fmt: skip
        assert resp.status == 200
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    for name in (
        f'fleet_router_requests_total{{model="m-a",replica="{sims[0].url}",status="200"}} 1.0',
        f'fleet_router_replica_up{{replica="{sims[1].url}"}} 1.0',
        f'fleet_router_circuit_state{{replica="{sims[0].url}"}} 0.0',
        f'fleet_router_replica_in_flight{{replica="{sims[0].url}"}} 0.0',
        # the default policy, kv_aware: a prompt shorter than one block matches nothing
        'fleet_router_decisions_total{policy="kv_aware",reason="no_match"} 1.0',
        'fleet_router_request_duration_seconds_count{model="m-a"} 1.0',
        'fleet_router_ttft_seconds_count{model="m-a"} 1.0',
        'fleet_router_decision_seconds_count{policy="kv_aware"} 1.0',
    ):
        assert name in text, name
    for name in ("replica_running", "replica_waiting", "replica_kv_usage",
                 "replica_observed_hit_tokens", "replica_observed_query_tokens"):  # fmt: skip
        assert f"fleet_router_{name}{{replica=" in text

    # Scraped capacity and counters agree with the replica's own /metrics.
    async with http.get(sims[0].url + "/metrics") as resp:
        direct = parse_vllm_metrics(await resp.text())
    replica = gw.fleet.get(sims[0].url)
    assert replica is not None and direct.num_gpu_blocks
    assert replica.stats.num_gpu_blocks == direct.num_gpu_blocks
    assert replica.stats.block_size == direct.block_size
    # ... and reach the routing core as capacity in prefix-index blocks.
    expected = gw.state.core.units.capacity_blocks(direct.num_gpu_blocks, direct.block_size or 16)
    assert gw.state.core.capacity_blocks[sims[0].url] == expected


async def test_ready_is_503_until_every_configured_model_has_a_replica(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(model="m-a")
    gw = await start_gateway(fast_config([sim.url], models=("m-a", "m-b")))
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 503
        assert (await resp.json())["missing"] == ["m-b"]
    nothing = await start_gateway(fast_config(["http://127.0.0.1:9"]))  # nothing listens there
    async with http.get(nothing.url + "/ready") as resp:
        assert resp.status == 503
    async with http.post(nothing.url + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert_openai_error(await resp.json())


async def test_multi_model_routing(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    a1, a2, b = (await start_sim(model="m-a"), await start_sim(model="m-a"),
                 await start_sim(model="m-b", model_aliases=("m-b-alias",)))  # fmt: skip
    # round_robin: the test is about which replicas may serve a model, so spread the requests
    gw = await start_gateway(fast_config([a1.url, a2.url, b.url], policy="round_robin"))
    seen: dict[str, set[str]] = {"m-a": set(), "m-b": set(), "m-b-alias": set()}
    for i in range(8):
        for model in seen:
            async with http.post(
                gw.url + "/v1/completions",
                json={"model": model, "prompt": f"p{i}", "max_tokens": 1},
            ) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["model"] == model
                seen[model].add(r.headers["x-fleet-replica"])
    assert seen["m-a"] == {a1.url, a2.url}
    assert seen["m-b"] == seen["m-b-alias"] == {b.url}

    async with http.post(gw.url + "/v1/completions", json={"model": "m-z", "prompt": "x"}) as r:
        assert r.status == 404
        error = assert_openai_error(await r.json())
        assert error["code"] == "model_not_found" and error["param"] == "model"
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 400  # several models served: the client must say which
        assert "m-a" in assert_openai_error(await r.json())["message"]


async def test_missing_model_with_a_single_model_served(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(model="only")
    gw = await start_gateway(fast_config([sim.url]))
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200
        assert (await r.json())["model"] == "only"
    async with http.get(gw.url + "/metrics") as resp:
        assert 'fleet_router_requests_total{model="only"' in await resp.text()


BAD_INPUTS: list[tuple[str, str, bytes | None, dict[str, str], int]] = [
    ("POST", "/v1/completions", b"{not json", {}, 400),
    ("POST", "/v1/completions", b"", {}, 400),
    ("POST", "/v1/completions", b"[1, 2]", {}, 400),
    ("POST", "/v1/completions", b'{"max_tokens": 5}', {}, 400),
    ("POST", "/v1/completions", b'{"prompt": {"a": 1}}', {}, 400),
    ("POST", "/v1/completions", b'{"prompt": "x", "stream": "true"}', {}, 400),
    ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": "9"}', {}, 400),
    ("POST", "/v1/completions", b'{"prompt": "x", "model": 42}', {}, 400),
    ("POST", "/v1/chat/completions", b'{"model": "only"}', {}, 400),
    ("POST", "/v1/chat/completions", b'{"messages": []}', {}, 400),
    ("POST", "/v1/chat/completions", b'{"messages": [{"content": "x"}]}', {}, 400),
    ("POST", "/v1/chat/completions", b'{"messages": "hello"}', {}, 400),
    ("POST", "/v1/embeddings", b'{"model": "only"}', {}, 400),
    ("POST", "/detokenize", b'{"tokens": "abc"}', {}, 400),
    ("POST", "/v1/completions", b'{"prompt": "' + b"x" * 5000 + b'"}', {}, 413),
    ("POST", "/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', {}, 404),
    ("GET", "/v1/completions", None, {}, 405),
    ("POST", "/v1/nothing", b"{}", {}, 404),
    ("GET", "/admin/replicas", None, {}, 404),  # admin API disabled without a token
]


async def test_bad_inputs_get_the_right_4xx_with_openai_bodies(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(model="only")
    gw = await start_gateway(fast_config([sim.url], max_body_bytes=4096))
    for method, path, body, headers, status in BAD_INPUTS:
        async with http.request(method, gw.url + path, data=body, headers=headers) as resp:
            assert resp.status == status, (path, body, await resp.text())
            assert resp.content_type == "application/json"
            assert_openai_error(orjson.loads(await resp.read()))

    # A chunked body (no Content-Length) over the limit is refused too.
    async def chunks() -> Any:
        for _ in range(10):
            yield b"x" * 1000

    async with http.post(gw.url + "/v1/completions", data=chunks()) as resp:
        assert resp.status == 413
        assert_openai_error(await resp.json())
    # The router is still fine afterwards.
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200


async def test_two_gateways_in_one_process_share_nothing(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim_a, sim_b = await start_sim(model="m-a"), await start_sim(model="m-b")
    gw_a = await start_gateway(fast_config([sim_a.url], policy="round_robin"))
    gw_b = await start_gateway(fast_config([sim_b.url], policy="random"))
    for _ in range(3):
        async with http.post(gw_a.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}):
            pass
    async with http.post(gw_b.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
        assert (await r.json())["model"] == "m-b"
    assert gw_a.fleet is not gw_b.fleet
    assert [r.replica_id for r in gw_a.fleet] == [sim_a.url]
    async with http.get(gw_a.url + "/metrics") as resp:
        text_a = await resp.text()
    async with http.get(gw_b.url + "/metrics") as resp:
        text_b = await resp.text()
    assert 'policy="round_robin"' in text_a and 'policy="random"' not in text_a
    assert f'model="m-a",replica="{sim_a.url}",status="200"}} 3.0' in text_a
    assert f'model="m-b",replica="{sim_b.url}",status="200"}} 1.0' in text_b
    assert "m-a" not in text_b


async def test_admin_api_needs_the_bearer_token(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sim1, sim2 = await start_sim(), await start_sim()
    # round_robin: the added replica must take its turn (kv_aware may keep short prompts on one)
    gw = await start_gateway(fast_config([sim1.url], admin_token="s3cret", policy="round_robin"))
    auth = {"Authorization": "Bearer s3cret"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        async with http.get(gw.url + "/admin/replicas", headers=headers) as resp:
            assert resp.status == 401
            assert_openai_error(await resp.json())
    async with http.post(gw.url + "/admin/replicas", json={"url": sim2.url, "name": "two"},
                         headers=auth) as resp:  # fmt: skip
        assert resp.status == 201, await resp.text()
        added = (await resp.json())["replica"]
        assert (added["id"], added["url"], added["up"]) == ("two", sim2.url, True)
    async with http.post(gw.url + "/admin/replicas", json={"url": sim2.url}, headers=auth) as r:
        assert r.status == 409
    async with http.post(gw.url + "/admin/replicas", json={"url": "ftp://x"}, headers=auth) as r:
        assert r.status == 400
    async with http.get(gw.url + "/admin/replicas", headers=auth) as resp:
        listed = {r["id"]: r for r in (await resp.json())["replicas"]}
    assert set(listed) == {sim1.url, "two"}
    # The added replica takes traffic.
    served = set()
    for i in range(6):
        async with http.post(gw.url + "/v1/completions",
                             json={"prompt": f"{i}", "max_tokens": 1}) as r:  # fmt: skip
            served.add(r.headers["x-fleet-replica"])
    assert served == {sim1.url, "two"}
    async with http.delete(gw.url + "/admin/replicas/two", headers=auth) as resp:
        assert resp.status == 200
    async with http.delete(gw.url + "/admin/replicas", params={"id": sim1.url},
                           headers=auth) as resp:  # fmt: skip
        assert resp.status == 200
    async with http.delete(gw.url + "/admin/replicas/two", headers=auth) as resp:
        assert resp.status == 404
    assert len(gw.fleet) == 0
    async with http.get(gw.url + "/metrics") as resp:
        assert f'replica_up{{replica="{sim1.url}"}}' not in await resp.text()


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_load", "power_of_two",
                                    "session"])  # fmt: skip
async def test_every_policy_serves_through_the_gateway(
    policy: str, start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sims = [await start_sim(seed=i) for i in range(2)]
    gw = await start_gateway(fast_config([s.url for s in sims], policy=policy))
    served = []
    for i in range(6):
        async with http.post(
            gw.url + "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 1, "user": "alice"}
        ) as r:
            assert r.status == 200
            served.append(r.headers["x-fleet-replica"])
    if policy == "session":
        assert len(set(served)) == 1  # one user, one replica
    if policy == "round_robin":
        assert len(set(served)) == 2
    assert all(r.in_flight == 0 for r in gw.fleet)


async def test_session_header_pins_a_session_and_falls_back_when_its_replica_is_down(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    sims = [await start_sim(seed=i) for i in range(3)]
    # No periodic health checks: the test marks a replica down itself.
    config = fast_config([s.url for s in sims], policy="session", health_interval_s=60)
    gw = await start_gateway(config)

    async def served(session: str) -> str:
        async with http.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                             headers={"X-Session-Id": session}) as r:  # fmt: skip
            assert r.status == 200
            return r.headers["x-fleet-replica"]

    owners = {f"s{i}": await served(f"s{i}") for i in range(20)}
    assert len(set(owners.values())) >= 2  # sessions spread over the fleet
    assert [await served("s3") for _ in range(5)] == [owners["s3"]] * 5
    down = gw.fleet.get(owners["s3"])
    assert down is not None
    down.healthy = False  # as a failed health check would leave it
    moved = await served("s3")
    assert moved != owners["s3"]
    others = [k for k, v in owners.items() if v != owners["s3"]]
    assert [await served(k) for k in others] == [owners[k] for k in others]  # others stay put
    down.healthy = True
    assert await served("s3") == owners["s3"]  # and it comes back to its replica


async def test_access_log_names_every_request_with_its_status(
    start_sim: StartSim,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--access-log`: one line per request, proxied or relayed to the control app."""
    sim = await start_sim()
    gw = await start_gateway(fast_config([sim.url], access_log=True))
    caplog.set_level("INFO", logger="router.access")
    async with http.post(gw.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r:
        assert r.status == 200
    async with http.get(gw.url + "/nowhere") as r:
        assert r.status == 404
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "router.access"]
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in lines), lines
    assert any('"GET /nowhere HTTP/1.1" 404' in line for line in lines), lines
