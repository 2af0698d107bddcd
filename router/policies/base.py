"""The one contract every routing policy implements.

A policy is a pure decision: it sees plain, immutable values (never an aiohttp request, a clock,
a socket or Redis) and returns which candidate should serve the request and why.  Side effects
(prefix-index inserts, counters, shared state) happen after the decision, in one place, in the
caller.  The same policy code therefore runs in the gateway, in unit tests and in the offline
fleet simulator in virtual time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, NamedTuple, Protocol

__all__ = ["Decision", "Policy", "ReplicaView", "RoutingRequest"]

# The value types below are NamedTuples rather than frozen dataclasses: just as immutable, but
# built several times faster (a frozen dataclass sets each field through object.__setattr__),
# and a few are built for every request and every candidate on the hot path.


class RoutingRequest(NamedTuple):
    """What a policy may know about one request; computed once, at the edge."""

    model: str
    # Chained hashes of the routing key's fixed-size blocks (see router.prefix); empty when the
    # request has no prompt to route on (e.g. embeddings).
    block_hashes: tuple[int, ...] = ()
    # Length of the prompt in the units the blocks are cut from (characters, or tokens when a
    # tokenizer is configured) and an estimate of its length in model tokens.
    prompt_units: int = 0
    prompt_tokens: int = 0
    # Units per block, so a policy can turn matched blocks into matched tokens.
    block_units: int = 64
    # Hash of the whole routing key (router.prefix.keys.PromptKey.key_hash): a stable tie-break
    # input that tells apart prompts too short to fill one block.
    key_hash: int = 0
    session_key: str | None = None
    priority: str = "interactive"
    # Every replica that serves the model, up or not (sorted).  A policy that must stay stable
    # across health flaps (the session policy's hash ring) builds on this; empty = candidates.
    members: tuple[str, ...] = ()


class ReplicaView(NamedTuple):
    """An immutable snapshot of one healthy candidate replica, taken just before the decision."""

    replica_id: str
    in_flight: int = 0  # requests this router has sent and not yet seen finish
    running: int = 0  # scraped vllm:num_requests_running
    waiting: int = 0  # scraped vllm:num_requests_waiting
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc, 0..1
    capacity_blocks: int | None = None  # KV capacity in the index's block units, when known
    matched_blocks: int = 0  # leading blocks of this request the replica is believed to hold
    # Prompt tokens this router has sent to the replica that are still being prefilled
    # (uncached part only); lets cost-based policies predict queueing for prefill.
    pending_prefill_tokens: int = 0
    # Blocks the prefix index believes the replica holds (all models): how full its KV cache is,
    # so a new prefix can be placed where it evicts least.
    held_blocks: int = 0


class Decision(NamedTuple):
    """The chosen replica and why (the reason is a metric label: keep it a small fixed set)."""

    replica_id: str
    reason: str


class Policy(Protocol):
    """A routing policy.  `choose` must not mutate its arguments; `candidates` is never empty."""

    name: ClassVar[str]  # the registry key; also a metric label

    def choose(self, request: RoutingRequest, candidates: Sequence[ReplicaView]) -> Decision: ...
