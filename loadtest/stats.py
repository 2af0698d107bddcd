"""Figures of a run, computed from request records exactly as vLLM's bench serve defines them.

* TTFT: send → first streamed content chunk.
* ITL: gaps between consecutive content chunks (all gaps of all successful requests pooled).
* TPOT: ``(E2E - TTFT) / (output_tokens - 1)`` per request with more than one output token.
* E2E (``e2el``): send → last byte of the stream.
* Throughputs divide by the measured window: first measured send → last measured end.
* Goodput: completed requests per second that met *every* SLO given (TPOT counts as 0 for a
  request with a single output token, as in vLLM).

Percentiles use linear interpolation (``numpy.percentile``), std is the population std; an
empty list gives 0.0, as vLLM does.  Everything here is pure: records in, numbers out.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from loadtest.client import RequestRecord
from loadtest.replica_metrics import ServerStats

__all__ = [
    "LATENCY_METRICS",
    "PERCENTILES",
    "LatencyStats",
    "Slo",
    "Summary",
    "latency_stats",
    "meets_slo",
    "parse_slo",
    "summarize",
    "throughput_timeline",
]

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in milliseconds; ``None`` means not set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def describe(self) -> str:
        parts = [
            f"{name}<={value:g}ms"
            for name, value in (
                ("ttft", self.ttft_ms),
                ("tpot", self.tpot_ms),
                ("e2el", self.e2el_ms),
            )
            if value is not None
        ]
        return ",".join(parts)


_SLO_ITEM = re.compile(r"^\s*(ttft|tpot|e2el|e2e|itl)\s*[=:]\s*([0-9.eE+-]+)\s*(ms|s)?\s*$")


def parse_slo(text: str) -> Slo:
    """Parse ``ttft=200ms,tpot=50ms`` (also ``ttft:200``, seconds with ``s``); raises ValueError."""
    values: dict[str, float] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        match = _SLO_ITEM.match(item.lower())
        if match is None:
            raise ValueError(
                f"bad SLO {item.strip()!r}: use NAME=VALUE[ms|s] with NAME one of ttft, tpot, e2el"
            )
        name, raw, unit = match.groups()
        if name == "itl":
            raise ValueError("an ITL SLO is not defined for goodput; use tpot")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"bad SLO value {raw!r}") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"SLO {name} must be a finite number >= 0, got {raw}")
        values["e2el" if name == "e2e" else name] = value * (1000.0 if unit == "s" else 1.0)
    if not values:
        raise ValueError("empty SLO: give e.g. ttft=200ms,tpot=50ms")
    return Slo(ttft_ms=values.get("ttft"), tpot_ms=values.get("tpot"), e2el_ms=values.get("e2el"))


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Mean, median, std and percentiles of one latency, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: Mapping[int, float]
    count: int


def latency_stats(values_s: Sequence[float]) -> LatencyStats:
    """Stats of ``values_s`` (seconds) in ms; all zeros for an empty list, as vLLM."""
    data = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000.0
    return LatencyStats(
        mean=float(np.mean(data)),
        median=float(np.median(data)),
        std=float(np.std(data)),
        percentiles={p: float(np.percentile(data, p)) for p in PERCENTILES},
        count=len(values_s),
    )


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Whether a successful request met every SLO set."""
    ttft, e2e = record.ttft_s, record.e2e_s
    if not record.ok or ttft is None or e2e is None:
        return False
    tpot = record.tpot_s or 0.0  # vLLM: a single-token answer has TPOT 0 for goodput
    checks = ((slo.ttft_ms, ttft), (slo.tpot_ms, tpot), (slo.e2el_ms, e2e))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def throughput_timeline(
    records: Sequence[RequestRecord], origin_s: float, bucket_s: float = 1.0
) -> list[float]:
    """Output tokens per second in consecutive ``bucket_s`` buckets from ``origin_s``.

    Each content chunk carries ``output_tokens / chunks`` tokens of its request.
    """
    if bucket_s <= 0:
        raise ValueError("bucket_s must be > 0")
    buckets: defaultdict[int, float] = defaultdict(float)
    for record in records:
        if not record.ok or not record.chunk_s:
            continue
        per_chunk = record.output_tokens / len(record.chunk_s)
        for t in record.chunk_s:
            buckets[max(0, int((t - origin_s) / bucket_s))] += per_chunk
    if not buckets:
        return []
    return [buckets.get(i, 0.0) / bucket_s for i in range(max(buckets) + 1)]


def _max_concurrency(records: Sequence[RequestRecord]) -> int:
    events: list[tuple[float, int]] = []
    for record in records:
        if record.ok and record.end_s is not None:
            events += [(record.send_s, 1), (record.end_s, -1)]
    events.sort()  # at equal times the end (-1) sorts first: half-open intervals
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


@dataclass(frozen=True, slots=True)
class Summary:
    """The figures of one run (see the module docstring for the definitions)."""

    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    latency: Mapping[str, LatencyStats]
    offered_rate: float | None  # measured requests sent per second (None: fewer than 2)
    errors: Mapping[str, int]
    client_replica_share: Mapping[str, float]  # from the x-fleet-replica response header
    cached_tokens: int | None  # sum of usage.prompt_tokens_details.cached_tokens, when reported
    server: ServerStats | None = None
    slo: Slo = field(default_factory=Slo)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return None if self.server is None else self.server.prefix_cache_hit_rate

    def to_dict(self) -> dict[str, object]:
        """Flat mapping with vLLM bench serve's field names, then our extras."""
        out: dict[str, object] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for name in LATENCY_METRICS:
            stats = self.latency[name]
            out[f"mean_{name}_ms"] = stats.mean
            out[f"median_{name}_ms"] = stats.median
            out[f"std_{name}_ms"] = stats.std
            for p, value in stats.percentiles.items():
                out[f"p{p}_{name}_ms"] = value
        server = self.server
        out.update(
            {
                "offered_rate": self.offered_rate,
                "achieved_rate": self.request_throughput,
                "slo": self.slo.describe() or None,
                "prefix_cache_hit_rate": None if server is None else server.prefix_cache_hit_rate,
                "per_replica_share": None if server is None else dict(server.per_replica_share),
                "preemptions": None if server is None else server.preemptions,
                "client_replica_share": dict(self.client_replica_share),
                "cached_tokens": self.cached_tokens,
                "errors": dict(self.errors),
            }
        )
        return out


def summarize(
    records: Sequence[RequestRecord],
    *,
    slo: Slo | None = None,
    server: ServerStats | None = None,
    window_s: tuple[float, float] | None = None,
) -> Summary:
    """Summarize measured ``records``.

    ``window_s`` is (start, end) in ``perf_counter`` seconds; by default the first send to the
    last end among the records.
    """
    slo = slo or Slo()
    done = [r for r in records if r.ok]
    if window_s is None:
        starts = [r.send_s for r in records]
        ends = [r.end_s for r in records if r.end_s is not None]
        window_s = (min(starts, default=0.0), max(ends, default=0.0))
    duration = max(window_s[1] - window_s[0], 1e-9)
    input_tokens = sum(r.prompt_tokens or r.spec.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    ttfts = [t for r in done if (t := r.ttft_s) is not None]
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    e2es = [t for r in done if (t := r.e2e_s) is not None]
    itls = [gap for r in done for gap in r.itl_s]
    sends = sorted(r.send_s for r in records)
    offered = (
        (len(sends) - 1) / (sends[-1] - sends[0])
        if len(sends) > 1 and sends[-1] > sends[0]
        else None
    )
    replicas = Counter(r.replica for r in done if r.replica)
    total_replica = sum(replicas.values())
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    timeline = throughput_timeline(done, window_s[0])
    return Summary(
        duration=duration,
        completed=len(done),
        failed=len(records) - len(done),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration,
        request_goodput=None if slo.empty else sum(1 for r in done if meets_slo(r, slo)) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        max_output_tokens_per_s=max(timeline, default=0.0),
        max_concurrent_requests=_max_concurrency(done),
        latency={
            "ttft": latency_stats(ttfts),
            "tpot": latency_stats(tpots),
            "itl": latency_stats(itls),
            "e2el": latency_stats(e2es),
        },
        offered_rate=offered,
        errors=dict(sorted(Counter(r.error for r in records if r.error is not None).items())),
        client_replica_share={k: v / total_replica for k, v in sorted(replicas.items())},
        cached_tokens=sum(cached) if cached else None,
        server=server,
        slo=slo,
    )
