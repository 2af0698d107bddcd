"""Pure helpers of the edge: /metrics parsing, header filtering, body validation."""

from __future__ import annotations

import os

import pytest

from router.errors import BadRequest
from router.fleet.stats import parse_vllm_metrics
from router.http.validation import parse_json_object, validate
from router.proxy.headers import (
    downstream_headers,
    new_request_id,
    read_client_headers,
    upstream_headers,
)

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="27000"} 1.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 2.5
"""


def test_parse_vllm_metrics() -> None:
    stats = parse_vllm_metrics(VLLM_METRICS)
    assert (stats.running, stats.waiting, stats.kv_usage) == (3, 7, 0.25)
    assert (stats.num_gpu_blocks, stats.block_size) == (27000, 16)
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (1000.0, 600.0)


def test_parse_vllm_metrics_retired_names_and_empty() -> None:
    old = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
        "# TYPE vllm:gpu_prefix_cache_hits counter\n"
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 5\n'
    )
    stats = parse_vllm_metrics(old)
    assert stats.kv_usage == 0.5 and stats.prefix_hit_tokens == 5
    empty = parse_vllm_metrics("")
    assert empty.running == 0 and empty.num_gpu_blocks is None


def _lines(block: bytes) -> list[tuple[str, str]]:
    """`Name: value` header lines back into pairs."""
    pairs = []
    for line in block.decode().split("\r\n"):
        if line:
            name, _, value = line.partition(": ")
            pairs.append((name, value))
    return pairs


def test_hop_by_hop_headers_are_dropped_both_ways() -> None:
    incoming = [
        (b"Host", b"router:8080"),
        (b"Connection", b"keep-alive, X-Secret-Hop"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Secret-Hop", b"drop me"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Length", b"12"),
        (b"Authorization", b"Bearer sk-1"),
        (b"X-Session-Id", b"s1"),
        (b"X-Forwarded-For", b"10.0.0.1"),
        (b"X-Request-Id", b"client-chose-this"),
    ]
    client = read_client_headers(incoming, b"x-session-id")
    assert (client.request_id, client.session) == ("client-chose-this", "s1")
    out = _lines(upstream_headers(client, "req-1", "10.0.0.2"))
    assert out == [
        ("Authorization", "Bearer sk-1"),
        ("X-Session-Id", "s1"),
        ("X-Request-Id", "req-1"),
        ("X-Forwarded-For", "10.0.0.1, 10.0.0.2"),
    ]
    # Without a peer address the chain is passed on as it came.
    assert ("X-Forwarded-For", "10.0.0.1") in _lines(upstream_headers(client, "req-1", None))
    # No Connection header naming others: one pass, the same kept lines.
    plain = read_client_headers([(b"Accept", b"*/*"), (b"TE", b"trailers")], b"x-session-id")
    assert (plain.lines, plain.request_id, plain.session) == (b"Accept: */*\r\n", None, None)

    upstream = [
        (b"Content-Type", b"text/event-stream"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Date", b"x"),
        (b"Server", b"uvicorn"),
        (b"X-Request-Id", b"theirs"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"X-Hop", b"dropped"),
        (b"X-Custom", b"kept"),
        (b"x-custom", b"repeats kept"),
    ]
    assert _lines(downstream_headers(upstream, "gpu-1", "req-1")) == [
        ("Content-Type", "text/event-stream"),
        ("X-Custom", "kept"),
        ("x-custom", "repeats kept"),
        ("x-fleet-replica", "gpu-1"),
        ("x-request-id", "req-1"),
    ]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("completions", {}, "prompt"),
        ("completions", {"prompt": 5}, "prompt"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": "x", "model": 3}, "model"),
        ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("completions", {"prompt": "x", "user": 1}, "user"),
        ("chat", {}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": ["hi"]}, "messages[0]"),
        ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("embeddings", {}, "input"),
        ("tokenize", {}, "prompt"),
        ("detokenize", {"tokens": ["a"]}, "tokens"),
    ],
)
def test_validation_rejects_with_param(endpoint: str, body: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        validate(endpoint, body)
    assert info.value.param == param
    assert info.value.status == 400


def test_validation_accepts_valid_shapes() -> None:
    assert validate("completions", {"prompt": [[1, 2], [3]]}).stream is False
    parsed = validate("chat", {"model": "m", "stream": True, "user": "u",
                               "messages": [{"role": "assistant", "content": None}]})  # fmt: skip
    assert (parsed.model, parsed.stream, parsed.user) == ("m", True, "u")
    validate("tokenize", {"messages": [{"role": "user", "content": "x"}]})
    validate("detokenize", {"tokens": [1, 2]})
    validate("embeddings", {"input": ["a", "b"]})


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b'"s"', b"null", b"\xff"])
def test_parse_json_object_rejects(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_json_object(raw)


def test_request_ids_are_unique_in_a_process_and_across_forks() -> None:
    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a worker forked after ids were handed out
        os.write(write_end, new_request_id().encode())
        os._exit(0)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    # The child drew its own prefix: its ids cannot collide with the parent's counter.
    assert len(child_id) == 32 and child_id[:16] != ids[0][:16]
