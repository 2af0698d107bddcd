"""Output lengths for requests that do not ask for a fixed length (no ``ignore_eos``).

A real model stops at its end-of-sequence token; the simulator draws that length instead,
reproducibly from ``(seed, request_key)``, so the same request gets the same answer length.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

__all__ = ["OutputLengthDistribution", "draw_output_length"]


@dataclass(frozen=True)
class OutputLengthDistribution:
    """``exponential`` with ``mean``; ``uniform`` integers in ``[low, high]``; ``fixed`` = mean."""

    kind: Literal["exponential", "uniform", "fixed"] = "exponential"
    mean: float = 128
    low: int = 1
    high: int = 256

    def __post_init__(self) -> None:
        if self.kind not in ("exponential", "uniform", "fixed"):
            raise ValueError(f"unknown output length distribution {self.kind!r}")
        if not (self.mean > 0 and math.isfinite(self.mean)):
            raise ValueError(f"mean must be a positive number, got {self.mean!r}")
        if self.kind == "uniform" and not 1 <= self.low <= self.high:
            raise ValueError(f"uniform needs 1 <= low <= high, got [{self.low}, {self.high}]")


def draw_output_length(
    dist: OutputLengthDistribution,
    seed: int,
    request_key: str,
    max_tokens: int,
    min_tokens: int = 0,
) -> int:
    """A reproducible length in ``[max(1, min_tokens), max_tokens]``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    floor = max(1, min_tokens)
    if floor > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")
    # A str seed is hashed with SHA-512 by `random`, so it is stable across processes.
    rng = random.Random(f"{seed}:{request_key}")
    if dist.kind == "exponential":
        drawn = round(rng.expovariate(1.0 / dist.mean))
    elif dist.kind == "uniform":
        drawn = rng.randint(dist.low, dist.high)
    else:
        drawn = round(dist.mean)
    return min(max_tokens, max(floor, drawn))
