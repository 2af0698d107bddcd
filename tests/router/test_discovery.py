"""DNS discovery on plain values: the reconciliation rule, and the `--discover-dns` settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import DnsTarget, RouterConfig, load_config, parse_dns_target
from router.errors import ConfigError
from router.fleet.discovery import Reconciliation, reconcile

A, B, C, S = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://s:1"


def test_new_addresses_are_added_once_and_known_ones_left_alone() -> None:
    plan = reconcile([C, A, B, S], owned=[A], taken=[S], missing={}, grace_rounds=2)
    assert plan == Reconciliation(add=(B, C), remove=(), missing={})


def test_an_address_is_removed_after_grace_rounds_missing_in_a_row() -> None:
    first = reconcile([A], owned=[A, B], taken=[], missing={}, grace_rounds=2)
    assert (first.add, first.remove, dict(first.missing)) == ((), (), {B: 1})
    second = reconcile([A], owned=[A, B], taken=[], missing=first.missing, grace_rounds=2)
    assert (second.remove, dict(second.missing)) == ((B,), {})
    # grace_rounds = 1: gone at the first answer without it
    assert reconcile([], owned=[A], taken=[], missing={}, grace_rounds=1).remove == (A,)
    # an empty answer is an answer: everything owned counts as missing
    assert dict(reconcile([], owned=[A, B], taken=[], missing={}, grace_rounds=3).missing) == {
        A: 1,
        B: 1,
    }


def test_an_address_that_comes_back_starts_again_from_zero() -> None:
    missing = reconcile([A], owned=[A, B], taken=[], missing={}, grace_rounds=2).missing
    back = reconcile([A, B], owned=[A, B], taken=[], missing=missing, grace_rounds=2)
    assert back == Reconciliation()
    again = reconcile([A], owned=[A, B], taken=[], missing=back.missing, grace_rounds=2)
    assert again.remove == () and dict(again.missing) == {B: 1}


def test_a_failed_resolution_changes_nothing_and_keeps_the_counters() -> None:
    missing = {B: 1, "http://gone:1": 1}  # a URL no longer owned is dropped from the counters
    plan = reconcile(None, owned=[A, B], taken=[], missing=missing, grace_rounds=2)
    assert (plan.add, plan.remove, dict(plan.missing)) == ((), (), {B: 1})
    # ...so the next real answer without B completes its grace, failures in between or not
    assert reconcile([A], owned=[A, B], taken=[], missing=plan.missing, grace_rounds=2).remove == (
        B,
    )


URLS = st.sampled_from([A, B, C, S])
ANSWER = st.none() | st.frozensets(URLS)


@settings(max_examples=200, deadline=None)
@given(answers=st.lists(ANSWER, max_size=12), grace=st.integers(1, 3))
def test_rounds_follow_the_answers(answers: list[frozenset[str] | None], grace: int) -> None:
    """Applying the plans round after round: never remove on a failure, remove exactly what the
    last `grace` real answers all lacked, never add what is taken, and converge on the answer."""
    taken = {S}
    owned: set[str] = set()
    missing: dict[str, int] = {}
    real: list[frozenset[str]] = []  # the successful answers so far
    for answer in answers:
        plan = reconcile(answer, owned, taken, missing, grace)
        assert not set(plan.add) & (owned | taken)
        if answer is None:
            assert plan.add == plan.remove == ()
        else:
            real.append(answer)
            assert set(plan.add) == answer - owned - taken
            for url in plan.remove:  # absent from the last `grace` real answers
                assert len(real) >= grace and all(url not in a for a in real[-grace:])
            for url in owned - set(plan.remove) - answer:
                assert any(url in a for a in real[-grace:]) or len(real) < grace
        owned = (owned | set(plan.add)) - set(plan.remove)
        missing = dict(plan.missing)
        assert set(missing) <= owned
        if answer is not None:
            assert answer - taken <= owned


# --- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "target", "url"),
    [
        ("sim-replica:8000", DnsTarget("http", "sim-replica", 8000), "http://10.1.2.3:8000"),
        (
            "http://vllm.ns.svc:8000/",
            DnsTarget("http", "vllm.ns.svc", 8000),
            "http://10.1.2.3:8000",
        ),
        ("https://Vllm:443", DnsTarget("https", "vllm", 443), "https://10.1.2.3:443"),
    ],
)
def test_targets_parse(text: str, target: DnsTarget, url: str) -> None:
    assert parse_dns_target(text) == target
    assert target.replica_url("10.1.2.3") == url


def test_ipv6_addresses_become_bracketed_urls() -> None:
    target = parse_dns_target("[::1]:8000")
    assert str(target) == "[::1]:8000"
    assert target.replica_url("fd00::5") == "http://[fd00::5]:8000"
    assert target.replica_url("fe80::1%eth0") == "http://[fe80::1%25eth0]:8000"


@pytest.mark.parametrize("text", ["sim", "sim:", "sim:0", "sim:x", "ftp://sim:1", "sim:1/v1",
                                  "u@sim:1", "sim:70000", ":8000"])  # fmt: skip
def test_bad_targets_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="discover_dns"):
        parse_dns_target(text)


def test_discovery_settings_from_flags_env_and_yaml(tmp_path: Path) -> None:
    cfg = load_config(["--discover-dns", "a:1", "--discover-dns", "http://b:2"])
    assert cfg.dns_targets == (DnsTarget("http", "a", 1), DnsTarget("http", "b", 2))
    assert (cfg.discover_dns_interval_s, cfg.discover_dns_grace_rounds) == (5.0, 2)
    assert cfg.discover_dns_kv_events_port is None
    assert cfg.embedded_sim_replicas == 0  # discovering replicas: no embedded sims
    env = {
        "FLEET_ROUTER_DISCOVER_DNS": "a:1,b:2",
        "FLEET_ROUTER_DISCOVER_DNS_INTERVAL_S": "0.5",
        "FLEET_ROUTER_DISCOVER_DNS_GRACE_ROUNDS": "3",
        "FLEET_ROUTER_DISCOVER_DNS_KV_EVENTS_PORT": "5557",
        "FLEET_ROUTER_TOKENIZER": "sim",
    }
    cfg = load_config([], env=env)
    assert cfg.discover_dns == ("a:1", "b:2")
    assert (cfg.discover_dns_interval_s, cfg.discover_dns_grace_rounds) == (0.5, 3)
    assert cfg.discover_dns_kv_events_port == 5557
    path = tmp_path / "router.yaml"
    path.write_text("discover_dns: [sim-replica.fleet.svc.cluster.local:8000]\n")
    cfg = load_config(["--config", str(path)], env={})
    assert cfg.dns_targets == (DnsTarget("http", "sim-replica.fleet.svc.cluster.local", 8000),)


@pytest.mark.parametrize(
    ("settings_", "problem"),
    [
        ({"discover_dns": ("nope",)}, "discover_dns 'nope'"),
        ({"discover_dns": ("a:1", "http://a:1")}, "appears twice"),
        ({"discover_dns": ("a:1",), "discover_dns_interval_s": 0}, "discover_dns_interval_s"),
        ({"discover_dns": ("a:1",), "discover_dns_grace_rounds": 0}, "grace_rounds must be >= 1"),
        ({"discover_dns_kv_events_port": 5557, "tokenizer": "sim"}, "needs --discover-dns"),
        ({"discover_dns": ("a:1",), "discover_dns_kv_events_port": 5557}, "needs --tokenizer"),
        (
            {"discover_dns": ("a:1",), "discover_dns_kv_events_port": 0, "tokenizer": "sim"},
            "must be in 1..65535",
        ),
    ],
)
def test_invalid_discovery_settings(settings_: dict[str, object], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        RouterConfig(**settings_)  # type: ignore[arg-type]
