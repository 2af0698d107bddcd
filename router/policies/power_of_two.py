"""Power of two choices: sample two candidates at random, keep the less loaded one."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from router.policies.base import Decision, ReplicaView, RoutingRequest
from router.policies.least_load import load_of
from router.policies.settings import PolicySettings

__all__ = ["PowerOfTwo"]


class PowerOfTwo:
    """Almost as balanced as least-load with far less herding when load data is stale."""

    name: ClassVar[str] = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    @classmethod
    def from_settings(cls, settings: PolicySettings) -> PowerOfTwo:
        settings.check_options(cls.name)
        return cls(settings.seed)

    def choose(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0].replica_id, "single")
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        return Decision((b if load_of(b) < load_of(a) else a).replica_id, "balance")
