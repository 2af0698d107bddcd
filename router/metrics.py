"""Every Prometheus metric of the router, defined once, on a registry passed in.

Names start with `fleet_router_`; counters get `_total` in the exposition; durations are
`_seconds` histograms whose buckets are defined once below.  Each gateway owns one
`RouterMetrics` on its own `CollectorRegistry`, so two gateways (or two tests) never share one.
The Grafana dashboard in deploy/ is built on these exact names: do not rename them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "DECISION_BUCKETS_S",
    "LATENCY_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "RouterMetrics",
]

# Request latency: from a few ms (cached, short answers) to many minutes (long generations).
LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# Time to first byte seen at the router: prefill plus queueing.
TTFT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
# A routing decision is pure CPU work: microseconds to a few milliseconds.
DECISION_BUCKETS_S = (
    0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
)  # fmt: skip

_P = "fleet_router_"


class RouterMetrics:
    """The router's metrics on `registry` (a fresh `CollectorRegistry` per gateway)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Labelled children looked up once: `labels()` costs microseconds on every request.
        self._request_children: dict[tuple[str, str, int], Any] = {}
        self._duration_children: dict[str, Any] = {}

        # --- requests ----------------------------------------------------------------------
        self.requests = Counter(
            _P + "requests",
            "Requests answered by the router, by model, serving replica and HTTP status",
            ["model", "replica", "status"],
            registry=registry,
        )
        self.request_duration = Histogram(
            _P + "request_duration_seconds",
            "Time from request received to last byte sent",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.ttft = Histogram(
            _P + "ttft_seconds",
            "Time from request received to the first body byte from the replica",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=registry,
        )
        self.retries = Counter(
            _P + "retries",
            "Attempts re-sent to another replica before the first byte, by reason",
            ["model", "reason"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            _P + "upstream_errors",
            "Failed attempts against a replica, by kind (connect, timeout_*, status_5xx, ...)",
            ["replica", "kind"],
            registry=registry,
        )

        # --- decisions ---------------------------------------------------------------------
        self.decision_seconds = Histogram(
            _P + "decision_seconds",
            "Time to build the candidate views and run the policy",
            ["policy"],
            buckets=DECISION_BUCKETS_S,
            registry=registry,
        )
        self.decisions = Counter(
            _P + "decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=registry,
        )

        # --- replica state -----------------------------------------------------------------
        self.replica_up = Gauge(
            _P + "replica_up",
            "1 when the replica is healthy and its circuit is not open",
            ["replica"],
            registry=registry,
        )
        self.replica_in_flight = Gauge(
            _P + "replica_in_flight",
            "Requests this router has sent to the replica and not yet seen finish",
            ["replica"],
            registry=registry,
        )
        self.circuit_state = Gauge(
            _P + "circuit_state",
            "Circuit breaker state: 0 closed, 1 half-open, 2 open",
            ["replica"],
            registry=registry,
        )
        self.replica_running = Gauge(
            _P + "replica_running",
            "Scraped vllm:num_requests_running",
            ["replica"],
            registry=registry,
        )
        self.replica_waiting = Gauge(
            _P + "replica_waiting",
            "Scraped vllm:num_requests_waiting",
            ["replica"],
            registry=registry,
        )
        self.replica_kv_usage = Gauge(
            _P + "replica_kv_usage",
            "Scraped vllm:kv_cache_usage_perc (0..1)",
            ["replica"],
            registry=registry,
        )
        self.replica_observed_hit_tokens = Gauge(
            _P + "replica_observed_hit_tokens",
            "Scraped vllm:prefix_cache_hits_total (tokens)",
            ["replica"],
            registry=registry,
        )
        self.replica_observed_query_tokens = Gauge(
            _P + "replica_observed_query_tokens",
            "Scraped vllm:prefix_cache_queries_total (tokens)",
            ["replica"],
            registry=registry,
        )

    def request_done(self, model: str, replica: str, status: int, duration_s: float) -> None:
        """Count one answered request and its duration (labelled children cached: hot path)."""
        key = (model, replica, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(model, replica, str(status))
        child.inc()
        duration = self._duration_children.get(model)
        if duration is None:
            duration = self._duration_children[model] = self.request_duration.labels(model)
        duration.observe(duration_s)

    def forget_replica(self, replica_id: str) -> None:
        """Drop the per-replica series of a replica removed from the fleet."""
        for gauge in (
            self.replica_up,
            self.replica_in_flight,
            self.circuit_state,
            self.replica_running,
            self.replica_waiting,
            self.replica_kv_usage,
            self.replica_observed_hit_tokens,
            self.replica_observed_query_tokens,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(replica_id)
        for key in [k for k in self._request_children if k[1] == replica_id]:
            del self._request_children[key]  # the requests_total series themselves stay

    # --- cache-aware routing metrics (added by the prefix-index helper) ------------------------
