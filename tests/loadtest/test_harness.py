"""The measurement harness's pure parts: decision counts and the headless routing node.

Their HTTP parts (fresh fleets, ready gateways) run in test_compare_demo.py and
tests/integration/test_cache_routing.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from loadtest.quality import decision_counts
from loadtest.routing_node import routing_node
from router.config import ReplicaSpec
from router.metrics import RouterMetrics
from router.state import MemoryBackend

SPECS = (ReplicaSpec("r0", "http://127.0.0.1:40000"), ReplicaSpec("r1", "http://127.0.0.1:40001"))


def test_decision_counts_sum_reasons_over_policies() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    metrics.decisions.labels(policy="kv_aware", reason="prefix_hit").inc(3)
    metrics.decisions.labels(policy="round_robin", reason="prefix_hit").inc()
    metrics.decisions.labels(policy="kv_aware", reason="spread").inc(2)
    assert decision_counts(metrics.registry) == {"prefix_hit": 4.0, "spread": 2.0}
    assert decision_counts(RouterMetrics(CollectorRegistry()).registry) == {}


def test_routing_node_is_wired_like_a_gateway() -> None:
    node = routing_node(MemoryBackend(), SPECS, policy="round_robin")
    assert [r.replica_id for r in node.fleet] == ["r0", "r1"]
    assert node.backend is node.sync.backend
    hashes = (11, 12, 13)
    node.index.insert("m", hashes, "r0")
    node.index.insert("m", hashes, "r1")
    assert node.index.match("m", hashes) == {"r0": 3, "r1": 3}
    # The core observes the fleet: a removed replica's blocks leave the prefix index.
    node.fleet.remove("r0")
    assert node.index.match("m", hashes) == {"r1": 3}
    # A second node is independent (no shared module state).
    other = routing_node(MemoryBackend(), SPECS)
    assert other.index.match("m", hashes) == {}
