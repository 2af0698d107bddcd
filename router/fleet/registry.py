"""The fleet: every replica the router knows, indexed by id and by model."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol

from router.config import ReplicaSpec
from router.errors import Conflict, NotFound
from router.fleet.circuit import CircuitBreaker
from router.fleet.replica import Replica
from router.fleet.stats import ScrapedStats
from router.metrics import RouterMetrics

__all__ = ["Fleet", "FleetObserver"]


class FleetObserver(Protocol):
    """Who must hear of fleet changes beyond the fleet (the routing core, for its prefix index)."""

    def replica_removed(self, replica_id: str) -> None: ...

    def replica_stats_changed(self, replica: Replica, previous: ScrapedStats) -> None: ...


class Fleet:
    """Replicas by id, plus a per-model index rebuilt whenever membership or models change."""

    def __init__(
        self, *, metrics: RouterMetrics, circuit_factory: Callable[[], CircuitBreaker]
    ) -> None:
        self._metrics = metrics
        self._circuit_factory = circuit_factory
        self._replicas: dict[str, Replica] = {}
        self._serving: dict[str, tuple[Replica, ...]] = {}
        self._members: dict[str, tuple[str, ...]] = {}
        self._models: frozenset[str] = frozenset()
        self.observers: list[FleetObserver] = []

    # --- membership -------------------------------------------------------------------------
    def add(self, spec: ReplicaSpec, *, source: str = "static") -> Replica:
        """Register a replica (not routable until a health check passes)."""
        if spec.replica_id in self._replicas:
            raise Conflict(f"replica {spec.replica_id!r} is already registered")
        if any(r.url == spec.url for r in self._replicas.values()):
            raise Conflict(f"a replica with URL {spec.url} is already registered")
        replica = Replica(
            spec.replica_id,
            spec.url,
            circuit=self._circuit_factory(),
            metrics=self._metrics,
            source=source,
        )
        self._replicas[spec.replica_id] = replica
        self._reindex()
        self.publish(replica)
        return replica

    def remove(self, replica_id: str) -> Replica:
        """Forget a replica; requests already sent to it finish normally."""
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            raise NotFound(f"no replica {replica_id!r}", param="id")
        self._reindex()
        self._metrics.forget_replica(replica_id)
        for observer in self.observers:
            observer.replica_removed(replica_id)
        return replica

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    # --- what replicas learn ------------------------------------------------------------------
    def set_models(self, replica: Replica, cards: list[dict[str, Any]]) -> None:
        """Record the models a replica serves (from its /v1/models)."""
        models = {str(c["id"]): c for c in cards if isinstance(c.get("id"), str)}
        if frozenset(models) != replica.models:
            replica.models = frozenset(models)
            self._reindex()
        replica.model_cards = models

    def set_stats(self, replica: Replica, stats: ScrapedStats) -> None:
        previous, replica.stats = replica.stats, stats
        m = self._metrics
        rid = replica.replica_id
        m.replica_running.labels(rid).set(stats.running)
        m.replica_waiting.labels(rid).set(stats.waiting)
        m.replica_kv_usage.labels(rid).set(stats.kv_usage)
        m.replica_observed_hit_tokens.labels(rid).set(stats.prefix_hit_tokens)
        m.replica_observed_query_tokens.labels(rid).set(stats.prefix_query_tokens)
        for observer in self.observers:
            observer.replica_stats_changed(replica, previous)

    def publish(self, replica: Replica) -> None:
        """Refresh the replica's up/circuit gauges (state changes lazily with time)."""
        if replica.replica_id not in self._replicas:
            return
        self._metrics.replica_up.labels(replica.replica_id).set(1 if replica.up else 0)
        self._metrics.circuit_state.labels(replica.replica_id).set(int(replica.circuit.state))

    # --- lookups on the hot path ----------------------------------------------------------------
    def models(self) -> frozenset[str]:
        """Every model some registered replica has advertised."""
        return self._models

    def serving(self, model: str) -> tuple[Replica, ...]:
        """Replicas advertising `model`, up or not."""
        return self._serving.get(model, ())

    def members(self, model: str) -> tuple[str, ...]:
        """Sorted ids of the replicas advertising `model` (stable input for hash rings)."""
        return self._members.get(model, ())

    def candidates(self, model: str, exclude: Collection[str] = ()) -> list[Replica]:
        """Replicas that serve `model`, accept requests now and are not in `exclude`."""
        return [
            r
            for r in self._serving.get(model, ())
            if r.accepts_requests() and r.replica_id not in exclude
        ]

    def up_models(self) -> dict[str, list[Replica]]:
        """Models with at least one replica up, and those replicas."""
        out: dict[str, list[Replica]] = {}
        for model, replicas in self._serving.items():
            up = [r for r in replicas if r.up]
            if up:
                out[model] = up
        return out

    def _reindex(self) -> None:
        serving: dict[str, list[Replica]] = {}
        for replica in self._replicas.values():
            for model in replica.models:
                serving.setdefault(model, []).append(replica)
        self._serving = {m: tuple(rs) for m, rs in serving.items()}
        # Read by every request (RoutingCore.resolve_model): built here, not per call.
        self._models = frozenset(serving)
        self._members = {m: tuple(sorted(r.replica_id for r in rs)) for m, rs in serving.items()}
