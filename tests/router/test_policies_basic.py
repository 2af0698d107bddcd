"""The load-based policies on plain values: deterministic given a seed."""

from __future__ import annotations

from collections import Counter

import pytest

from router.errors import ConfigError
from router.policies import POLICIES, PolicySettings, make_policy
from router.policies.base import ReplicaView, RoutingRequest
from router.policies.least_load import LeastLoad, least_loaded
from router.policies.power_of_two import PowerOfTwo
from router.policies.random_choice import RandomChoice
from router.policies.round_robin import RoundRobin
from router.policies.session import HashRing, SessionAffinity

REQ = RoutingRequest(model="m")


def views(*loads: tuple[int, int]) -> list[ReplicaView]:
    """Views r0, r1, ... with (in_flight, waiting)."""
    return [ReplicaView(f"r{i}", in_flight=f, waiting=w) for i, (f, w) in enumerate(loads)]


def test_registry_names_and_factory() -> None:
    assert {"round_robin", "random", "least_load", "power_of_two", "session"} <= set(POLICIES)
    for name in ("round_robin", "random", "least_load", "power_of_two", "session"):
        policy = make_policy(name, PolicySettings(seed=1))
        assert policy.name == name
        assert POLICIES[name].uses_prefix is False
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ConfigError, match="has no option typo"):
        make_policy("least_load", PolicySettings(options={"typo": 1}))


def test_round_robin_rotates() -> None:
    policy = RoundRobin()
    cands = views((0, 0), (5, 5), (9, 9))
    picks = [policy.choose(REQ, cands).replica_id for _ in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert policy.choose(REQ, cands).reason == "rotation"


def test_random_is_seeded_and_covers_all() -> None:
    cands = views((0, 0), (0, 0), (0, 0))
    first = [RandomChoice(seed=3).choose(REQ, cands).replica_id for _ in range(1)]
    a, b = RandomChoice(seed=3), RandomChoice(seed=3)
    seq_a = [a.choose(REQ, cands).replica_id for _ in range(50)]
    seq_b = [b.choose(REQ, cands).replica_id for _ in range(50)]
    assert seq_a == seq_b and seq_a[:1] == first
    assert set(seq_a) == {"r0", "r1", "r2"}
    other = RandomChoice(seed=4)
    assert [other.choose(REQ, cands).replica_id for _ in range(50)] != seq_a


def test_least_load_counts_in_flight_plus_waiting() -> None:
    policy = LeastLoad()
    decision = policy.choose(REQ, views((3, 0), (1, 1), (0, 4)))
    assert (decision.replica_id, decision.reason) == ("r1", "balance")
    assert policy.choose(REQ, views((0, 9), (5, 0))).replica_id == "r1"


def test_least_load_spreads_ties_instead_of_piling_on_the_first() -> None:
    policy = LeastLoad()
    cands = views((0, 0), (0, 0), (0, 0))
    picks = Counter(policy.choose(REQ, cands).replica_id for _ in range(30))
    assert picks == {"r0": 10, "r1": 10, "r2": 10}
    assert least_loaded(views((1, 0), (0, 0), (0, 0)), turn=1).replica_id == "r2"


def test_least_load_with_feedback_stays_balanced() -> None:
    """Simulate in-flight accounting: each decision adds one to the chosen replica."""
    policy = LeastLoad()
    load = {"r0": 0, "r1": 0, "r2": 0, "r3": 0}
    for _ in range(400):
        cands = [ReplicaView(rid, in_flight=n) for rid, n in load.items()]
        load[policy.choose(REQ, cands).replica_id] += 1
    assert max(load.values()) - min(load.values()) <= 1


def test_power_of_two_is_seeded_and_prefers_the_lighter_of_two() -> None:
    cands = views((10, 0), (0, 0))
    policy = PowerOfTwo(seed=1)
    assert all(policy.choose(REQ, cands).replica_id == "r1" for _ in range(20))
    many = views((0, 0), (0, 0), (0, 0), (0, 0), (100, 0))
    a, b = PowerOfTwo(seed=9), PowerOfTwo(seed=9)
    seq = [a.choose(REQ, many).replica_id for _ in range(200)]
    assert seq == [b.choose(REQ, many).replica_id for _ in range(200)]
    # The overloaded replica can only win when it is not sampled, i.e. never.
    assert "r4" not in seq
    assert set(seq) == {"r0", "r1", "r2", "r3"}
    assert PowerOfTwo(seed=0).choose(REQ, views((0, 0))).reason == "single"


def test_hash_ring_is_stable_and_balanced() -> None:
    members = ("a", "b", "c", "d")
    ring = HashRing(members, vnodes=160)
    keys = [f"session-{i}" for i in range(4000)]
    owners = {k: ring.owner(k) for k in keys}
    counts = Counter(owners.values())
    assert set(counts) == set(members)
    assert max(counts.values()) < 2 * min(counts.values())  # virtual nodes even the share
    # Removing a member moves only its own keys.
    smaller = HashRing(("a", "b", "c"), vnodes=160)
    moved = [k for k in keys if owners[k] != smaller.owner(k)]
    assert moved and all(owners[k] == "d" for k in moved)
    with pytest.raises(ValueError):
        HashRing(())


def test_session_affinity_sticks_and_falls_back_when_owner_is_down() -> None:
    policy = SessionAffinity()
    members = ("r0", "r1", "r2")
    cands = views((0, 0), (0, 0), (0, 0))
    req = RoutingRequest(model="m", session_key="user-42", members=members)
    owner = policy.choose(req, cands)
    assert owner.reason == "session"
    assert all(policy.choose(req, cands).replica_id == owner.replica_id for _ in range(10))
    # Load does not move a session.
    loaded = [ReplicaView(v.replica_id, in_flight=50 if v.replica_id == owner.replica_id else 0)
              for v in cands]  # fmt: skip
    assert policy.choose(req, loaded).replica_id == owner.replica_id
    # Owner down (not a candidate): least-loaded among the rest, reason says so.
    rest = [ReplicaView(v.replica_id, in_flight=i) for i, v in enumerate(cands)
            if v.replica_id != owner.replica_id]  # fmt: skip
    fallback = policy.choose(req, rest)
    assert fallback.reason == "session_fallback"
    assert fallback.replica_id == rest[0].replica_id
    # Back up: the session returns to its owner (the ring is over members, not candidates).
    assert policy.choose(req, cands).replica_id == owner.replica_id


def test_session_without_key_balances() -> None:
    policy = SessionAffinity()
    decision = policy.choose(RoutingRequest(model="m"), views((4, 0), (0, 1), (2, 0)))
    assert (decision.replica_id, decision.reason) == ("r1", "no_session")


def test_session_keys_spread_over_replicas() -> None:
    policy = SessionAffinity.from_settings(PolicySettings(options={"vnodes": 64}))
    cands = views((0, 0), (0, 0), (0, 0))
    picks = Counter(
        policy.choose(
            RoutingRequest(model="m", session_key=f"s{i}", members=("r0", "r1", "r2")), cands
        ).replica_id
        for i in range(300)
    )
    assert len(picks) == 3 and min(picks.values()) > 50
