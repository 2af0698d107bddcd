"""cache_aware (SGLang's algorithm) on plain values."""

from __future__ import annotations

import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.errors import ConfigError
from router.policies.base import ReplicaView, RoutingRequest
from router.policies.cache_aware import CacheAware, CacheAwareSettings, match_rate
from router.policies.settings import PolicySettings

# 10 blocks of 64 characters: a match of 3 blocks is a rate of 0.3, 4 blocks 0.4.
REQUEST = RoutingRequest(model="m", block_hashes=tuple(range(10)), prompt_units=640)


def views(*specs: tuple[int, int]) -> list[ReplicaView]:
    """(in_flight, matched_blocks) per replica r0, r1, ..."""
    return [
        ReplicaView(f"r{i}", in_flight=load, matched_blocks=matched)
        for i, (load, matched) in enumerate(specs)
    ]


def test_prefix_hit_above_the_cache_threshold() -> None:
    decision = CacheAware().choose(REQUEST, views((5, 0), (9, 4), (0, 1)))
    assert (decision.replica_id, decision.reason) == ("r1", "prefix_hit")


def test_low_match_goes_to_the_least_loaded() -> None:
    # 3 of 10 blocks is exactly 0.3: not above the threshold.
    decision = CacheAware().choose(REQUEST, views((5, 0), (9, 3), (2, 1)))
    assert (decision.replica_id, decision.reason) == ("r2", "no_match")
    assert match_rate(REQUEST, 3) == pytest.approx(0.3)


def test_imbalance_overrides_the_match() -> None:
    # 100 - 10 > 64 and 100 > 10 * 1.5: imbalanced.
    decision = CacheAware().choose(REQUEST, views((100, 10), (10, 0), (50, 0)))
    assert (decision.replica_id, decision.reason) == ("r1", "balance")
    # 70 - 10 = 60 is not above the absolute threshold: the match wins.
    decision = CacheAware().choose(REQUEST, views((70, 10), (10, 0)))
    assert (decision.replica_id, decision.reason) == ("r0", "prefix_hit")
    # 200 vs 150: far apart in absolute terms but not relatively (200 < 225).
    decision = CacheAware().choose(REQUEST, views((200, 10), (150, 0)))
    assert decision.reason == "prefix_hit"


def test_empty_prompt_never_counts_as_a_hit() -> None:
    empty = RoutingRequest(model="m")
    decision = CacheAware().choose(empty, views((3, 0), (1, 0)))
    assert (decision.replica_id, decision.reason) == ("r1", "no_match")


def test_options_are_read_and_checked() -> None:
    options = types.MappingProxyType({"cache_threshold": 0.5, "balance_abs_threshold": 8})
    policy = CacheAware.from_settings(PolicySettings(seed=3, options=options))
    assert policy.settings == CacheAwareSettings(0.5, 8, 1.5, seed=3)
    with pytest.raises(ConfigError):
        CacheAware.from_settings(PolicySettings(options=types.MappingProxyType({"nope": 1})))
    with pytest.raises(ConfigError):
        CacheAware.from_settings(
            PolicySettings(options=types.MappingProxyType({"cache_threshold": 2.0}))
        )


fleet = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 12)), min_size=1, max_size=6)


@given(fleet=fleet, seed=st.integers(0, 2**32), first=st.integers(0, 2**63))
def test_deterministic_given_a_seed(fleet: list[tuple[int, int]], seed: int, first: int) -> None:
    request = RoutingRequest(model="m", block_hashes=(first, 1, 2, 3), prompt_units=256)
    candidates = views(*fleet)
    a = CacheAware(CacheAwareSettings(seed=seed)).choose(request, candidates)
    b = CacheAware(CacheAwareSettings(seed=seed)).choose(request, list(candidates))
    assert a == b
    assert a.replica_id in {v.replica_id for v in candidates}
    assert a.reason in {"prefix_hit", "no_match", "balance"}
