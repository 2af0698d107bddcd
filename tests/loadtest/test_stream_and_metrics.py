"""SSE stream folding (pure), replica counter parsing and deltas, traces."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from loadtest.client import RequestRecord, StreamAccumulator, build_payload
from loadtest.replica_metrics import ReplicaCounters, metrics_url, parse_counters, server_stats
from loadtest.trace import TraceError, write_trace
from loadtest.workloads import RequestSpec, make_workload, take_requests

SPEC = RequestSpec(request_id="r", prompt="hi ", max_tokens=3, prompt_tokens=1)


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n"


def fold(lines: list[tuple[float, bytes]], end: float) -> RequestRecord:
    record = RequestRecord(spec=SPEC, send_s=0.0)
    stream = StreamAccumulator(record)
    for t, line in lines:
        if not stream.feed(line, t):
            break
    stream.finish(end)
    return record


def completion(text: str) -> dict[str, object]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def test_a_vllm_completion_stream() -> None:
    usage = {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    r = fold(
        [
            (0.1, event(completion(" bal"))),
            (0.1, b"\n"),
            (0.12, b": ping\n"),
            (0.2, event(completion(" kor"))),
            (0.35, event(completion(" tum"))),
            (0.36, event({"choices": [], "usage": usage})),
            (0.37, b"data: [DONE]\n"),
        ],
        end=0.38,
    )
    assert r.ok and r.text == " bal kor tum"
    assert r.chunk_s == [0.1, 0.2, 0.35]
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens) == (3, 12, 8)
    assert r.e2e_s == pytest.approx(0.38)


def test_chat_role_chunk_is_not_content_and_usage_is_optional() -> None:
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    tok = {"choices": [{"delta": {"content": "x"}}]}
    r = fold(
        [(0.05, event(role)), (0.2, event(tok)), (0.3, event(tok)), (0.3, b"data: [DONE]")], 0.31
    )
    assert r.ok and r.chunk_s == [0.2, 0.3]
    assert r.output_tokens == 2 and r.cached_tokens is None  # one token per chunk fallback


@pytest.mark.parametrize(
    ("lines", "cause"),
    [
        (
            [event(completion("a")), event({"error": {"message": "boom", "code": 500}})],
            "stream_error",
        ),
        ([event(completion("a")), b"data: {not json"], "stream_error"),
        ([event(completion("a"))], "incomplete_stream"),
        (
            [event({"choices": [], "usage": {"completion_tokens": 0}}), b"data: [DONE]"],
            "no_content",
        ),
    ],
)
def test_failures_by_cause(lines: list[bytes], cause: str) -> None:
    r = fold([(0.1 * i, line) for i, line in enumerate(lines)], 1.0)
    assert r.error == cause and not r.ok


def test_payload_asks_for_usage_and_fixed_length() -> None:
    body = build_payload(SPEC, "m")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 3 and body["prompt"] == "hi "
    chat = RequestSpec(
        request_id="c", messages=(("user", "q"),), session="conv-1", ignore_eos=False
    )
    body = build_payload(chat, "m")
    assert body["messages"] == [{"role": "user", "content": "q"}]
    assert body["user"] == "conv-1" and "ignore_eos" not in body and "prompt" not in body


EXPOSITION = """\
# HELP vllm:prefix_cache_queries Prefix cache queries (tokens).
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# HELP vllm:prefix_cache_hits Prefix cache hits (tokens).
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
# HELP vllm:num_preemptions Preemptions.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
# HELP vllm:request_success Finished requests.
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
# HELP vllm:num_requests_running Running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
"""


def test_parse_counters_sums_label_sets() -> None:
    c = parse_counters(EXPOSITION)
    assert c["prefix_cache_queries"] == 1000 and c["prefix_cache_hits"] == 600
    assert c["preemptions"] == 2 and c["requests"] == 10
    assert c["prompt_tokens"] == 0  # absent counters read as 0
    legacy = parse_counters(
        "# TYPE vllm:gpu_prefix_cache_hits counter\nvllm:gpu_prefix_cache_hits_total 5\n"
    )
    assert legacy["prefix_cache_hits"] == 5


def test_server_stats_are_deltas() -> None:
    zero = dict.fromkeys(parse_counters(""), 0.0)
    a0 = dict(zero, prefix_cache_hits=100, prefix_cache_queries=200, requests=5, preemptions=1)
    a1 = dict(zero, prefix_cache_hits=400, prefix_cache_queries=600, requests=35, preemptions=3)
    b0 = dict(zero)
    b1 = dict(zero, prefix_cache_hits=100, prefix_cache_queries=400, requests=10)
    before = {
        "A": ReplicaCounters("A", a0),
        "B": ReplicaCounters("B", b0),
        "C": ReplicaCounters("C", None),
    }
    after = {
        "A": ReplicaCounters("A", a1),
        "B": ReplicaCounters("B", b1),
        "C": ReplicaCounters("C", zero),
    }
    s = server_stats(before, after)
    assert s.prefix_cache_hit_rate == pytest.approx((300 + 100) / (400 + 400))
    assert s.per_replica_requests == {"A": 30, "B": 10}
    assert s.per_replica_share == {"A": 0.75, "B": 0.25}
    assert s.preemptions == 2 and s.unreachable == ("C",)
    assert metrics_url("http://h:1/") == "http://h:1/metrics"
    assert metrics_url("http://h:1/metrics") == "http://h:1/metrics"


def test_trace_round_trip_and_replay_order(tmp_path: Path) -> None:
    specs = take_requests(make_workload("random", {"input_len": 8, "output_len": 4}), 3)
    chat = RequestSpec(request_id="c", messages=(("user", "hey "),), max_tokens=2, session="s1")
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [(0.5, specs[0]), (0.1, specs[1]), (0.3, chat)])
    w = make_workload("trace", {"path": str(path), "time_scale": 2.0})
    assert w.self_timed and w.natural_size == 3
    sessions = list(w.sessions())
    assert [s.at_s for s in sessions] == [0.2, 0.6, 1.0]  # sorted and scaled
    first = sessions[0].request(0)
    assert first.prompt == specs[1].prompt and first.max_tokens == 4 and first.ignore_eos
    replayed_chat = sessions[1].request(0)
    assert replayed_chat.messages == (("user", "hey "),) and replayed_chat.session == "s1"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"nope", "not JSON"),
        (b'{"prompt": "x"}', "max_tokens"),
        (b'{"max_tokens": 3}', "prompt"),
        (b'{"prompt": "x", "max_tokens": 3, "timestamp": -1}', "timestamp"),
        (b'{"messages": [{"role": 1}], "max_tokens": 3}', "role"),
    ],
)
def test_bad_trace_lines_name_the_line(tmp_path: Path, line: bytes, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "ok", "max_tokens": 1}\n' + line + b"\n")
    w = make_workload("trace", {"path": str(path)})
    with pytest.raises(TraceError, match=f"bad.jsonl:2: .*{message}"):
        list(w.sessions())


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        make_workload("trace", {"path": str(tmp_path / "missing.jsonl")})
