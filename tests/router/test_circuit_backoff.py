"""Circuit breaker and backoff objects, on a fake clock."""

from __future__ import annotations

import random

from router.fleet.circuit import CircuitBreaker, CircuitState
from router.proxy.retry import ExponentialBackoff, RetryPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=3, open_s=10, clock=clock)
    cb.record_failure()
    cb.record_failure()
    cb.record_success()  # resets: failures must be consecutive
    cb.record_failure()
    cb.record_failure()
    assert cb.state is CircuitState.CLOSED and cb.allows_request()
    cb.record_failure()
    assert cb.state is CircuitState.OPEN and not cb.allows_request()


def test_half_open_after_cooldown_then_one_trial() -> None:
    clock = Clock()
    cb = CircuitBreaker(failure_threshold=1, open_s=5, half_open_trials=1, clock=clock)
    cb.record_failure()
    clock.now += 4.9
    assert cb.state is CircuitState.OPEN
    clock.now += 0.2
    assert cb.state is CircuitState.HALF_OPEN and cb.allows_request()
    assert cb.on_attempt() is True
    assert not cb.allows_request()  # the one trial slot is taken
    cb.release_trial()  # trial ended without verdict (client left)
    assert cb.allows_request()
    cb.on_attempt()
    cb.record_failure()  # a failed trial reopens at once
    assert cb.state is CircuitState.OPEN
    clock.now += 5
    cb.on_attempt()
    cb.record_success()
    assert cb.state is CircuitState.CLOSED and cb.consecutive_failures == 0
    assert cb.on_attempt() is False  # closed: not a trial


def test_trip_opens_now() -> None:
    cb = CircuitBreaker(failure_threshold=5, clock=Clock())
    cb.trip()
    assert cb.state is CircuitState.OPEN


def test_backoff_is_bounded_full_jitter_and_seeded() -> None:
    a = ExponentialBackoff(0.01, 0.05, random.Random(1))
    b = ExponentialBackoff(0.01, 0.05, random.Random(1))
    seq = [a.compute(n) for n in range(1, 8)]
    assert seq == [b.compute(n) for n in range(1, 8)]
    for n, delay in enumerate(seq, start=1):
        assert 0 <= delay <= min(0.05, 0.01 * 2 ** (n - 1))
    assert ExponentialBackoff(0, 0).compute(3) == 0.0


def test_retryable_statuses() -> None:
    assert RetryPolicy.retryable_status(500) and RetryPolicy.retryable_status(503)
    assert RetryPolicy.retryable_status(429)
    assert not any(RetryPolicy.retryable_status(s) for s in (200, 400, 401, 404, 413, 422))
