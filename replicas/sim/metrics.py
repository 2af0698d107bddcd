"""vLLM's Prometheus metrics (V1 names, labels `model_name` and `engine`) on a registry passed in.

Gauges and the engine-wide counters are read from `Engine.stats()` at scrape time by a custom
collector, so a scrape always sees the engine's current state and the counters can never drift from
the engine's own bookkeeping. Per-request histograms and `vllm:request_success` are fed by the
runtime as requests progress (`SimMetrics` is a `RuntimeObserver`).

Bucket boundaries are vLLM's (vllm/v1/metrics/loggers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from replicas.sim.engine import EngineStats, StepResult
from replicas.sim.runtime import RequestStream

__all__ = [
    "FINISH_REASONS",
    "ITL_BUCKETS_S",
    "REQUEST_LATENCY_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "SimMetrics",
    "build_1_2_5_buckets",
]

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")
_LABELS = ("model_name", "engine")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _EngineStatsCollector(Collector):
    """Yields the engine-state gauges and counters from one `stats()` call per scrape."""

    def __init__(self, stats: Callable[[], EngineStats], labels: tuple[str, str]) -> None:
        self._stats = stats
        self._labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        labels = self._labels

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.num_preemptions,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )

    def describe(self) -> Iterator[Metric]:
        return iter(())  # no describe-time call into the engine


class SimMetrics:
    """Every metric of one simulated replica, registered on `registry`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        model_name: str,
        stats: Callable[[], EngineStats],
        max_model_len: int,
        cache_config: Mapping[str, str],
        engine_index: int = 0,
    ) -> None:
        labels = (model_name, str(engine_index))
        self.registry = registry
        registry.register(_EngineStatsCollector(stats, labels))

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(
                name, doc, labelnames=_LABELS, buckets=buckets, registry=registry
            ).labels(*labels)

        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=(*_LABELS, "finished_reason"),
            registry=registry,
        )
        self._success = {r: success.labels(*labels, r) for r in FINISH_REASONS}
        self._success_family = success
        self._labels = labels
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS_S,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS_S,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS_S,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.generation_tokens = hist(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            list(ITERATION_TOKENS_BUCKETS),
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labelnames=(*cache_config.keys(), "engine"),
            registry=registry,
        )
        info.labels(*cache_config.values(), str(engine_index)).set(1)

    # ------------------------------------------------------------------ RuntimeObserver

    def on_step(self, result: StepResult) -> None:
        tokens = result.num_prefill_tokens + result.num_decode_tokens
        if tokens:
            self.iteration_tokens.observe(tokens)

    def on_tokens(
        self, stream: RequestStream, num_new: int, now_s: float, prev_s: float | None
    ) -> None:
        if prev_s is None:
            self.ttft.observe(now_s - stream.arrival_s)
        else:
            self.itl.observe(now_s - prev_s)

    def on_finished(self, stream: RequestStream, now_s: float) -> None:
        reason = stream.finish_reason or "abort"
        counter = self._success.get(reason)
        if counter is None:
            counter = self._success_family.labels(*self._labels, reason)
        counter.inc()
        self.e2e.observe(now_s - stream.arrival_s)
        scheduled = stream.first_scheduled_s
        if scheduled is None:  # never reached the GPU: all of its life was queueing
            self.queue.observe(now_s - stream.arrival_s)
            return
        # vLLM's intervals (vllm/v1/metrics/stats.py): queue = first SCHEDULED - QUEUED;
        # prefill = first token - first SCHEDULED; decode = last token - first token;
        # inference = last token - first SCHEDULED (preemptions count inside them).
        self.queue.observe(scheduled - stream.arrival_s)
        first, last = stream.first_token_s, stream.last_token_s
        if first is not None and last is not None:
            self.inference.observe(last - scheduled)
            self.prefill.observe(first - scheduled)
            self.decode.observe(last - first)
            if stream.num_output_tokens > 1:
                self.tpot.observe((last - first) / (stream.num_output_tokens - 1))
        else:  # ended (aborted) before its first token: no prefill or decode interval
            self.inference.observe(now_s - scheduled)
        self.prompt_tokens.observe(stream.num_prompt_tokens)
        self.generation_tokens.observe(stream.num_output_tokens)
