"""Load drivers: open loop (arrivals on a schedule) and closed loop (a fixed number of users).

* **Open loop** (``rate_per_s``): sessions start on a Poisson / gamma schedule
  (:mod:`loadtest.arrivals`), or all at once (``rate = inf``), or at a trace's own timestamps;
  an optional ``concurrency`` caps requests in flight (the rest wait in the client, as vLLM's
  ``--max-concurrency``).
* **Closed loop** (``concurrency`` alone): that many users, each sending its next request as soon
  as the previous one is answered.

A session's turns run one after another, the next one after the previous answer plus the turn's
think time.  A run is bounded by a number of requests and/or a duration (no request is *sent*
after the deadline; those in flight are awaited).  Warm-up requests run first, as a phase of
their own that is awaited in full; the measured phase then continues the same session stream.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

from loadtest.arrivals import interarrival_gaps
from loadtest.client import RequestRecord, StreamingClient
from loadtest.workloads import RequestSpec, Session, Workload

__all__ = ["DriverConfig", "RunResult", "run_load"]


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """How to send: which loop, how many, for how long."""

    num_requests: int | None = None  # measured requests (after warm-up)
    duration_s: float | None = None  # stop sending measured requests after this long
    rate_per_s: float | None = None  # open loop; math.inf = all at once
    burstiness: float = 1.0
    concurrency: int | None = None  # closed loop alone, or a cap on the open loop
    warmup_requests: int = 0
    seed: int = 0  # for the arrival schedule (the workload has its own seed)

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("bound the run: give num_requests and/or duration_s")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ValueError(f"rate must be > 0, got {self.rate_per_s}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup_requests}")

    @property
    def closed_loop(self) -> bool:
        return self.rate_per_s is None and self.concurrency is not None


@dataclass(slots=True)
class RunResult:
    """Measured records (warm-up excluded) and the measured window, ``perf_counter`` seconds."""

    records: list[RequestRecord]
    started_s: float
    finished_s: float
    config: DriverConfig
    warmup_records: list[RequestRecord] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return "closed" if self.config.closed_loop else "open"


class _Budget:
    """Hands out request slots until the count or the deadline runs out."""

    def __init__(self, count: int | None, deadline_s: float | None) -> None:
        self._left = count
        self._deadline_s = deadline_s

    def take(self) -> bool:
        if self._deadline_s is not None and time.perf_counter() >= self._deadline_s:
            return False
        if self._left is None:
            return True
        if self._left <= 0:
            return False
        self._left -= 1
        return True

    @property
    def exhausted(self) -> bool:
        return self._left is not None and self._left <= 0

    @property
    def deadline_s(self) -> float | None:
        return self._deadline_s


class _Phase:
    """One phase (warm-up or measured): sends sessions and collects their records."""

    def __init__(
        self,
        client: StreamingClient,
        targets: Iterator[str],
        budget: _Budget,
        *,
        warmup: bool,
        cap: asyncio.Semaphore | None,
        on_record: Callable[[RequestRecord], None] | None,
    ) -> None:
        self._client = client
        self._targets = targets
        self._budget = budget
        self._warmup = warmup
        self._cap = cap
        self._on_record = on_record
        self.records: list[RequestRecord] = []

    async def run_session(self, session: Session, first_taken: bool) -> None:
        """Send the session's turns in order; the first turn's slot may already be taken."""
        answers: list[str] = []
        for turn_index, turn in enumerate(session.turns):
            if turn_index > 0 or not first_taken:
                if turn_index > 0 and turn.think_time_s > 0:
                    await self._think(turn.think_time_s)
                if not self._budget.take():
                    return
            spec = session.request(turn_index, answers)
            record = await self._send(spec)
            if not record.ok:
                return  # a conversation cannot go on without its answer
            answers.append(record.text)

    async def _think(self, seconds: float) -> None:
        deadline = self._budget.deadline_s
        if deadline is not None:
            seconds = min(seconds, max(0.0, deadline - time.perf_counter()))
        await asyncio.sleep(seconds)

    async def _send(self, spec: RequestSpec) -> RequestRecord:
        target = next(self._targets)
        if self._cap is None:
            record = await self._client.send(target, spec, warmup=self._warmup)
        else:
            async with self._cap:
                record = await self._client.send(target, spec, warmup=self._warmup)
        self.records.append(record)
        if self._on_record is not None:
            self._on_record(record)
        return record


async def _open_loop(
    phase: _Phase,
    sessions: Iterator[Session],
    budget: _Budget,
    gaps: Iterator[float] | None,
    self_timed: bool,
) -> None:
    start = time.perf_counter()
    trace_origin: float | None = None
    next_at = 0.0
    async with asyncio.TaskGroup() as group:
        for session in sessions:
            if budget.exhausted:
                break
            if self_timed and session.at_s is not None:
                if trace_origin is None:
                    trace_origin = session.at_s
                next_at = session.at_s - trace_origin
            delay = start + next_at - time.perf_counter()
            deadline = budget.deadline_s
            if deadline is not None and start + next_at >= deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            if not budget.take():
                break
            group.create_task(phase.run_session(session, first_taken=True))
            if gaps is not None:
                next_at += next(gaps)
            await asyncio.sleep(0)  # let the request start before scheduling the next


async def _closed_loop(
    phase: _Phase, sessions: Iterator[Session], budget: _Budget, users: int
) -> None:
    async def user() -> None:
        for session in sessions:  # one shared iterator: users take the next session in turn
            if not budget.take():
                return
            await phase.run_session(session, first_taken=True)

    async with asyncio.TaskGroup() as group:
        for _ in range(users):
            group.create_task(user())


async def _run_phase(
    client: StreamingClient,
    targets: Iterator[str],
    sessions: Iterator[Session],
    workload: Workload,
    config: DriverConfig,
    budget: _Budget,
    *,
    warmup: bool,
    on_record: Callable[[RequestRecord], None] | None,
) -> list[RequestRecord]:
    closed = config.closed_loop
    cap = None if closed or config.concurrency is None else asyncio.Semaphore(config.concurrency)
    phase = _Phase(client, targets, budget, warmup=warmup, cap=cap, on_record=on_record)
    if closed:
        assert config.concurrency is not None
        await _closed_loop(phase, sessions, budget, config.concurrency)
        return phase.records
    rate = config.rate_per_s
    self_timed = workload.self_timed and rate is None
    if rate is None:
        # No rate given: a trace keeps its own timestamps; other workloads go all at once.
        rate = math.inf
    gaps = (
        None
        if self_timed
        else interarrival_gaps(rate, config.burstiness, random.Random(config.seed))
    )
    await _open_loop(phase, sessions, budget, gaps, self_timed)
    return phase.records


async def run_load(
    client: StreamingClient,
    targets: Sequence[str],
    workload: Workload,
    config: DriverConfig,
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
    before_measure: Callable[[], Awaitable[None]] | None = None,
) -> RunResult:
    """Warm up, call ``before_measure`` (e.g. snapshot the replicas' metrics), then measure.

    ``targets`` are base URLs used in turn (one URL: a router or a replica; several: a plain
    client-side round robin).
    """
    if not targets:
        raise ValueError("no target URL")
    target_cycle = itertools.cycle(targets)
    sessions = workload.sessions()
    warmup_records: list[RequestRecord] = []
    if config.warmup_requests:
        warm_budget = _Budget(config.warmup_requests, None)
        warmup_records = await _run_phase(
            client,
            target_cycle,
            sessions,
            workload,
            config,
            warm_budget,
            warmup=True,
            on_record=on_record,
        )
    if before_measure is not None:
        await before_measure()
    started = time.perf_counter()
    deadline = None if config.duration_s is None else started + config.duration_s
    budget = _Budget(config.num_requests, deadline)
    records = await _run_phase(
        client, target_cycle, sessions, workload, config, budget, warmup=False, on_record=on_record
    )
    return RunResult(
        records=records,
        started_s=started,
        finished_s=time.perf_counter(),
        config=config,
        warmup_records=warmup_records,
    )
