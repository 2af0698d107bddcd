"""Small objects for the proxy's retry and timeout settings (as redis-py's backoff/retry)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["ExponentialBackoff", "RetryPolicy", "Timeouts"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Per-attempt upstream timeouts, in seconds."""

    connect_s: float = 2.0
    first_byte_s: float = 300.0  # request sent → first body byte (a non-streamed answer: all)
    idle_s: float = 60.0  # between two body chunks
    total_s: float = 900.0  # whole attempt


class ExponentialBackoff:
    """Full-jitter exponential backoff: uniform(0, min(cap, base · 2^failures)).

    Full jitter spreads retries of many clients that failed at once (AWS architecture blog,
    "Exponential Backoff And Jitter"); the generator is private and seedable.
    """

    __slots__ = ("_rng", "base_s", "cap_s")

    def __init__(self, base_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._rng = rng or random.Random()

    def compute(self, failures: int) -> float:
        """Seconds to wait before the attempt that follows `failures` failed ones (≥ 1)."""
        ceiling = min(self.cap_s, self.base_s * (2 ** max(0, failures - 1)))
        return self._rng.uniform(0.0, ceiling) if ceiling > 0 else 0.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry failed attempts on other replicas, only before the first byte reached the client."""

    max_retries: int = 2
    backoff: ExponentialBackoff = field(default_factory=lambda: ExponentialBackoff(0.005, 0.25))

    @staticmethod
    def retryable_status(status: int) -> bool:
        """5xx (replica failing) and 429 (replica saturated) are worth another replica."""
        return status >= 500 or status == 429
