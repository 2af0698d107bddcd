"""The routing core: one request → one `RoutingRequest` → candidate views → policy → side effects.

Everything about a decision happens here, in one place, with no HTTP in sight:

1. `prepare()` builds the `RoutingRequest` once (block hashes via `prompt_key` when the
   policy uses prefixes) and looks the prefix index up once.
2. `choose()` snapshots the healthy candidates as `ReplicaView`s (matched blocks, capacity,
   pending prefill and the blocks the index believes each replica holds), asks the policy, and
   counts the decision.  Retries call it again with the replicas already tried excluded; the
   request and its prefix matches are reused.
3. `start()` applies the side effects of sending a request to a replica and returns a `Lease`:
   in-flight +1, prefix-index insert, pending prefill.  `Lease.close()` undoes the load on every
   path (success, error, timeout, client gone) exactly once, refreshes the index on success and
   gives the circuit breaker its verdict.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from router.errors import BadRequest, NoHealthyReplica, UnknownModel
from router.fleet.registry import Fleet
from router.fleet.replica import Replica
from router.fleet.stats import ScrapedStats
from router.metrics import LoopCounterChild, RouterMetrics
from router.policies.base import Policy, RoutingRequest
from router.policies.least_load import least_loaded
from router.prefix.index import PrefixIndex
from router.prefix.keys import Tokenizer, prompt_key
from router.prefix.units import KeyUnits

if TYPE_CHECKING:
    from router.state.sync import StateSync

__all__ = ["Endpoint", "Lease", "RouteContext", "RoutingCore"]

# "completions" and "chat" are routed by the policy; the others go to the least-loaded replica
# serving the model (they are short and say nothing about KV cache contents).
Endpoint = Literal["completions", "chat", "embeddings", "tokenize", "detokenize"]
_ROUTED: frozenset[str] = frozenset({"completions", "chat"})
_EMPTY: Mapping[str, int] = {}


class RouteContext:
    """Per-request routing state, computed once and reused by retries."""

    __slots__ = ("endpoint", "matches", "request")

    def __init__(
        self, endpoint: Endpoint, request: RoutingRequest, matches: Mapping[str, int]
    ) -> None:
        self.endpoint = endpoint
        self.request = request
        # Leading blocks of this prompt each replica is believed to hold (looked up once).
        self.matches = matches

    @property
    def by_policy(self) -> bool:
        return self.endpoint in _ROUTED


class Lease:
    """One attempt of one request on one replica, from `RoutingCore.start` to `close`.

    Use it as a context manager: `close()` runs on every exit path, exactly once.
    """

    __slots__ = ("_closed", "_core", "_pending", "_trial", "_verdict", "ctx", "replica")

    def __init__(self, core: RoutingCore, replica: Replica, ctx: RouteContext, trial: bool) -> None:
        self._core = core
        self.replica = replica
        self.ctx = ctx
        self._trial = trial
        self._verdict: bool | None = None
        self._closed = False
        self._pending = 0

    def record_success(self) -> None:
        """The replica answered (any status below 500, or 429): it is alive."""
        self._verdict = True

    def record_failure(self) -> None:
        """Connect error, timeout, 5xx or a broken stream: counts towards opening the circuit."""
        self._verdict = False

    def first_byte(self) -> None:
        """The replica started answering: its prefill of this prompt is over."""
        self._core._end_prefill(self)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._core._finish(self, self._verdict, self._trial)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RoutingCore:
    """Decides where each request goes and keeps load and prefix state in step with it."""

    def __init__(
        self,
        *,
        fleet: Fleet,
        policy: Policy,
        metrics: RouterMetrics,
        uses_prefix: bool,
        units: KeyUnits | None = None,
        prefix_index: PrefixIndex | None = None,
        tokenizer: Tokenizer | None = None,
        retry_after_s: int = 1,
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.metrics = metrics
        self.units = units or KeyUnits()
        # Hash prompts and keep an index only when the policy reads them (saves CPU otherwise).
        self.uses_prefix = uses_prefix
        self.prefix_index = (
            prefix_index if prefix_index is not None else (PrefixIndex() if uses_prefix else None)
        )
        # Token mode (exact KV-event matching): prompts are tokenized locally before hashing.
        self.tokenizer = tokenizer
        self.retry_after_s = retry_after_s
        # Shared fleet state (router.state): told of every routed and completed request; it only
        # enqueues, never waits on Redis.  Set by the app after construction.
        self.state_sync: StateSync | None = None
        # Capacity of each replica in index blocks (from vllm:cache_config_info), when known.
        self.capacity_blocks: dict[str, int | None] = {}
        # Uncached prompt tokens sent to each replica whose prefill has not finished yet.
        self.pending_prefill_tokens: dict[str, int] = {}
        self._decision_seconds = metrics.decision_seconds.labels(policy.name)
        self._decisions: dict[str, LoopCounterChild] = {}
        self._aux_turn = 0

    # --- 1. the request ------------------------------------------------------------------------
    def resolve_model(self, requested: str | None) -> str:
        """The model a request is for; the only served model when the request names none."""
        models = self.fleet.models()
        if requested is not None and requested in models:
            return requested
        if not models:
            # Nothing discovered yet (fleet down or starting): we cannot call the model unknown.
            raise NoHealthyReplica(
                "no replica has reported its models yet", retry_after_s=self.retry_after_s
            )
        if requested is None:
            if len(models) == 1:
                return next(iter(models))
            raise BadRequest(
                "`model` is required: this router serves " + ", ".join(sorted(models)),
                param="model",
            )
        raise UnknownModel(requested)

    def prepare(
        self,
        endpoint: Endpoint,
        body: Mapping[str, Any],
        model: str,
        *,
        session_key: str | None = None,
    ) -> RouteContext:
        """Build the routing request once: block hashes, prompt length, prefix matches."""
        members = self.fleet.members(model)
        if endpoint in _ROUTED and self.uses_prefix:
            # Token-id prompts: true token count, blocks of units.tokens_per_block tokens.
            key = prompt_key(endpoint, body, model, self.units, tokenizer=self.tokenizer)
            hashes = key.block_hashes
            request = RoutingRequest(
                model=model,
                block_hashes=hashes,
                prompt_units=key.prompt_units,
                prompt_tokens=key.prompt_tokens,
                block_units=self.units.block_units,
                key_hash=key.key_hash,
                session_key=session_key,
                members=members,
            )
            index = self.prefix_index
            matches = index.match(model, hashes) if index is not None and hashes else _EMPTY
            return RouteContext(endpoint, request, matches)
        request = RoutingRequest(model=model, session_key=session_key, members=members)
        return RouteContext(endpoint, request, _EMPTY)

    # --- 2. the decision -----------------------------------------------------------------------
    def choose(self, ctx: RouteContext, exclude: Collection[str] = ()) -> Replica:
        """The replica for this attempt; NoHealthyReplica when no candidate is left."""
        model = ctx.request.model
        candidates = self.fleet.candidates(model, exclude)
        if not candidates:
            raise NoHealthyReplica(
                f"no healthy replica serves model `{model}`" + (" (all tried)" if exclude else ""),
                retry_after_s=self.retry_after_s,
            )
        if len(candidates) == 1 and not ctx.by_policy:
            return candidates[0]
        started = time.perf_counter()
        matches = ctx.matches
        capacity = self.capacity_blocks
        pending = self.pending_prefill_tokens
        index = self.prefix_index if ctx.by_policy else None
        views = [
            r.view(
                matches.get(r.replica_id, 0),
                capacity.get(r.replica_id),
                pending.get(r.replica_id, 0),
                index.holds(r.replica_id) if index is not None else 0,
            )
            for r in candidates
        ]
        if ctx.by_policy:
            decision = self.policy.choose(ctx.request, views)
            self._decision_seconds.observe(time.perf_counter() - started)
            counter = self._decisions.get(decision.reason)
            if counter is None:
                counter = self._decisions[decision.reason] = self.metrics.decisions.labels(
                    self.policy.name, decision.reason
                )
            counter.inc()
            chosen_id = decision.replica_id
        else:
            chosen_id = least_loaded(views, self._aux_turn).replica_id
            self._aux_turn += 1
        for replica in candidates:
            if replica.replica_id == chosen_id:
                return replica
        raise RuntimeError(f"policy {self.policy.name} chose {chosen_id!r}, not a candidate")

    # --- 3. side effects -----------------------------------------------------------------------
    def start(self, replica: Replica, ctx: RouteContext) -> Lease:
        """Account for a request being sent to `replica` (in-flight, prefix index, prefill)."""
        trial = replica.circuit.on_attempt()
        replica.acquire()
        lease = Lease(self, replica, ctx, trial)
        request = ctx.request
        if ctx.by_policy and request.block_hashes and self.prefix_index is not None:
            self.prefix_index.insert(request.model, request.block_hashes, replica.replica_id)
        if ctx.by_policy and self.state_sync is not None:
            self.state_sync.routed(
                request, replica.replica_id, ctx.matches.get(replica.replica_id, 0)
            )
        if request.prompt_tokens:
            matched = ctx.matches.get(replica.replica_id, 0)
            uncached = max(0, request.prompt_tokens - self.units.blocks_to_tokens(matched))
            if ctx.by_policy:  # predicted hit vs prompt tokens, beside the replica's observed ones
                self.metrics.prefix.observe_route(
                    self.policy.name,
                    replica.replica_id,
                    request.prompt_tokens,
                    request.prompt_tokens - uncached,
                )
            if uncached:
                lease._pending = uncached
                rid = replica.replica_id
                self.pending_prefill_tokens[rid] = (
                    self.pending_prefill_tokens.get(rid, 0) + uncached
                )
        return lease

    def _end_prefill(self, lease: Lease) -> None:
        if lease._pending:
            rid = lease.replica.replica_id
            left = self.pending_prefill_tokens.get(rid, 0) - lease._pending
            lease._pending = 0
            if left > 0:
                self.pending_prefill_tokens[rid] = left
            else:
                self.pending_prefill_tokens.pop(rid, None)

    def _finish(self, lease: Lease, verdict: bool | None, trial: bool) -> None:
        replica = lease.replica
        replica.release()
        self._end_prefill(lease)
        circuit = replica.circuit
        before = circuit.state
        if verdict is True:
            circuit.record_success()
            request = lease.ctx.request
            if (
                lease.ctx.by_policy
                and request.block_hashes
                and self.prefix_index is not None
                and self.fleet.get(replica.replica_id) is replica  # not removed meanwhile
            ):
                self.prefix_index.refresh(request.model, request.block_hashes, replica.replica_id)
                if self.state_sync is not None:
                    self.state_sync.completed(request, replica.replica_id)
        elif verdict is False:
            circuit.record_failure()
        elif trial:
            circuit.release_trial()
        if circuit.state is not before:
            self.fleet.publish(replica)

    # --- fleet observer -------------------------------------------------------------------------
    def replica_removed(self, replica_id: str) -> None:
        self.capacity_blocks.pop(replica_id, None)
        self.pending_prefill_tokens.pop(replica_id, None)
        if self.prefix_index is not None:
            self.prefix_index.remove_replica(replica_id)

    def replica_stats_changed(self, replica: Replica, previous: ScrapedStats) -> None:
        stats = replica.stats
        if stats.num_gpu_blocks is None or not stats.block_size:
            return
        capacity = self.units.capacity_blocks(stats.num_gpu_blocks, stats.block_size)
        if self.capacity_blocks.get(replica.replica_id) != capacity:
            self.capacity_blocks[replica.replica_id] = capacity
            if self.prefix_index is not None:
                self.prefix_index.set_capacity(replica.replica_id, capacity)
