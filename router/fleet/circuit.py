"""A small circuit breaker per replica (passive ejection on consecutive failures).

Closed: requests flow; `failure_threshold` consecutive failures (connect errors, timeouts, 5xx —
never 4xx, which are the client's fault) open it.  Open: no requests for `open_s`, then it turns
half-open lazily.  Half-open: up to `half_open_trials` concurrent trial requests; one success
closes it, one failure opens it again.  Time comes from an injected clock so tests need no sleep.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

__all__ = ["CircuitBreaker", "CircuitState"]


class CircuitState(enum.IntEnum):
    """Values are the `fleet_router_circuit_state` gauge's."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Consecutive-failure circuit breaker with half-open trials."""

    __slots__ = (
        "_clock",
        "_failures",
        "_opened_at",
        "_state",
        "_trials",
        "failure_threshold",
        "half_open_trials",
        "open_s",
    )

    def __init__(
        self,
        failure_threshold: int = 5,
        open_s: float = 5.0,
        half_open_trials: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.half_open_trials = half_open_trials
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trials = 0

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self.open_s:
            self._state = CircuitState.HALF_OPEN
            self._trials = 0
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def allows_request(self) -> bool:
        """Whether a new request may be sent now (closed, or a half-open trial slot is free)."""
        state = self.state
        if state is CircuitState.CLOSED:
            return True
        return state is CircuitState.HALF_OPEN and self._trials < self.half_open_trials

    def on_attempt(self) -> bool:
        """Note that a request is being sent; returns True when it is a half-open trial."""
        if self._state is CircuitState.CLOSED:  # the usual case, without the clock
            return False
        if self.state is CircuitState.HALF_OPEN:
            self._trials += 1
            return True
        return False

    def release_trial(self) -> None:
        """A trial ended without a verdict (e.g. the client went away): free its slot."""
        if self._state is CircuitState.HALF_OPEN and self._trials > 0:
            self._trials -= 1

    def record_success(self) -> None:
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._trials = 0

    def record_failure(self) -> None:
        self._failures += 1
        state = self.state
        if state is CircuitState.HALF_OPEN or (
            state is CircuitState.CLOSED and self._failures >= self.failure_threshold
        ):
            self._state = CircuitState.OPEN
            self._opened_at = self._clock()
            self._trials = 0

    def trip(self) -> None:
        """Open the circuit now (e.g. the replica's process is known to be gone)."""
        self._state = CircuitState.OPEN
        self._opened_at = self._clock()
        self._trials = 0
