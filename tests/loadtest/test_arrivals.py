"""Arrival schedules: Poisson mean rate, gamma burstiness, determinism, bounded samples."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from loadtest.arrivals import arrival_offsets, interarrival_gaps

N = 4000


def gaps(rate: float, k: float, seed: int = 0) -> list[float]:
    return list(itertools.islice(interarrival_gaps(rate, k, random.Random(seed)), N))


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.mean(values)


def test_poisson_mean_rate_and_unit_cv() -> None:
    sample = gaps(10.0, 1.0)
    assert 1 / statistics.mean(sample) == pytest.approx(10.0, rel=0.06)
    assert cv(sample) == pytest.approx(1.0, abs=0.08)  # exponential gaps
    assert min(sample) >= 0


@pytest.mark.parametrize("k", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_changes_the_spread(k: float) -> None:
    sample = gaps(5.0, k, seed=1)
    assert 1 / statistics.mean(sample) == pytest.approx(5.0, rel=0.08)
    assert cv(sample) == pytest.approx(1 / math.sqrt(k), rel=0.12)


def test_burstier_means_more_clustered() -> None:
    assert cv(gaps(5.0, 0.25)) > cv(gaps(5.0, 1.0)) > cv(gaps(5.0, 4.0))


def test_offsets_start_at_zero_grow_and_repeat_with_the_seed() -> None:
    a = arrival_offsets(100, 20.0, 1.0, random.Random(9))
    assert a[0] == 0.0 and a == sorted(a)
    assert a == arrival_offsets(100, 20.0, 1.0, random.Random(9))
    assert a != arrival_offsets(100, 20.0, 1.0, random.Random(10))
    assert 99 / a[-1] == pytest.approx(20.0, rel=0.3)


def test_infinite_rate_and_infinite_burstiness() -> None:
    assert arrival_offsets(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5
    assert arrival_offsets(3, 4.0, math.inf, random.Random(0)) == [0.0, 0.25, 0.5]


@pytest.mark.parametrize(("rate", "k"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_parameters(rate: float, k: float) -> None:
    with pytest.raises(ValueError):
        next(interarrival_gaps(rate, k, random.Random(0)))
