"""What the router knows of one replica: identity, models, health, circuit, load."""

from __future__ import annotations

from typing import Any

from prometheus_client import Gauge

from router.fleet.circuit import CircuitBreaker, CircuitState
from router.fleet.stats import ScrapedStats
from router.metrics import RouterMetrics
from router.policies.base import ReplicaView

__all__ = ["Replica"]


class Replica:
    """Mutable state of one replica, owned by the `Fleet` and changed only on the event loop."""

    __slots__ = (
        "_in_flight_gauge",
        "circuit",
        "consecutive_health_failures",
        "healthy",
        "in_flight",
        "last_error",
        "model_cards",
        "models",
        "models_fetched_at",
        "replica_id",
        "source",
        "stats",
        "url",
    )

    def __init__(
        self,
        replica_id: str,
        url: str,
        *,
        circuit: CircuitBreaker,
        metrics: RouterMetrics,
        source: str = "static",
    ) -> None:
        self.replica_id = replica_id
        self.url = url
        # "static" (flags/config), "admin" (API), "sim" (embedded), "dns" (--discover-dns) or
        # "shared" (added by another router instance)
        self.source = source
        self.circuit = circuit
        self.models: frozenset[str] = frozenset()
        # The replica's own /v1/models entries (served again, merged, by our /v1/models).
        self.model_cards: dict[str, dict[str, Any]] = {}
        # When /v1/models last answered (health checker's clock); None before the first answer.
        self.models_fetched_at: float | None = None
        # Unknown until the first health check answers: not routable before that.
        self.healthy = False
        self.consecutive_health_failures = 0
        self.last_error: str | None = None
        self.in_flight = 0
        self.stats = ScrapedStats()
        # Read at scrape time: the hot path only moves a plain int (no lock, no label lookup).
        self._in_flight_gauge: Gauge = metrics.replica_in_flight.labels(replica_id)
        self._in_flight_gauge.set_function(lambda: self.in_flight)

    @property
    def up(self) -> bool:
        """Healthy and not ejected by its circuit breaker."""
        return self.healthy and self.circuit.state is not CircuitState.OPEN

    def accepts_requests(self) -> bool:
        """Whether a new request may be routed here right now."""
        return self.healthy and self.circuit.allows_request()

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def view(
        self,
        matched_blocks: int = 0,
        capacity_blocks: int | None = None,
        pending_prefill_tokens: int = 0,
        held_blocks: int = 0,
    ) -> ReplicaView:
        """An immutable snapshot for a policy."""
        stats = self.stats
        return ReplicaView(
            replica_id=self.replica_id,
            in_flight=self.in_flight,
            running=stats.running,
            waiting=stats.waiting,
            kv_usage=stats.kv_usage,
            capacity_blocks=capacity_blocks,
            matched_blocks=matched_blocks,
            pending_prefill_tokens=pending_prefill_tokens,
            held_blocks=held_blocks,
        )

    def describe(self) -> dict[str, Any]:
        """JSON-ready state, for the admin API."""
        stats = self.stats
        return {
            "id": self.replica_id,
            "url": self.url,
            "source": self.source,
            "models": sorted(self.models),
            "healthy": self.healthy,
            "up": self.up,
            "circuit": self.circuit.state.name.lower(),
            "in_flight": self.in_flight,
            "running": stats.running,
            "waiting": stats.waiting,
            "kv_usage": stats.kv_usage,
            "num_gpu_blocks": stats.num_gpu_blocks,
            "block_size": stats.block_size,
            "last_error": self.last_error,
        }
