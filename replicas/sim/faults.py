"""Fault injection for tests of the router's failure handling.

Applies to generation requests (/v1/completions, /v1/chat/completions), counted in arrival order
from 1:

- ``failure_rate``: request ``i`` fails with a 500 OpenAI-style error when a hash of
  ``(seed, i)`` falls below the rate, so a run with the same seed fails the same requests.
- ``stall_before_first_byte_s``: every request waits this long before anything is sent (and
  before it reaches the engine), like a replica stuck in a GC pause or a slow network.
- ``crash_after_requests``: requests 1..N are served; when request N+1 arrives the replica "dies":
  it stops listening and every open connection is reset, in-flight streams included, as when the
  process is killed.

The decision for a request is a pure function (`decide`); `FaultInjector` only counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

__all__ = ["FaultDecision", "FaultInjector", "decide"]


@dataclass(frozen=True, slots=True)
class FaultDecision:
    crash: bool = False
    fail: bool = False
    stall_s: float = 0.0


NO_FAULT = FaultDecision()


def decide(
    index: int,
    *,
    seed: int,
    failure_rate: float,
    stall_before_first_byte_s: float,
    crash_after_requests: int | None,
) -> FaultDecision:
    """What happens to the `index`-th (1-based) generation request."""
    if crash_after_requests is not None and index > crash_after_requests:
        return FaultDecision(crash=True)
    fail = False
    if failure_rate > 0.0:
        draw = xxhash.xxh64_intdigest(f"{seed}:{index}".encode()) / 2.0**64
        fail = draw < failure_rate
    if not fail and stall_before_first_byte_s == 0.0:
        return NO_FAULT
    return FaultDecision(fail=fail, stall_s=stall_before_first_byte_s)


class FaultInjector:
    """Counts generation requests and applies `decide` to each."""

    def __init__(
        self,
        *,
        seed: int = 0,
        failure_rate: float = 0.0,
        stall_before_first_byte_s: float = 0.0,
        crash_after_requests: int | None = None,
    ) -> None:
        self._seed = seed
        self._failure_rate = failure_rate
        self._stall_s = stall_before_first_byte_s
        self._crash_after = crash_after_requests
        self.num_requests = 0

    @property
    def enabled(self) -> bool:
        return self._failure_rate > 0 or self._stall_s > 0 or self._crash_after is not None

    def next_request(self) -> FaultDecision:
        self.num_requests += 1
        if not self.enabled:
            return NO_FAULT
        return decide(
            self.num_requests,
            seed=self._seed,
            failure_rate=self._failure_rate,
            stall_before_first_byte_s=self._stall_s,
            crash_after_requests=self._crash_after,
        )
