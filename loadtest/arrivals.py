"""Arrival processes for open-loop load: Poisson, or gamma-distributed gaps with a burstiness.

As in vLLM's bench serve, inter-arrival gaps follow a gamma distribution with shape ``k`` (the
burstiness) and scale ``1 / (rate * k)``, so the mean gap is always ``1 / rate``.  ``k = 1`` is a
Poisson process; ``k < 1`` is burstier (gaps cluster), ``k > 1`` smoother; ``k = inf`` is a fixed
interval.  Pure functions over a seeded ``random.Random``: the same seed gives the same schedule.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

__all__ = ["arrival_offsets", "interarrival_gaps"]


def interarrival_gaps(rate_per_s: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Endless gaps (seconds) between consecutive arrivals; ``rate_per_s = inf`` gives zeros."""
    if not rate_per_s > 0:
        raise ValueError(f"rate must be > 0, got {rate_per_s}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate_per_s):
        while True:
            yield 0.0
    if math.isinf(burstiness):
        while True:
            yield 1.0 / rate_per_s
    scale = 1.0 / (rate_per_s * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def arrival_offsets(
    count: int, rate_per_s: float, burstiness: float, rng: random.Random
) -> list[float]:
    """Send times (seconds from the start) of ``count`` arrivals; the first one is at 0."""
    offsets: list[float] = []
    now = 0.0
    gaps = interarrival_gaps(rate_per_s, burstiness, rng)
    for i in range(count):
        if i:
            now += next(gaps)
        offsets.append(now)
    return offsets
