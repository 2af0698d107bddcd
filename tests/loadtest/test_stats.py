"""Figures on hand-built timelines: TTFT, TPOT, ITL, E2E, percentiles, goodput, throughput."""

from __future__ import annotations

import math

import pytest

from loadtest.client import RequestRecord
from loadtest.stats import Slo, latency_stats, meets_slo, parse_slo, summarize, throughput_timeline
from loadtest.workloads import RequestSpec


def rec(
    send: float,
    chunks: list[float],
    end: float,
    out: int,
    *,
    error: str | None = None,
    prompt: int = 10,
    replica: str | None = None,
) -> RequestRecord:
    r = RequestRecord(spec=RequestSpec(request_id=f"r{send}", prompt="x", prompt_tokens=prompt))
    r.send_s, r.chunk_s, r.end_s, r.output_tokens = send, list(chunks), end, out
    r.prompt_tokens, r.error, r.replica = prompt, error, replica
    return r


# r1: TTFT 100 ms, ITL 50 + 100 ms, TPOT (260 - 100) / 2 = 80 ms, E2E 260 ms
# r2: TTFT 200 ms, ITL 100 ms,      TPOT (300 - 200) / 1 = 100 ms, E2E 300 ms
# r3: TTFT 50 ms, one token (no TPOT; counts as 0 for goodput), E2E 50 ms
# r4: failed with HTTP 503
def timeline() -> list[RequestRecord]:
    return [
        rec(0.0, [0.1, 0.15, 0.25], 0.26, 3, replica="a"),
        rec(0.5, [0.7, 0.8], 0.8, 2, replica="b"),
        rec(1.0, [1.05], 1.05, 1, replica="a"),
        rec(1.0, [], 1.01, 0, error="http_503"),
    ]


def test_per_request_definitions() -> None:
    r1, r2, r3, _ = timeline()
    assert r1.ttft_s == pytest.approx(0.1)
    assert r1.itl_s == pytest.approx([0.05, 0.1])
    assert r1.tpot_s == pytest.approx(0.08)
    assert r1.e2e_s == pytest.approx(0.26)
    assert r2.tpot_s == pytest.approx(0.1)
    assert r3.tpot_s is None


def test_summary_on_a_known_timeline() -> None:
    s = summarize(timeline(), slo=parse_slo("ttft=150ms,tpot=90ms"), window_s=(0.0, 1.05))
    assert (s.completed, s.failed) == (3, 1)
    assert s.errors == {"http_503": 1}
    assert s.duration == pytest.approx(1.05)
    assert s.total_output_tokens == 6 and s.total_input_tokens == 30
    assert s.request_throughput == pytest.approx(3 / 1.05)
    assert s.output_throughput == pytest.approx(6 / 1.05)
    assert s.total_token_throughput == pytest.approx(36 / 1.05)
    # goodput: r1 meets both, r2 misses TTFT, r3 meets (TPOT 0)
    assert s.request_goodput == pytest.approx(2 / 1.05)

    ttft = s.latency["ttft"]  # [50, 100, 200] ms
    assert ttft.mean == pytest.approx(350 / 3)
    assert ttft.median == pytest.approx(100)
    assert ttft.percentiles[50] == pytest.approx(100)
    assert ttft.percentiles[90] == pytest.approx(180)  # 100 + 0.8 * (200 - 100)
    assert ttft.percentiles[99] == pytest.approx(198)
    mean = 350 / 3
    std = math.sqrt(((50 - mean) ** 2 + (100 - mean) ** 2 + (200 - mean) ** 2) / 3)
    assert ttft.std == pytest.approx(std)

    tpot = s.latency["tpot"]  # [80, 100]: single-token r3 excluded, as vLLM
    assert (
        tpot.count == 2
        and tpot.mean == pytest.approx(90)
        and tpot.percentiles[99] == pytest.approx(99.8)
    )
    itl = s.latency["itl"]  # [50, 100, 100]
    assert itl.mean == pytest.approx(250 / 3) and itl.median == pytest.approx(100)
    e2e = s.latency["e2el"]  # [50, 260, 300]
    assert e2e.median == pytest.approx(260) and e2e.percentiles[90] == pytest.approx(292)

    assert s.client_replica_share == {"a": pytest.approx(2 / 3), "b": pytest.approx(1 / 3)}
    assert s.max_concurrent_requests == 1
    assert s.offered_rate == pytest.approx(3 / 1.0)  # 4 sends over 1 s: 3 gaps


def test_goodput_absent_without_slo_and_zero_when_nothing_meets() -> None:
    assert summarize(timeline()).request_goodput is None
    s = summarize(timeline(), slo=Slo(ttft_ms=10), window_s=(0, 1))
    assert s.request_goodput == 0.0
    assert not meets_slo(timeline()[3], Slo(ttft_ms=1e9))  # a failed request is never good


def test_e2e_slo_and_concurrency_sweep() -> None:
    records = [rec(0.0, [0.1, 0.2], 0.5, 2), rec(0.1, [0.2, 0.3], 0.4, 2), rec(0.5, [0.6], 0.6, 1)]
    s = summarize(records, slo=Slo(e2el_ms=450), window_s=(0, 1))
    assert s.request_goodput == pytest.approx(2.0)  # 0.4 s and 0.1 s pass, 0.5 s fails
    # [0, .5) and [.1, .4) overlap; [.5, .6) starts as the first ends (half-open)
    assert s.max_concurrent_requests == 2


def test_throughput_timeline_buckets() -> None:
    r1, r2, r3, r4 = timeline()
    assert throughput_timeline([r1, r2, r3, r4], 0.0, 0.5) == pytest.approx([6.0, 4.0, 2.0])
    r = rec(0.0, [0.1, 0.2], 0.2, 10)  # 2 chunks carrying 10 tokens
    assert throughput_timeline([r], 0.0, 1.0) == pytest.approx([10.0])


def test_empty_latency_is_zero_like_vllm() -> None:
    empty = latency_stats([])
    assert (empty.mean, empty.median, empty.count) == (0.0, 0.0, 0)
    s = summarize([rec(0.0, [], 0.1, 0, error="timeout")])
    assert s.completed == 0 and s.latency["ttft"].mean == 0.0 and s.errors == {"timeout": 1}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ttft=200ms,tpot=50ms", Slo(ttft_ms=200, tpot_ms=50)),
        ("ttft:200", Slo(ttft_ms=200)),
        ("e2e=1.5s", Slo(e2el_ms=1500)),
        (" TPOT = 20 ", Slo(tpot_ms=20)),
    ],
)
def test_parse_slo(text: str, expected: Slo) -> None:
    assert parse_slo(text) == expected


@pytest.mark.parametrize("text", ["", "ttft", "foo=1", "ttft=-1", "ttft=abc", "itl=5", "ttft=inf"])
def test_parse_slo_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_slo(text)
