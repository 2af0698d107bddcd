"""/metrics: vLLM's names, labels, buckets and exposition; counters move; gauges are live."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from replicas.sim import SimSettings, create_app
from replicas.sim.metrics import ITL_BUCKETS_S, TTFT_BUCKETS_S, build_1_2_5_buckets
from tests.replicas.conftest import StartReplica

MODEL = "metrics-model"
LABELS = {"model_name": MODEL, "engine": "0"}


async def _scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return await r.text()


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _value(samples: Samples, name: str, **extra: str) -> float:
    return samples[(name, frozenset({**LABELS, **extra}.items()))]


async def _complete(url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()


async def test_names_labels_and_counters(sim_replica: StartReplica) -> None:
    replica = await sim_replica(model=MODEL, num_gpu_blocks=4096)
    before = _samples(await _scrape(replica.url))
    assert _value(before, "vllm:prompt_tokens_total") == 0
    for reason in ("stop", "length", "abort"):
        assert _value(before, "vllm:request_success_total", finished_reason=reason) == 0

    prompt = list(range(2000, 2000 + 320))  # 20 full blocks
    await _complete(replica.url, prompt, 8)
    await _complete(replica.url, prompt, 8)  # all but the last block is a hit
    text = await _scrape(replica.url)
    after = _samples(text)

    # counters are exposed with _total (prometheus_client does this for vLLM too)
    for line in (
        "# TYPE vllm:prefix_cache_queries_total counter",
        "# TYPE vllm:num_requests_running gauge",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ):
        assert line in text
    assert _value(after, "vllm:prompt_tokens_total") == 640
    assert _value(after, "vllm:generation_tokens_total") == 16
    assert _value(after, "vllm:request_success_total", finished_reason="length") == 2
    assert _value(after, "vllm:prefix_cache_queries_total") == 640
    assert _value(after, "vllm:prefix_cache_hits_total") == 304  # 19 blocks x 16: one recomputed
    assert _value(after, "vllm:num_preemptions_total") == 0
    assert _value(after, "vllm:num_requests_running") == 0
    assert _value(after, "vllm:num_requests_waiting") == 0
    assert 0 <= _value(after, "vllm:kv_cache_usage_perc") <= 1
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert _value(after, f"{hist}_count") == 2, hist
    assert _value(after, "vllm:inter_token_latency_seconds_count") == 14  # 7 gaps per request
    assert _value(after, "vllm:request_generation_tokens_sum") == 16
    assert _value(after, "vllm:iteration_tokens_total_count") >= 8

    # vLLM's bucket boundaries
    ttft_les = sorted(
        float(dict(labels)["le"])
        for (name, labels) in after
        if name == "vllm:time_to_first_token_seconds_bucket"
    )
    assert ttft_les[:-1] == list(TTFT_BUCKETS_S) and ttft_les[-1] == float("inf")
    itl_les = sorted(
        float(dict(labels)["le"])
        for (name, labels) in after
        if name == "vllm:inter_token_latency_seconds_bucket"
    )
    assert itl_les[:-1] == list(ITL_BUCKETS_S)

    (info,) = [
        dict(labels) for (name, labels), v in after.items() if name == "vllm:cache_config_info"
    ]
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "4096"
    assert info["enable_prefix_caching"] == "True" and info["engine"] == "0"
    assert after[("vllm:cache_config_info", frozenset(info.items()))] == 1


async def test_gauges_are_read_at_scrape_time(sim_replica: StartReplica) -> None:
    # one sequence at a time: the second request waits while the first streams
    replica = await sim_replica(model=MODEL, time_scale=1.0, max_num_seqs=1, num_gpu_blocks=4096)
    body = {"prompt": list(range(500)), "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        responses = [await session.post(f"{replica.url}/v1/completions", json=body)]
        await responses[0].content.readuntil(b"\n\n")
        responses.append(await session.post(f"{replica.url}/v1/completions", json=body))
        samples = _samples(await _scrape(replica.url))
        assert _value(samples, "vllm:num_requests_running") == 1
        assert _value(samples, "vllm:num_requests_waiting") == 1
        assert _value(samples, "vllm:kv_cache_usage_perc") > 0
        for r in responses:
            r.close()
    async with asyncio.timeout(10):
        while replica.engine.stats().num_running:  # noqa: ASYNC110 - engine state has no event
            await asyncio.sleep(0.01)
    samples = _samples(await _scrape(replica.url))
    assert _value(samples, "vllm:num_requests_running") == 0
    assert _value(samples, "vllm:num_requests_waiting") == 0
    assert _value(samples, "vllm:request_success_total", finished_reason="abort") == 2


def test_registry_is_passed_in_and_not_global() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    create_app(SimSettings(model="a"), registry=a)
    create_app(SimSettings(model="b"), registry=b)  # would raise on a shared registry
    assert a.get_sample_value("vllm:prompt_tokens_total", {"model_name": "a", "engine": "0"}) == 0
    assert (
        a.get_sample_value("vllm:prompt_tokens_total", {"model_name": "b", "engine": "0"}) is None
    )


def test_token_buckets_follow_1_2_5() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(8192)[-1] == 5000
