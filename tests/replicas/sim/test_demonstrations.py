"""The three demonstrations (batching, chunked prefill, prefix reuse), at the stated sizes, in
virtual time."""

from __future__ import annotations

import pytest

from replicas.sim.demonstrations import (
    BATCHING_CAPS,
    batching_comparison,
    chunked_prefill_comparison,
    prefix_reuse,
)


def test_continuous_beats_static_and_the_gain_grows_with_the_cap() -> None:
    ratios = []
    for cap in BATCHING_CAPS:
        result = batching_comparison(cap)
        # Same work in both modes: every request generated its drawn length.
        assert result.continuous.output_tokens == result.static.output_tokens
        assert len(result.continuous.requests) == 1000
        ratios.append(result.throughput_ratio)
    assert ratios[-1] >= 3.0, ratios
    assert ratios == sorted(ratios), ratios
    assert ratios[0] < 1.5  # with everything capped at 32 tokens there is little to gain


def test_chunked_prefill_cuts_p99_inter_token_latency() -> None:
    result = chunked_prefill_comparison()
    assert result.p99_itl_ratio >= 2.0
    # Without chunking the stall is a whole 16k-token prefill.
    assert result.p99_itl_s(result.unchunked) > 0.5
    # Both runs served every request.
    for run in (result.chunked, result.unchunked):
        assert all(r.finish_s is not None for r in run.requests.values())


def test_second_request_sharing_a_2k_prefix_hits_the_cache() -> None:
    result = prefix_reuse()
    assert result.second_cached_tokens == result.expected_cached_tokens == 2032
    assert result.first.requests["first"].num_cached_tokens == 0
    # TTFT shrinks in proportion to the uncached tokens (attention and the fixed overhead
    # make it a little less than proportional).
    assert result.ttft_ratio == pytest.approx(result.uncached_ratio, rel=0.1)
