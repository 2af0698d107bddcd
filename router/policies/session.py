"""Session affinity: consistent hashing of a session key onto a ring of replicas.

The key is the request's session header (default `x-session-id`) or its OpenAI `user` field.
The ring is built over every replica serving the model (`RoutingRequest.members`), not only the
healthy ones, so a replica going down moves only its own sessions (to the least-loaded healthy
candidate) and they come back to it when it recovers.  Virtual nodes even out the key space.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import ClassVar

import xxhash

from router.policies.base import Decision, ReplicaView, RoutingRequest
from router.policies.least_load import least_loaded
from router.policies.settings import PolicySettings

__all__ = ["HashRing", "SessionAffinity"]


def _hash(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode("utf-8"))


class HashRing:
    """An immutable consistent-hash ring with `vnodes` points per member."""

    __slots__ = ("_members", "_owners", "_points")

    def __init__(self, members: Sequence[str], vnodes: int = 160) -> None:
        if not members:
            raise ValueError("a hash ring needs at least one member")
        points = sorted((_hash(f"{m}#{i}"), m) for m in members for i in range(vnodes))
        self._members = tuple(sorted(set(members)))
        self._points = [p for p, _ in points]
        self._owners = [m for _, m in points]

    @property
    def members(self) -> tuple[str, ...]:
        return self._members

    def owner(self, key: str) -> str:
        """The member owning `key`: the first point clockwise from the key's hash."""
        index = bisect.bisect(self._points, _hash(key)) % len(self._points)
        return self._owners[index]


class SessionAffinity:
    """Route a session to its ring owner; fall back to least load without a key or owner down."""

    name: ClassVar[str] = "session"

    def __init__(self, vnodes: int = 160) -> None:
        self._vnodes = vnodes
        self._ring: HashRing | None = None
        self._turn = 0

    @classmethod
    def from_settings(cls, settings: PolicySettings) -> SessionAffinity:
        settings.check_options(cls.name, ("vnodes",))
        return cls(vnodes=settings.int_option("vnodes", 160))

    def _ring_for(self, members: tuple[str, ...]) -> HashRing:
        # Membership changes rarely: keep the last ring (a pure cache of a pure function).
        if self._ring is None or self._ring.members != members:
            self._ring = HashRing(members, self._vnodes)
        return self._ring

    def choose(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> Decision:
        if request.session_key is not None:
            members = request.members or tuple(sorted(v.replica_id for v in candidates))
            owner = self._ring_for(members).owner(request.session_key)
            for view in candidates:
                if view.replica_id == owner:
                    return Decision(owner, "session")
            reason = "session_fallback"
        else:
            reason = "no_session"
        view = least_loaded(candidates, self._turn)
        self._turn += 1
        return Decision(view.replica_id, reason)
