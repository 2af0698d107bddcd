"""router.metrics' lock-free LoopHistogram and LoopCounter against prometheus_client's own."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.metrics import LATENCY_BUCKETS_S, LoopCounter, LoopHistogram


def _exposition(registry: CollectorRegistry) -> list[str]:
    # Sample lines only; prometheus_client's Histogram and Counter add `_created`, ours do not.
    return sorted(
        line
        for line in generate_latest(registry).decode().splitlines()
        if line and not line.startswith("#") and "_created" not in line
    )


@settings(max_examples=50, deadline=None)
@given(
    observations=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            # Values on the bounds themselves (`le` is inclusive), between and beyond them.
            st.one_of(
                st.sampled_from(LATENCY_BUCKETS_S),
                st.floats(min_value=0, max_value=1000, allow_nan=False, allow_infinity=False),
            ),
        ),
        max_size=60,
    )
)
def test_same_exposition_as_prometheus_client(observations: list[tuple[str, float]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h_seconds", "doc", ["model"], buckets=LATENCY_BUCKETS_S,
                          registry=theirs)  # fmt: skip
    fast = LoopHistogram("h_seconds", "doc", ["model"], buckets=LATENCY_BUCKETS_S, registry=ours)
    for model, value in observations:
        reference.labels(model).observe(value)
        fast.labels(model).observe(value)
    assert _exposition(ours) == _exposition(theirs)


def test_labels_are_checked_and_names_stay_unique() -> None:
    registry = CollectorRegistry()
    histogram = LoopHistogram("x_seconds", "doc", ["a", "b"], buckets=(1.0,), registry=registry)
    with pytest.raises(ValueError, match="expected labels"):
        histogram.labels("only-one")
    assert histogram.labels("1", "2") is histogram.labels("1", "2")
    # The registry knows its names: a second metric of the same name is refused.
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram("x_seconds", "doc", registry=registry)


@settings(max_examples=50, deadline=None)
@given(
    increments=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.sampled_from(["200", "404"]),
            st.one_of(st.just(1.0), st.floats(min_value=0, max_value=1e6, allow_nan=False)),
        ),
        max_size=60,
    )
)
def test_counter_same_exposition_as_prometheus_client(
    increments: list[tuple[str, str, float]],
) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Counter("c", "doc", ["model", "status"], registry=theirs)
    fast = LoopCounter("c", "doc", ["model", "status"], registry=ours)
    for i, (model, status, amount) in enumerate(increments):
        reference.labels(model, status).inc(amount)
        # Both ways of naming the labels reach the same child.
        child = fast.labels(model, status) if i % 2 else fast.labels(status=status, model=model)
        child.inc(amount)
    assert _exposition(ours) == _exposition(theirs)


def test_counter_labels_are_checked_and_it_only_goes_up() -> None:
    counter = LoopCounter("requests_total", "doc", ["a", "b"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels("only-one")
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels(a="1", c="2")
    assert counter.labels("1", "2") is counter.labels(a="1", b="2")
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("1", "2").inc(-1)
