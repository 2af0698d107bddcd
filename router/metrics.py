"""Every Prometheus metric of the router, defined once, on a registry passed in.

Names start with `fleet_router_`; counters get `_total` in the exposition; durations are
`_seconds` histograms whose buckets are defined once below.  Each gateway owns one
`RouterMetrics` on its own `CollectorRegistry`, so two gateways (or two tests) never share one.
The Grafana dashboard in deploy/ is built on these exact names: do not rename them.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from router.prefix.index import IndexStats

__all__ = [
    "DECISION_BUCKETS_S",
    "LATENCY_BUCKETS_S",
    "MATCH_RATIO_BUCKETS",
    "TTFT_BUCKETS_S",
    "LoopHistogram",
    "PrefixMetrics",
    "RouterMetrics",
    "StateBackendCollector",
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
# A bucket bound as prometheus_client writes `le` (the library function is untyped).
_le: Callable[[float], str] = floatToGoString
_Child = TypeVar("_Child")


class _LoopMetric(Collector, Generic[_Child]):
    """What the lock-free metrics below share: one child per label set, made on first use and
    looked up by label values (in order, or by name); the exposition is built at scrape time
    through prometheus_client's custom-collector API, so updates take no lock.  They are
    updated from the event loop's thread only (the request path)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = list(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        registry.register(self)

    def labels(self, *values: str, **by_name: str) -> _Child:
        if by_name:
            if values or set(by_name) != set(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}")
            values = tuple(by_name[name] for name in self._labelnames)
        elif len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._new_child()
        return child

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _new_child(self) -> _Child:
        raise NotImplementedError

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopHistogram(_LoopMetric["LoopHistogramChild"]):
    """A labelled histogram for the request path.

    prometheus_client's `Histogram` takes a lock and walks its bucket bounds in Python on every
    observation: in a single-threaded event loop the lock is pure cost, and three observations
    per request made the metrics a visible share of the router's CPU.  Here an observation is a
    bisect and two additions; the exposition (names, labels, `le` bounds, `_bucket`/`_count`/
    `_sum`) is the same.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._bounds = tuple(sorted(buckets))
        self._les = [_le(b) for b in self._bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> LoopHistogramChild:
        return LoopHistogramChild(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            cumulative, running = [], 0
            for le, count in zip(self._les, child.counts, strict=True):
                running += count
                cumulative.append((le, float(running)))
            family.add_metric(list(values), cumulative, child.sum)
        yield family


class LoopHistogramChild:
    """One label set of a `LoopHistogram`."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # `le`: value <= bound
        self.sum += value


class LoopCounter(_LoopMetric["LoopCounterChild"]):
    """A labelled counter for the request path: prometheus_client's `Counter` exposition (but
    no `_created` series) without a lock taken on every increment."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _new_child(self) -> LoopCounterChild:
        return LoopCounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family


class LoopCounterChild:
    """One label set of a `LoopCounter`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class RouterMetrics:
    """The router's metrics on `registry` (a fresh `CollectorRegistry` per gateway)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Labelled children looked up once: `labels()` costs microseconds on every request.
        self._request_children: dict[tuple[str, str, int], LoopCounterChild] = {}
        self._duration_children: dict[str, LoopHistogramChild] = {}

        # --- requests ----------------------------------------------------------------------
        self.requests = LoopCounter(
            _P + "requests",
            "Requests answered by the router, by model, serving replica and HTTP status",
            ["model", "replica", "status"],
            registry=registry,
        )
        self.request_duration = LoopHistogram(
            _P + "request_duration_seconds",
            "Time from request received to last byte sent",
            ["model"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.ttft = LoopHistogram(
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
        self.decision_seconds = LoopHistogram(
            _P + "decision_seconds",
            "Time to build the candidate views and run the policy",
            ["policy"],
            buckets=DECISION_BUCKETS_S,
            registry=registry,
        )
        self.decisions = LoopCounter(
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
        # --- DNS discovery (router.fleet.discovery) ----------------------------------------
        self.discovery_errors = Counter(
            _P + "discovery_errors",
            "Failed resolutions of a --discover-dns name (nothing is removed on a failure)",
            ["target"],
            registry=registry,
        )
        self.discovery_replicas = Gauge(
            _P + "discovery_replicas",
            "Replicas registered from a --discover-dns name",
            ["target"],
            registry=registry,
        )
        # Prefix index / cache-aware routing: see `PrefixMetrics` at the end of this module.
        self.prefix = PrefixMetrics(registry)
        # Shared-state backend: see `StateBackendCollector` at the end of this module.
        self._state_backend: StateBackendCollector | None = None

    def watch_state_backend(self, backend: _StateBackendSource) -> None:
        """Export the state backend's health and counters (read at each scrape)."""
        if self._state_backend is None:
            self._state_backend = StateBackendCollector(backend)
            self.registry.register(self._state_backend)

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
        self.prefix.forget_replica(replica_id)

    # --- cache-aware routing metrics -------------------------------------------------------------


# === prefix index / cache-aware routing (docs/routing.md) =======================================

# Fraction of a prompt's tokens the chosen replica was predicted to hold.
MATCH_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _IndexStatsSource(Protocol):
    def stats(self) -> IndexStats: ...


class _IndexCollector(Collector):
    """Reads the prefix index's size at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, index: _IndexStatsSource) -> None:
        self._index = index

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic label sets: nothing to pre-declare

    def collect(self) -> Iterable[Metric]:
        stats = self._index.stats()
        blocks = GaugeMetricFamily(
            _P + "index_blocks", "Blocks in the prefix index, by model", labels=["model"]
        )
        for model, count in sorted(stats.blocks_by_model.items()):
            blocks.add_metric([model], count)
        yield blocks
        yield GaugeMetricFamily(
            _P + "index_bytes",
            "Approximate memory of the prefix index (measured bytes per block x blocks)",
            value=stats.approx_bytes,
        )
        evictions = CounterMetricFamily(
            _P + "index_evictions",
            "Blocks evicted from the index per replica (its KV capacity, or the global cap)",
            labels=["replica"],
        )
        for replica, count in sorted(stats.evictions.items()):
            evictions.add_metric([replica], count)
        yield evictions
        held = GaugeMetricFamily(
            _P + "index_replica_blocks",
            "Blocks the prefix index believes each replica holds",
            labels=["replica"],
        )
        for replica, count in sorted(stats.held_blocks.items()):
            held.add_metric([replica], count)
        yield held


class PrefixMetrics:
    """Predicted vs observed cache hits, index size, match ratio and KV-event consumption.

    The router's *predicted* hit and prompt tokens per replica sit beside the scraped
    `fleet_router_replica_observed_hit_tokens` / `..._observed_query_tokens`, so a dashboard can
    divide one by the other and see how well the index mirrors each replica's cache.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._collector: _IndexCollector | None = None
        self._kv_event_labels: set[tuple[str, str]] = set()
        # Labelled children looked up once (hot path: every routed request).
        self._route_children: dict[str, tuple[Any, Any]] = {}
        self._ratio_children: dict[str, Any] = {}
        self.predicted_hit_tokens = Counter(
            _P + "predicted_hit_tokens",
            "Prompt tokens the router predicted the chosen replica had cached",
            ["replica"],
            registry=registry,
        )
        self.predicted_prompt_tokens = Counter(
            _P + "predicted_prompt_tokens",
            "Prompt tokens (router estimate) of requests routed to the replica",
            ["replica"],
            registry=registry,
        )
        self.match_ratio = LoopHistogram(
            _P + "match_ratio",
            "Predicted cached fraction of each routed prompt on the chosen replica",
            ["policy"],
            buckets=MATCH_RATIO_BUCKETS,
            registry=registry,
        )
        self.kv_events = Counter(
            _P + "kv_events",
            "KV-cache events applied to the index in exact mode, by replica and event type",
            ["replica", "type"],
            registry=registry,
        )
        self.kv_event_gaps = Counter(
            _P + "kv_event_gaps",
            "Jumps in a replica's KV-event sequence numbers (missed batches)",
            ["replica"],
            registry=registry,
        )

    def watch_index(self, index: _IndexStatsSource) -> None:
        """Export `index`'s size and evictions (read at each scrape)."""
        if self._collector is None:
            self._collector = _IndexCollector(index)
            self._registry.register(self._collector)

    def observe_route(self, policy: str, replica: str, prompt_tokens: int, hit_tokens: int) -> None:
        """One routed request: its predicted hit on the chosen replica."""
        if prompt_tokens <= 0:
            return
        hit = min(hit_tokens, prompt_tokens)
        children = self._route_children.get(replica)
        if children is None:
            children = self._route_children[replica] = (
                self.predicted_hit_tokens.labels(replica),
                self.predicted_prompt_tokens.labels(replica),
            )
        children[0].inc(hit)
        children[1].inc(prompt_tokens)
        ratio = self._ratio_children.get(policy)
        if ratio is None:
            ratio = self._ratio_children[policy] = self.match_ratio.labels(policy)
        ratio.observe(hit / prompt_tokens)

    def kv_events_applied(self, replica: str, kind: str, count: int) -> None:
        self._kv_event_labels.add((replica, kind))
        self.kv_events.labels(replica, kind).inc(count)

    def kv_event_gap(self, replica: str, missed: int) -> None:
        self.kv_event_gaps.labels(replica).inc()

    def forget_replica(self, replica_id: str) -> None:
        """Drop a removed replica's series."""
        self._route_children.pop(replica_id, None)
        for counter in (
            self.predicted_hit_tokens,
            self.predicted_prompt_tokens,
            self.kv_event_gaps,
        ):
            with contextlib.suppress(KeyError):
                counter.remove(replica_id)
        for labels in [k for k in self._kv_event_labels if k[0] == replica_id]:
            self._kv_event_labels.discard(labels)
            with contextlib.suppress(KeyError):
                self.kv_events.remove(*labels)


# === state backend (docs/redis.md) ===============================================================


class _BackendStatsSource(Protocol):
    up: bool
    is_leader: bool
    published_changes: int
    applied_changes: int
    failed_writes: int
    failed_reads: int
    resyncs: int
    snapshots_written: int
    snapshots_loaded: int


class _StateBackendSource(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def stats(self) -> _BackendStatsSource: ...
    @property
    def dropped_updates(self) -> int: ...
    @property
    def pending_changes(self) -> int: ...


class StateBackendCollector(Collector):
    """Reads the state backend's plain counters at scrape time: nothing on the request path."""

    def __init__(self, backend: _StateBackendSource) -> None:
        self._backend = backend

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic label values: nothing to pre-declare

    def collect(self) -> Iterable[Metric]:
        b = self._backend
        s = b.stats
        kind = [b.kind]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(_P + name, doc, labels=["backend"])
            family.add_metric(kind, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(_P + name, doc, labels=["backend"])
            family.add_metric(kind, value)
            return family

        yield gauge("state_backend_up", "1 when the shared-state backend answers", int(s.up))
        yield gauge(
            "state_backend_leader", "1 on the instance holding the leader lease", int(s.is_leader)
        )
        yield gauge("state_pending_changes", "Changes queued, not yet written", b.pending_changes)
        yield counter(
            "state_dropped_updates",
            "Shared-state updates thrown away because a queue was full",
            b.dropped_updates,
        )
        yield counter(
            "state_published_changes", "Index/registry changes written", s.published_changes
        )
        yield counter(
            "state_applied_changes", "Other instances' changes applied here", s.applied_changes
        )
        yield counter("state_resyncs", "Re-syncs after a gap in the change stream", s.resyncs)
        errors = CounterMetricFamily(
            _P + "state_errors", "Failed shared-state calls", labels=["backend", "op"]
        )
        errors.add_metric([b.kind, "read"], s.failed_reads)
        errors.add_metric([b.kind, "write"], s.failed_writes)
        yield errors
        snapshots = CounterMetricFamily(
            _P + "state_snapshots", "Index snapshots written or loaded", labels=["backend", "op"]
        )
        snapshots.add_metric([b.kind, "written"], s.snapshots_written)
        snapshots.add_metric([b.kind, "loaded"], s.snapshots_loaded)
        yield snapshots
