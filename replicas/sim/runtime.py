"""The real-time driver: runs the wall-clock-free engine at the pace of the modelled GPU.

One asyncio task owns the engine loop::

    step = engine.step()                   # decides and computes; returns the modelled duration
    deadline += step.duration_s * scale    # one monotonic schedule: sleep overshoot never adds up
    sleep until deadline
    deliver each request's new tokens      # tokens exist at the END of the step, as on a GPU

With no unfinished request the task waits on an `asyncio.Event` (no polling) and the schedule
restarts from "now" when work arrives. If the loop falls behind (the event loop was busy for longer
than the modelled steps), the next steps run without sleeping until the schedule is met again; a lag
of more than `max_catch_up_s` is forgiven rather than compressing many steps into a burst.

The server talks to the runtime only through `submit`, `finish` and `abort`, and reads tokens from
the returned `RequestStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import CostModel, profile_with_overrides
from replicas.sim.engine import Engine, EngineRequest, StepResult
from replicas.sim.settings import MODEL_CONTEXT_TOKENS, SimSettings

__all__ = [
    "EngineRuntime",
    "RequestStream",
    "RuntimeObserver",
    "StepTiming",
    "TokenBatch",
    "build_engine",
    "resolve_max_model_len",
]

log = logging.getLogger(__name__)

_EARLY_TOLERANCE_S = 50e-6


def build_engine(
    settings: SimSettings,
    kv_event_sink: Callable[..., None] | None = None,
    output_vocab: Sequence[int] | None = None,
) -> Engine:
    """The engine described by `settings`; unset limits come from the GPU profile.

    ``output_vocab``: the token ids generated text is drawn from (a real tokenizer's
    `output_ids`); ``None``: the simulator's own table."""
    profile = profile_with_overrides(settings.profile, **dict(settings.profile_overrides))
    overrides: dict[str, object] = {
        "block_size": settings.block_size,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "scheduling": settings.scheduling,
        "hash_seed": settings.seed,
    }
    if settings.num_gpu_blocks is not None:
        overrides["num_gpu_blocks"] = settings.num_gpu_blocks
    if settings.max_num_seqs is not None:
        overrides["max_num_seqs"] = settings.max_num_seqs
    if settings.max_num_batched_tokens is not None:
        overrides["max_num_batched_tokens"] = settings.max_num_batched_tokens
    config = EngineConfig.for_profile(profile, **overrides)
    return Engine(
        config, CostModel(profile), kv_event_sink=kv_event_sink, output_vocab=output_vocab
    )


def resolve_max_model_len(settings: SimSettings, config: EngineConfig) -> int:
    """`--max-model-len`, else the model's context capped by what the KV cache can hold."""
    if settings.max_model_len is not None:
        return settings.max_model_len
    return min(MODEL_CONTEXT_TOKENS, config.capacity_tokens)


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Tokens one request received at the end of one step."""

    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


class RequestStream:
    """One submitted request as the server sees it: a queue of `TokenBatch` plus timestamps
    (event-loop clock, seconds) that the metrics need."""

    __slots__ = (
        "_queue",
        "arrival_s",
        "finish_reason",
        "finished",
        "first_scheduled_s",
        "first_token_s",
        "last_token_s",
        "num_cached_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "request_id",
    )

    def __init__(self, request_id: str, num_prompt_tokens: int, arrival_s: float) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.arrival_s = arrival_s
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.finished = False
        self.finish_reason: str | None = None
        self._queue: asyncio.Queue[TokenBatch] = asyncio.Queue()

    async def next_batch(self) -> TokenBatch:
        """The next tokens (waits for the step that produces them)."""
        return await self._queue.get()

    def _push(self, batch: TokenBatch) -> None:
        self._queue.put_nowait(batch)


class RuntimeObserver(Protocol):
    """Receives what the metrics need; called on the event loop, must not block."""

    def on_step(self, result: StepResult) -> None: ...

    def on_tokens(
        self, stream: RequestStream, num_new: int, now_s: float, prev_s: float | None
    ) -> None: ...

    def on_finished(self, stream: RequestStream, now_s: float) -> None: ...


class StepTiming:
    """How faithfully wall-clock steps follow the modelled ones (for benchmarks and logs).

    Per busy step: the modelled (scaled) duration and the wall interval since the previous
    delivery, kept for the last `window` steps, plus totals since start.
    """

    __slots__ = ("intervals", "max_lag_s", "num_steps", "total_modelled_s", "total_wall_s")

    def __init__(self, window: int = 8192) -> None:
        self.intervals: deque[tuple[float, float]] = deque(maxlen=window)
        self.num_steps = 0
        self.total_modelled_s = 0.0
        self.total_wall_s = 0.0
        self.max_lag_s = 0.0

    def record(self, modelled_s: float, wall_s: float, lag_s: float) -> None:
        self.intervals.append((modelled_s, wall_s))
        self.num_steps += 1
        self.total_modelled_s += modelled_s
        self.total_wall_s += wall_s
        self.max_lag_s = max(self.max_lag_s, lag_s)

    def reset(self) -> None:
        self.intervals.clear()
        self.num_steps = 0
        self.total_modelled_s = self.total_wall_s = self.max_lag_s = 0.0


class EngineRuntime:
    """Owns the engine loop task; start with `start()`, stop with `await stop()`."""

    def __init__(
        self,
        engine: Engine,
        *,
        time_scale: float,
        observer: RuntimeObserver | None = None,
        after_step: Callable[[], None] | None = None,
        max_catch_up_s: float = 0.25,
    ) -> None:
        self.engine = engine
        self.time_scale = time_scale
        self.timing = StepTiming()
        self._observer = observer
        self._after_step = after_step
        self._max_catch_up_s = max_catch_up_s
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Cancel the loop and end every open stream with finish reason "abort"."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for request_id in list(self._streams):
            self.abort(request_id)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ requests

    def submit(self, request: EngineRequest) -> RequestStream:
        """Queue a request in the engine; `ValueError` if it can never fit."""
        if request.request_id in self._streams:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.engine.add_request(request)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request.request_id, len(request.prompt_token_ids), loop.time())
        self._streams[request.request_id] = stream
        self._wake.set()
        return stream

    def finish(self, request_id: str, reason: str) -> None:
        """End a request early (a stop string matched, the client left): frees its KV blocks."""
        stream = self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)
        if stream is None or stream.finished:
            return
        stream.finished = True
        stream.finish_reason = reason
        stream._push(TokenBatch((), True, reason))
        if self._observer is not None:
            self._observer.on_finished(stream, asyncio.get_running_loop().time())
        if self._after_step is not None:  # freed blocks may have produced KV events
            self._after_step()

    def abort(self, request_id: str) -> None:
        """The client went away: finish reason "abort", as vLLM counts it."""
        self.finish(request_id, "abort")

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        deadline = loop.time()
        last_delivery: float | None = None
        while True:
            if not engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                last_delivery = None
                continue
            step_start = deadline
            result = engine.step()
            if result.scheduled:
                self._mark_scheduled(result.scheduled, step_start)
            modelled_s = result.duration_s * self.time_scale
            deadline += modelled_s
            now = loop.time()
            if deadline > now:
                await asyncio.sleep(deadline - now)
                # Event-loop timers have ~1 ms granularity and may fire early; sleep out the
                # rest (other tasks run meanwhile) so tokens never leave before their time.
                while (left := deadline - loop.time()) > _EARLY_TOLERANCE_S:  # noqa: ASYNC110
                    await asyncio.sleep(left)
            else:
                if now - deadline > self._max_catch_up_s:
                    log.warning("engine loop %.3fs behind schedule; resetting", now - deadline)
                    deadline = now
                await asyncio.sleep(0)  # let handlers run even when we are behind
            now = loop.time()
            if last_delivery is not None:
                self.timing.record(modelled_s, now - last_delivery, max(0.0, now - deadline))
            last_delivery = now
            self._deliver(result, now)

    def _mark_scheduled(self, request_ids: tuple[str, ...], step_start: float) -> None:
        # vLLM's SCHEDULED event: the step that first admits a request starts its prefill. When
        # the loop runs late, a request may have arrived after its step's modelled start; its
        # queue time is then zero rather than negative.
        streams = self._streams
        for request_id in request_ids:
            stream = streams.get(request_id)
            if stream is not None:
                stream.first_scheduled_s = max(step_start, stream.arrival_s)

    def _deliver(self, result: StepResult, now: float) -> None:
        observer = self._observer
        streams = self._streams
        for out in result.outputs:
            stream = streams.get(out.request_id)
            if stream is None:  # aborted while the step was in flight
                continue
            new = len(out.new_token_ids)
            if new:
                prev = stream.last_token_s
                if stream.first_token_s is None:
                    stream.first_token_s = now
                    # the prefix-cache hit of the prefill that produced the first token
                    stream.num_cached_tokens = out.num_cached_tokens
                    stream.num_prompt_tokens = out.num_prompt_tokens
                stream.last_token_s = now
                stream.num_output_tokens += new
                if observer is not None:
                    observer.on_tokens(stream, new, now, prev)
            if out.finished:
                del streams[out.request_id]
                stream.finished = True
                stream.finish_reason = out.finish_reason
                stream._push(TokenBatch(out.new_token_ids, True, out.finish_reason))
                if observer is not None:
                    observer.on_finished(stream, now)
            elif new:
                stream._push(TokenBatch(out.new_token_ids, False, None))
        if observer is not None:
            observer.on_step(result)
        if self._after_step is not None:
            self._after_step()
