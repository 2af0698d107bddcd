"""Least load: the candidate with the fewest requests in flight from us plus queued at it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from router.policies.base import Decision, ReplicaView, RoutingRequest
from router.policies.settings import PolicySettings

__all__ = ["LeastLoad", "least_loaded", "load_of"]


def load_of(view: ReplicaView) -> int:
    """Requests this router has in flight there plus requests the replica reports waiting.

    In-flight is exact and current (our own counter); waiting is scraped and slightly stale but
    sees traffic from other routers.
    """
    return view.in_flight + view.waiting


def least_loaded(candidates: Sequence[ReplicaView], turn: int = 0) -> ReplicaView:
    """The least-loaded candidate; ties are broken by rotating with `turn`, so an idle fleet
    still spreads requests instead of sending every one to the first replica."""
    best = min(load_of(v) for v in candidates)
    tied = [v for v in candidates if load_of(v) == best]
    return tied[turn % len(tied)]


class LeastLoad:
    """Send each request to the least-loaded candidate (in-flight + waiting)."""

    name: ClassVar[str] = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    @classmethod
    def from_settings(cls, settings: PolicySettings) -> LeastLoad:
        settings.check_options(cls.name)
        return cls()

    def choose(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> Decision:
        view = least_loaded(candidates, self._turn)
        self._turn += 1
        return Decision(view.replica_id, "balance")
