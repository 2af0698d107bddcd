"""cache_aware: SGLang router's algorithm, the baseline users know (reference/routing.md).

Loads are this router's in-flight counts.  The fleet is imbalanced iff
`max - min > balance_abs_threshold` and `max > min * balance_rel_threshold`; then the least-loaded
candidate is chosen (reason `balance`).  Otherwise the candidate with the longest prefix match
is chosen if its match rate (matched units / prompt units) exceeds `cache_threshold`
(`prefix_hit`), else the least-loaded one (`no_match`).  The caller inserts the prompt under the
chosen replica either way, as SGLang does.  Ties go to a stable seeded hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from router.errors import ConfigError
from router.policies.base import Decision, ReplicaView, RoutingRequest
from router.policies.kv_aware import tiebreak
from router.policies.settings import PolicySettings

__all__ = ["CacheAware", "CacheAwareSettings", "match_rate"]


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    """SGLang's CLI defaults."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0, balance_rel_threshold >= 1")


def match_rate(request: RoutingRequest, matched_blocks: int) -> float:
    """Matched units over prompt units (SGLang: matched characters over text characters)."""
    if request.prompt_units <= 0:
        return 0.0
    return min(1.0, matched_blocks * request.block_units / request.prompt_units)


class CacheAware:
    """SGLang's cache-aware routing with its default thresholds."""

    name: ClassVar[str] = "cache_aware"
    OPTIONS: ClassVar[tuple[str, ...]] = (
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
    )

    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        self.settings = settings or CacheAwareSettings()

    @classmethod
    def from_settings(cls, settings: PolicySettings) -> CacheAware:
        settings.check_options(cls.name, cls.OPTIONS)
        d = CacheAwareSettings()
        try:
            return cls(
                CacheAwareSettings(
                    cache_threshold=settings.float_option("cache_threshold", d.cache_threshold),
                    balance_abs_threshold=settings.int_option(
                        "balance_abs_threshold", d.balance_abs_threshold
                    ),
                    balance_rel_threshold=settings.float_option(
                        "balance_rel_threshold", d.balance_rel_threshold
                    ),
                    seed=settings.seed or 0,
                )
            )
        except ValueError as exc:
            raise ConfigError(f"policy cache_aware: {exc}") from exc

    def _least_loaded(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> str:
        seed = self.settings.seed
        return min(
            candidates, key=lambda v: (v.in_flight, tiebreak(seed, request, v.replica_id))
        ).replica_id

    def choose(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> Decision:
        s = self.settings
        loads = [v.in_flight for v in candidates]
        high, low = max(loads), min(loads)
        if high - low > s.balance_abs_threshold and high > low * s.balance_rel_threshold:
            return Decision(self._least_loaded(request, candidates), "balance")
        best = min(
            candidates,
            key=lambda v: (-v.matched_blocks, v.in_flight, tiebreak(s.seed, request, v.replica_id)),
        )
        if best.matched_blocks > 0 and match_rate(request, best.matched_blocks) > s.cache_threshold:
            return Decision(best.replica_id, "prefix_hit")
        return Decision(self._least_loaded(request, candidates), "no_match")
