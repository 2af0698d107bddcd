"""Uniformly random choice, seeded so runs are reproducible."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from router.policies.base import Decision, ReplicaView, RoutingRequest
from router.policies.settings import PolicySettings

__all__ = ["RandomChoice"]


class RandomChoice:
    """Pick a candidate uniformly at random from a private, seedable generator."""

    name: ClassVar[str] = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    @classmethod
    def from_settings(cls, settings: PolicySettings) -> RandomChoice:
        settings.check_options(cls.name)
        return cls(settings.seed)

    def choose(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> Decision:
        return Decision(self._rng.choice(candidates).replica_id, "random")
