"""A gateway's routing core without its HTTP server: fleet, prefix index, policy, shared state.

:func:`routing_node` wires the objects as ``router.app.create_app`` does (the core and the
:class:`~router.state.StateSync` observe the fleet; the sync is the fleet's and hears of every
routed request), so a caller can drive decisions and their side effects request by request,
with no sockets and no clock: ``benchmarks/redis_state.py`` measures the shared-state cost on
the request path this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from router.config import ReplicaSpec
from router.core import RoutingCore
from router.fleet.circuit import CircuitBreaker
from router.metrics import RouterMetrics
from router.policies import PolicySettings, make_policy
from router.prefix.index import IndexSettings, PrefixIndex
from router.prefix.units import KeyUnits
from router.state import SharedFleet, StateBackend, StateSync

__all__ = ["RoutingNode", "routing_node"]


@dataclass(frozen=True, slots=True)
class RoutingNode:
    """What one gateway instance builds around its state backend."""

    fleet: SharedFleet
    core: RoutingCore
    index: PrefixIndex
    sync: StateSync

    @property
    def backend(self) -> StateBackend:
        return self.sync.backend


def routing_node(
    backend: StateBackend,
    replicas: Sequence[ReplicaSpec],
    *,
    policy: str = "kv_aware",
    index: IndexSettings | None = None,
    block_units: int = 64,
    seed: int = 1,
) -> RoutingNode:
    """A node sharing its state through ``backend`` (not started: ``await backend.start(sync)``)."""
    metrics = RouterMetrics(CollectorRegistry())
    fleet = SharedFleet(metrics=metrics, circuit_factory=lambda: CircuitBreaker(3, 1.0, 1))
    for spec in replicas:
        fleet.add(spec)
    prefix_index = PrefixIndex(index or IndexSettings())
    core = RoutingCore(
        fleet=fleet,
        policy=make_policy(policy, PolicySettings(seed=seed, block_units=block_units)),
        metrics=metrics,
        uses_prefix=True,
        units=KeyUnits(block_units=block_units),
        prefix_index=prefix_index,
    )
    sync = StateSync(backend, core, fleet)
    core.state_sync = fleet.sync = sync
    fleet.observers += [core, sync]
    return RoutingNode(fleet, core, prefix_index, sync)
