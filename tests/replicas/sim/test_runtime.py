"""The real-time driver: admissions and token times follow the modelled step schedule exactly."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.engine import Engine, EngineRequest, StepResult
from replicas.sim.metrics import SimMetrics
from replicas.sim.runtime import EngineRuntime, RequestStream

SCALE = 0.5  # half the modelled GPU time: a few ms per step


class _Recorder:
    """Forwards to `SimMetrics` and keeps every step, token delivery and finished stream."""

    def __init__(self, metrics: SimMetrics) -> None:
        self.metrics = metrics
        self.steps: list[StepResult] = []
        self.finished: dict[str, RequestStream] = {}
        self.first_token_step: dict[str, int] = {}  # request id -> index of the step

    def on_step(self, result: StepResult) -> None:
        self.steps.append(result)
        self.metrics.on_step(result)

    def on_tokens(
        self, stream: RequestStream, num_new: int, now_s: float, prev_s: float | None
    ) -> None:
        if prev_s is None:  # delivered before the step's on_step: it is step len(self.steps)
            self.first_token_step[stream.request_id] = len(self.steps)
        self.metrics.on_tokens(stream, num_new, now_s, prev_s)

    def on_finished(self, stream: RequestStream, now_s: float) -> None:
        self.finished[stream.request_id] = stream
        self.metrics.on_finished(stream, now_s)


def _one_at_a_time() -> tuple[Engine, CollectorRegistry, SimMetrics]:
    """An engine running one sequence at a time, and its metrics on a fresh registry."""
    config = EngineConfig(num_gpu_blocks=256, max_num_seqs=1, max_num_batched_tokens=512)
    engine = Engine(config, CostModel(PROFILES[DEFAULT_PROFILE]))
    registry = CollectorRegistry()
    metrics = SimMetrics(
        registry, model_name="m", stats=engine.stats, max_model_len=4096, cache_config={}
    )
    return engine, registry, metrics


def _hist_sum(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(f"{name}_sum", {"model_name": "m", "engine": "0"})
    assert value is not None
    return value


async def test_queue_and_prefill_times_follow_the_step_schedule() -> None:
    # One sequence at a time: B and C queue behind A, then behind each other.
    engine, registry, metrics = _one_at_a_time()
    recorder = _Recorder(metrics)
    # No catch-up reset however slow the machine: the schedule is one unbroken chain.
    runtime = EngineRuntime(engine, time_scale=SCALE, observer=recorder, max_catch_up_s=1e9)
    runtime.start()
    try:
        streams = [
            runtime.submit(EngineRequest(rid, tuple(range(i * 1000, i * 1000 + 200)), 12))
            for i, rid in enumerate(("A", "B", "C"))
        ]
        async with asyncio.timeout(30):
            for stream in streams:
                while not (await stream.next_batch()).finished:
                    pass
    finally:
        await runtime.stop()

    steps = recorder.steps
    assert [s.scheduled for s in steps if s.scheduled] == [("A",), ("B",), ("C",)]
    # Step k starts where step k-1's modelled duration ends (monotonic deadlines).
    a = recorder.finished["A"]
    assert a.first_scheduled_s is not None
    starts = [a.first_scheduled_s]
    for s in steps:
        starts.append(starts[-1] + s.duration_s * SCALE)
    admission_step = {s.scheduled[0]: k for k, s in enumerate(steps) if s.scheduled}
    for rid, k in admission_step.items():
        stream = recorder.finished[rid]
        assert stream.first_scheduled_s == pytest.approx(starts[k], abs=1e-9), rid
        assert stream.first_token_s is not None and stream.last_token_s is not None
        # the first token exists at the end of the admission step (200 tokens fit one step):
        # that step delivers it, never before its modelled end (a busy machine delivers late,
        # so lateness is checked by step, not by wall clock)
        assert recorder.first_token_step[rid] == k, rid
        assert stream.first_token_s >= starts[k + 1] - 1e-9
    # B waited exactly through A's steps, C through A's and B's.
    b, c = recorder.finished["B"], recorder.finished["C"]
    assert b.first_scheduled_s is not None and c.first_scheduled_s is not None
    a_steps = sum(s.duration_s for s in steps[: admission_step["B"]]) * SCALE
    assert b.first_scheduled_s - a.first_scheduled_s == pytest.approx(a_steps, abs=1e-9)
    assert c.first_scheduled_s > b.first_scheduled_s

    # The histograms hold exactly these intervals (vLLM's definitions).
    times = []
    for s in (a, b, c):
        assert s.first_scheduled_s is not None
        assert s.first_token_s is not None and s.last_token_s is not None
        times.append((s.arrival_s, s.first_scheduled_s, s.first_token_s, s.last_token_s))
    expected = {
        "vllm:request_queue_time_seconds": sum(sch - arr for arr, sch, _, _ in times),
        "vllm:request_prefill_time_seconds": sum(first - sch for _, sch, first, _ in times),
        "vllm:request_decode_time_seconds": sum(last - first for _, _, first, last in times),
        "vllm:request_inference_time_seconds": sum(last - sch for _, sch, _, last in times),
    }
    for name, value in expected.items():
        assert _hist_sum(registry, name) == pytest.approx(value), name
    # B's queue time covers A's whole run: at least the modelled time of A's steps.
    assert b.first_scheduled_s - b.arrival_s >= a_steps - 1e-9


async def test_request_aborted_while_queued_counts_only_queue_time() -> None:
    engine, registry, metrics = _one_at_a_time()
    runtime = EngineRuntime(engine, time_scale=SCALE, observer=metrics)
    runtime.start()
    try:
        first = runtime.submit(EngineRequest("A", tuple(range(100)), 50))
        queued = runtime.submit(EngineRequest("B", tuple(range(500, 600)), 5))
        await first.next_batch()
        runtime.abort("B")
        assert queued.first_scheduled_s is None
        assert not engine.request_ids_waiting()
    finally:
        await runtime.stop()
    labels = {"model_name": "m", "engine": "0"}
    # A (stopped after its first token) and B both queued; only A was ever prefilled.
    assert registry.get_sample_value("vllm:request_queue_time_seconds_count", labels) == 2
    assert registry.get_sample_value("vllm:request_prefill_time_seconds_count", labels) == 1
    assert registry.get_sample_value("vllm:request_inference_time_seconds_count", labels) == 1
