"""Round robin: each request goes to the next candidate in turn (the cache-blind baseline)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from router.policies.base import Decision, ReplicaView, RoutingRequest
from router.policies.settings import PolicySettings

__all__ = ["RoundRobin"]


class RoundRobin:
    """Rotate over the candidates.  Deterministic: the n-th call picks candidate n mod len."""

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    @classmethod
    def from_settings(cls, settings: PolicySettings) -> RoundRobin:
        settings.check_options(cls.name)
        return cls()

    def choose(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> Decision:
        index = self._turn % len(candidates)
        self._turn += 1
        return Decision(candidates[index].replica_id, "rotation")
