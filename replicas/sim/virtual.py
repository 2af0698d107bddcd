"""Virtual-time driver: runs an `Engine` against timed arrivals without sleeping.

Time advances by each step's modelled duration; when the engine is idle it jumps to the next
arrival. Per-token times are not stored per token: a decoding request produces one token per
decode step, so its token times are a slice of the shared list of decode-step end times.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from replicas.sim.engine import Engine, EngineRequest

__all__ = ["RequestTiming", "VirtualRun", "percentile", "run_virtual"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated like numpy's default."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class RequestTiming:
    """Timeline of one request in virtual seconds."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    # ("t", time) for a token produced by a prefill; ("d", first, end) for decode steps
    # first..end-1, indices into the run's decode-step end times.
    _parts: list[tuple[str, float, int]] = field(default_factory=list, repr=False)
    _open: int = field(default=-1, repr=False)
    _decode_times: list[float] = field(default_factory=list, repr=False)

    @property
    def ttft_s(self) -> float:
        if self.first_token_s is None:
            raise ValueError(f"request {self.request_id} produced no token")
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        if self.finish_s is None:
            raise ValueError(f"request {self.request_id} did not finish")
        return self.finish_s - self.arrival_s

    @property
    def token_times(self) -> list[float]:
        """The virtual time of every generated token, in order."""
        out: list[float] = []
        for kind, a, b in self._parts:
            if kind == "t":
                out.append(a)
            else:
                out.extend(self._decode_times[int(a) : b])
        return out

    def itls(self) -> list[float]:
        """Gaps between consecutive tokens."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float:
        """(E2E - TTFT) / (output - 1), vLLM bench's definition (0 for one-token outputs)."""
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass
class VirtualRun:
    """Result of `run_virtual`: per-request timings and run-wide aggregates."""

    requests: dict[str, RequestTiming]
    start_s: float
    end_s: float
    num_steps: int
    prefill_tokens_computed: int  # includes recomputation after preemptions
    decode_tokens_computed: int
    wall_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests.values())

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests.values())

    @property
    def output_throughput_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_throughput_tok_s(self) -> float:
        total = self.prompt_tokens + self.output_tokens
        return total / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def simulated_tokens_per_wall_s(self) -> float:
        """Prompt + output tokens of the run per second of real time spent simulating it."""
        return (self.prompt_tokens + self.output_tokens) / max(self.wall_s, 1e-9)

    def ttfts(self) -> list[float]:
        return [r.ttft_s for r in self.requests.values()]

    def e2es(self) -> list[float]:
        return [r.e2e_s for r in self.requests.values()]

    def itls(self, request_ids: Iterable[str] | None = None) -> list[float]:
        """Inter-token latencies of all (or the given) requests, pooled."""
        chosen = (
            self.requests.values()
            if request_ids is None
            else (self.requests[i] for i in request_ids)
        )
        out: list[float] = []
        for r in chosen:
            out.extend(r.itls())
        return out


def run_virtual(
    engine: Engine,
    arrivals: Sequence[tuple[float, EngineRequest]],
    *,
    max_steps: int | None = None,
) -> VirtualRun:
    """Run ``arrivals`` (time in seconds, request) to completion in virtual time."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    timings: dict[str, RequestTiming] = {}
    decode_times: list[float] = []
    start = arrivals[order[0]][0] if order else 0.0
    now = start
    steps = 0
    prefill_tokens = 0
    decode_tokens = 0
    nxt = 0
    n = len(order)
    wall0 = time.perf_counter()
    while nxt < n or engine.has_unfinished():
        while nxt < n and arrivals[order[nxt]][0] <= now:
            t_arr, request = arrivals[order[nxt]]
            engine.add_request(request)
            timings[request.request_id] = RequestTiming(
                request.request_id,
                t_arr,
                len(request.prompt_token_ids),
                _decode_times=decode_times,
            )
            nxt += 1
        if not engine.has_unfinished():
            now = arrivals[order[nxt]][0]
            continue
        s = engine.step_summary()
        steps += 1
        if max_steps is not None and steps > max_steps:
            raise RuntimeError(f"run_virtual: no completion after {max_steps} steps")
        if s.duration_s == 0.0 and not s.preempted:
            # Nothing could be scheduled: only arrivals can change that.
            if nxt >= n:
                raise RuntimeError("engine is stuck: unfinished requests but nothing to run")
            now = max(now, arrivals[order[nxt]][0])
            continue
        now += s.duration_s
        prefill_tokens += s.num_prefill_tokens
        decode_tokens += s.num_decode_tokens
        if s.decoded:
            decode_times.append(now)
        d_after = engine.decode_steps
        for req in s.preempted:
            t = timings[req.request_id]
            t.num_preemptions += 1
            if t._open >= 0:
                t._parts.append(("d", t._open, s.decode_steps_before))
                t._open = -1
        for req in s.first_tokens:
            t = timings[req.request_id]
            if t.first_token_s is None:
                t.first_token_s = now
                t.num_cached_tokens = req.num_cached_tokens
            t._parts.append(("t", now, 0))
            t._open = d_after
        for req in s.finished:
            t = timings[req.request_id]
            t.finish_s = now
            t.num_output_tokens = req.num_generated
            if t._open >= 0:
                t._parts.append(("d", t._open, d_after))
                t._open = -1
    return VirtualRun(
        requests=timings,
        start_s=start,
        end_s=now,
        num_steps=steps,
        prefill_tokens_computed=prefill_tokens,
        decode_tokens_computed=decode_tokens,
        wall_s=time.perf_counter() - wall0,
    )
