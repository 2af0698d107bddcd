"""Routing policies: one module per policy and one registry of names.

`POLICIES` maps each name to a `PolicySpec`; `make_policy(name, settings)` builds one.  A policy
implements `router.policies.base.Policy` and gets its settings as a `PolicySettings`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.errors import ConfigError
from router.policies.base import Decision, Policy, ReplicaView, RoutingRequest
from router.policies.cache_aware import CacheAware
from router.policies.kv_aware import KvAware
from router.policies.least_load import LeastLoad
from router.policies.power_of_two import PowerOfTwo
from router.policies.random_choice import RandomChoice
from router.policies.round_robin import RoundRobin
from router.policies.session import SessionAffinity
from router.policies.settings import PolicySettings

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Decision",
    "Policy",
    "PolicySettings",
    "PolicySpec",
    "ReplicaView",
    "RoutingRequest",
    "make_policy",
]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """How to build a policy, and whether it reads prompt block hashes / prefix matches
    (when no configured policy does, the router skips hashing prompts altogether)."""

    factory: Callable[[PolicySettings], Policy]
    uses_prefix: bool = True


POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec(RoundRobin.from_settings, uses_prefix=False),
    "random": PolicySpec(RandomChoice.from_settings, uses_prefix=False),
    "least_load": PolicySpec(LeastLoad.from_settings, uses_prefix=False),
    "power_of_two": PolicySpec(PowerOfTwo.from_settings, uses_prefix=False),
    "session": PolicySpec(SessionAffinity.from_settings, uses_prefix=False),
    "cache_aware": PolicySpec(CacheAware.from_settings),
    "kv_aware": PolicySpec(KvAware.from_settings),
}

DEFAULT_POLICY = "kv_aware"


def make_policy(name: str, settings: PolicySettings | None = None) -> Policy:
    """Build the policy registered as `name`; ConfigError for unknown names or options."""
    spec = POLICIES.get(name)
    if spec is None:
        raise ConfigError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return spec.factory(settings or PolicySettings())
