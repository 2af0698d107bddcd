"""kv_aware, the default policy: the replica with the lowest predicted time to first token.

For each candidate *i* the predicted TTFT, in seconds, is

    ttft_i = prefill_s_per_token * (queued_i + uncached_i)

    queued_i   = pending_prefill_tokens_i                        our prompts still being prefilled
               + decode_tokens_per_request * max(in_flight_i, running_i + waiting_i)
               + waiting_request_tokens * max(0, waiting_i - in_flight_i)
               + kv_full_penalty_tokens * min(1, max(0, kv_usage_i - kv_soft_limit)
                                                 / (1 - kv_soft_limit))
    uncached_i = prompt_tokens - matched_tokens_i                this request's prefill there

Every term is in prefill-token equivalents, so the weights say "one running request costs as much
as prefilling N tokens".  Our own requests are counted from the router's fresh state (in-flight,
pending prefill tokens); the scraped `waiting` only adds what other routers queued there, whose
sizes are unknown.  (A transient `waiting` of our own requests is normal in vLLM, which admits new
requests at the next step: counting it again would make the choice jitter with the scrape.)

A replica holding the prompt's prefix wins while its queue is shorter
than the prefix it saves; when a hot prefix piles up on one replica, a cold replica becomes cheaper,
receives the full prompt, and from then on holds the prefix too (a second home), so the hot prefix
spreads without losing locality.  To keep locality when costs are close, the choice is made among
the candidates within `locality_slack` of the best cost, preferring the longest match, then the
lowest cost; when none of them holds any of the prompt, the emptiest cache wins instead (a new
prefix goes where it evicts least, so prefixes spread evenly over the fleet).  Remaining ties
fall to a stable seeded hash (deterministic, no hidden state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import xxhash

from router.errors import ConfigError
from router.policies.base import Decision, ReplicaView, RoutingRequest
from router.policies.settings import PolicySettings

__all__ = [
    "KvAware",
    "KvAwareSettings",
    "decision_reason",
    "matched_tokens",
    "predicted_ttft_s",
    "tiebreak",
]


@dataclass(frozen=True, slots=True)
class KvAwareSettings:
    """Weights of the predicted-TTFT cost (see the module docstring)."""

    # Seconds to prefill one token (≈ 1/31k on an H100 for Llama-3.1-8B); only scales the result.
    prefill_s_per_token: float = 1.0 / 30_000
    # A request in flight slows every step it shares with a new prefill (decode interference).
    decode_tokens_per_request: float = 32.0
    # A request queued at the replica that this router did not send (its size is unknown).
    waiting_request_tokens: float = 512.0
    # Above this KV usage, new sequences start to wait for memory or cause preemptions.
    kv_soft_limit: float = 0.85
    kv_full_penalty_tokens: float = 8192.0
    # Candidates whose cost is within best * (1 + locality_slack) + locality_slack_tokens
    # compete on match length, so near-ties keep the prefix where it is.  Kept to a near-tie:
    # every token of slack is queueing a request accepts on the holder, and the wider band first
    # used (10% + 256 tokens) delayed a hot prefix's second home, so the requests queued meanwhile
    # raised TTFT p50 above round robin's (docs/routing.md, "Hot prefix, measured").
    locality_slack: float = 0.0
    locality_slack_tokens: float = 128.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "prefill_s_per_token",
            "decode_tokens_per_request",
            "waiting_request_tokens",
            "kv_full_penalty_tokens",
            "locality_slack",
            "locality_slack_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0.0 <= self.kv_soft_limit < 1.0:
            raise ValueError("kv_soft_limit must be in [0, 1)")


def matched_tokens(request: RoutingRequest, matched_blocks: int) -> int:
    """Model tokens covered by `matched_blocks` leading blocks of the request's prompt."""
    if matched_blocks <= 0 or request.prompt_units <= 0:
        return 0
    units = min(matched_blocks * request.block_units, request.prompt_units)
    if request.prompt_tokens <= 0:
        return units
    return units * request.prompt_tokens // request.prompt_units


def _prompt_tokens(request: RoutingRequest) -> int:
    return request.prompt_tokens if request.prompt_tokens > 0 else request.prompt_units


def _queued_tokens(view: ReplicaView, s: KvAwareSettings) -> float:
    requests = max(view.in_flight, view.running + view.waiting)
    foreign_waiting = max(0, view.waiting - view.in_flight)
    kv_over = max(0.0, view.kv_usage - s.kv_soft_limit) / (1.0 - s.kv_soft_limit)
    return (
        view.pending_prefill_tokens
        + s.decode_tokens_per_request * requests
        + s.waiting_request_tokens * foreign_waiting
        + s.kv_full_penalty_tokens * min(kv_over, 1.0)
    )


def _cost_tokens(request: RoutingRequest, view: ReplicaView, s: KvAwareSettings) -> float:
    uncached = _prompt_tokens(request) - matched_tokens(request, view.matched_blocks)
    return _queued_tokens(view, s) + max(0, uncached)


def _fill(view: ReplicaView) -> float:
    """How full the replica's cache is believed to be (0..1; raw blocks when capacity unknown)."""
    if view.capacity_blocks:
        return min(1.0, view.held_blocks / view.capacity_blocks)
    return float(view.held_blocks)


def predicted_ttft_s(request: RoutingRequest, view: ReplicaView, s: KvAwareSettings) -> float:
    """The predicted time to first token of `request` on `view` (the module's formula)."""
    return s.prefill_s_per_token * _cost_tokens(request, view, s)


def tiebreak(seed: int, request: RoutingRequest, replica_id: str) -> int:
    """A stable pseudo-random rank of `replica_id` for this request (same inputs, same rank).

    Requests sharing their first block rank the replicas alike (a new prefix's first requests
    land together); prompts shorter than a block rank them by their whole key, so short
    prompts spread instead of all following one ranking.
    """
    if request.block_hashes:
        first = request.block_hashes[0]
    else:
        first = request.key_hash or request.prompt_units
    return xxhash.xxh64_intdigest(replica_id.encode(), (seed ^ first) & 0xFFFF_FFFF_FFFF_FFFF)


def decision_reason(chosen: ReplicaView, candidates: Sequence[ReplicaView]) -> str:
    """prefix_hit: chosen holds the longest match; balance: a shorter one; spread: none while
    another candidate holds some (the prefix gets a new home); no_match: nobody holds any."""
    longest = max(v.matched_blocks for v in candidates)
    if longest == 0:
        return "no_match"
    if chosen.matched_blocks == longest:
        return "prefix_hit"
    return "balance" if chosen.matched_blocks > 0 else "spread"


class KvAware:
    """Lowest predicted TTFT, with locality among near-ties (see the module docstring)."""

    name: ClassVar[str] = "kv_aware"
    OPTIONS: ClassVar[tuple[str, ...]] = (
        "prefill_s_per_token",
        "decode_tokens_per_request",
        "waiting_request_tokens",
        "kv_soft_limit",
        "kv_full_penalty_tokens",
        "locality_slack",
        "locality_slack_tokens",
    )

    def __init__(self, settings: KvAwareSettings | None = None) -> None:
        self.settings = settings or KvAwareSettings()

    @classmethod
    def from_settings(cls, settings: PolicySettings) -> KvAware:
        settings.check_options(cls.name, cls.OPTIONS)
        defaults = KvAwareSettings()
        values = {
            name: settings.float_option(name, getattr(defaults, name)) for name in cls.OPTIONS
        }
        try:
            return cls(KvAwareSettings(seed=settings.seed or 0, **values))
        except ValueError as exc:
            raise ConfigError(f"policy kv_aware: {exc}") from exc

    def choose(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> Decision:
        s = self.settings
        costs = [(v, _cost_tokens(request, v, s)) for v in candidates]
        best = min(c for _, c in costs)
        limit = best * (1.0 + s.locality_slack) + s.locality_slack_tokens
        seed = s.seed
        near = [(i, v, c) for i, (v, c) in enumerate(costs) if c <= limit]
        if any(v.matched_blocks for _, v, _ in near):
            # Locality: the longest match among the near-best, then the cheapest.
            _, chosen = min(
                ((-v.matched_blocks, c, tiebreak(seed, request, v.replica_id), i), v)
                for i, v, c in near
            )
        else:
            # A new prefix: place it where it evicts least, so prefixes spread evenly.
            _, chosen = min(
                ((_fill(v), c, tiebreak(seed, request, v.replica_id), i), v) for i, v, c in near
            )
        return Decision(chosen.replica_id, decision_reason(chosen, candidates))
