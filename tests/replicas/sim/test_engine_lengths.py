"""Output lengths drawn for requests without ignore_eos: reproducible and clamped."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replicas.sim.lengths import OutputLengthDistribution, draw_output_length

DISTS = [
    OutputLengthDistribution(),
    OutputLengthDistribution("uniform", low=3, high=40),
    OutputLengthDistribution("fixed", mean=17),
]


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: d.kind)
@given(
    seed=st.integers(0, 2**32),
    key=st.text(max_size=20),
    max_tokens=st.integers(1, 2000),
    min_tokens=st.integers(0, 50),
)
def test_reproducible_and_within_bounds(
    dist: OutputLengthDistribution, seed: int, key: str, max_tokens: int, min_tokens: int
) -> None:
    if min_tokens > max_tokens:
        with pytest.raises(ValueError, match="min_tokens"):
            draw_output_length(dist, seed, key, max_tokens, min_tokens)
        return
    n = draw_output_length(dist, seed, key, max_tokens, min_tokens)
    assert max(1, min_tokens) <= n <= max_tokens
    assert n == draw_output_length(dist, seed, key, max_tokens, min_tokens)


def test_exponential_has_the_configured_mean_and_depends_on_seed_and_key() -> None:
    dist = OutputLengthDistribution("exponential", mean=128)
    draws = [draw_output_length(dist, 7, f"r{i}", 100_000) for i in range(4000)]
    assert statistics.mean(draws) == pytest.approx(128, rel=0.06)
    assert draws != [draw_output_length(dist, 8, f"r{i}", 100_000) for i in range(4000)]
    assert len(set(draws[:50])) > 20


def test_uniform_and_fixed() -> None:
    uniform = OutputLengthDistribution("uniform", low=3, high=5)
    assert {draw_output_length(uniform, 0, str(i), 100) for i in range(200)} == {3, 4, 5}
    assert draw_output_length(OutputLengthDistribution("fixed", mean=17), 0, "x", 100) == 17
    assert draw_output_length(OutputLengthDistribution("fixed", mean=17), 0, "x", 10) == 10


def test_invalid_distributions_are_rejected() -> None:
    with pytest.raises(ValueError):
        OutputLengthDistribution("normal")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        OutputLengthDistribution(mean=0)
    with pytest.raises(ValueError):
        OutputLengthDistribution("uniform", low=5, high=2)
    with pytest.raises(ValueError, match="max_tokens"):
        draw_output_length(OutputLengthDistribution(), 0, "x", 0)
