"""router.fleet.stats.parse_vllm_metrics against prometheus_client's own text parser."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.fleet.stats import ScrapedStats, parse_vllm_metrics

LABEL_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12
)  # quotes, backslashes and newlines included: the exposition escapes them


def _reference(text: str) -> ScrapedStats:
    """The same reading done with prometheus_client's general parser (the slow, sure way)."""
    sums: dict[str, float] = {}
    kv = 0.0
    blocks: int | None = None
    size: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isnan(sample.value) or sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            if name == "vllm:kv_cache_usage_perc":
                kv = max(kv, sample.value)
            elif name == "vllm:cache_config_info":
                blocks = (blocks or 0) + int(sample.labels["num_gpu_blocks"])
                size = int(sample.labels["block_size"])
            else:
                sums[name] = sums.get(name, 0.0) + sample.value
    return ScrapedStats(
        running=int(sums.get("vllm:num_requests_running", 0.0)),
        waiting=int(sums.get("vllm:num_requests_waiting", 0.0)),
        kv_usage=kv,
        num_gpu_blocks=blocks,
        block_size=size,
        prefix_hit_tokens=sums.get("vllm:prefix_cache_hits", 0.0),
        prefix_query_tokens=sums.get("vllm:prefix_cache_queries", 0.0),
    )


@settings(max_examples=60, deadline=None)
@given(
    engines=st.lists(
        st.tuples(
            LABEL_TEXT,  # model_name
            st.integers(0, 500),  # running
            st.integers(0, 500),  # waiting
            st.floats(0, 1),  # KV usage
            st.integers(0, 10**9),  # prefix hits
            st.integers(1, 100),  # block size
            st.integers(1, 10**6),  # GPU blocks
        ),
        min_size=1,
        max_size=3,
        unique_by=lambda e: e[0],
    )
)
def test_agrees_with_prometheus_client_parser(
    engines: list[tuple[str, int, int, float, int, int, int]],
) -> None:
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    running = Gauge("vllm:num_requests_running", "r", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "w", labels, registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "k", labels, registry=registry)
    hits = Counter("vllm:prefix_cache_hits", "h", labels, registry=registry)
    queries = Counter("vllm:prefix_cache_queries", "q", labels, registry=registry)
    info = Gauge("vllm:cache_config_info", "c", ["block_size", "num_gpu_blocks", "engine"],
                 registry=registry)  # fmt: skip
    noise = Histogram("vllm:e2e_request_latency_seconds", "e", labels, registry=registry)
    for i, (model, run, wait, kv, hit, block, gpu_blocks) in enumerate(engines):
        key = (str(i), model)
        running.labels(*key).set(run)
        waiting.labels(*key).set(wait)
        usage.labels(*key).set(kv)
        hits.labels(*key).inc(hit)
        queries.labels(*key).inc(hit * 2)
        info.labels(str(block), str(gpu_blocks), str(i)).set(1)
        noise.labels(*key).observe(kv)
    text = generate_latest(registry).decode()
    assert parse_vllm_metrics(text) == _reference(text)


def test_unreadable_sample_line_of_a_wanted_family_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics('vllm:num_requests_running{model_name="m"} many\n')
    # Lines of families the router ignores are not even read.
    assert parse_vllm_metrics("some_other_metric{ broken\n") == ScrapedStats()
