"""One gateway's link to shared state: what it shares, and how it applies what others share.

`StateSync` sits between a gateway's routing core, prefix index and fleet on one side and a
`StateBackend` on the other:

- the routing core calls `routed` right after its index insert and `completed` after the
  refresh; both only enqueue (changes, counters, hot-prefix hits, evictions);
- as a fleet observer it turns scraped prefix-cache counters into deltas (observed hits and
  queries) and shares admin removals; `SharedFleet` shares admin additions;
- as the backend's `StateSink` it applies other instances' index changes to the local index and
  their admin changes to the local fleet, and fills snapshots from the local index.

Instances must name replicas alike (the URL, by default) for their indexes to line up; changes
about replicas this instance does not know are skipped (it could not route there anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from router.config import ReplicaSpec
from router.errors import RouterError
from router.fleet.registry import Fleet
from router.fleet.replica import Replica
from router.fleet.stats import ScrapedStats
from router.policies.base import RoutingRequest
from router.state.base import StateBackend
from router.state.records import (
    ChangeKind,
    IndexChange,
    RegistryChange,
    RegistryKind,
)

if TYPE_CHECKING:
    from router.core import RoutingCore

__all__ = ["SharedFleet", "StateSync"]

log = logging.getLogger(__name__)


class SharedFleet(Fleet):
    """A fleet whose admin changes (add/remove) are shared through a `StateSync`."""

    sync: StateSync | None = None

    def add(self, spec: ReplicaSpec, *, source: str = "static") -> Replica:
        replica = super().add(spec, source=source)
        if source == "admin" and self.sync is not None:
            self.sync.replica_added_locally(replica)
        return replica


class StateSync:
    """See the module docstring.  One per gateway; owns no task (the backend does)."""

    def __init__(self, backend: StateBackend, core: RoutingCore, fleet: Fleet) -> None:
        self.backend = backend
        self.core = core
        self.fleet = fleet
        self._applying = False
        # Per replica: the index's eviction count already accounted for (see `_evictions`).
        self._evictions_seen: dict[str, int] = {}
        self.skipped_changes = 0  # others' changes about replicas unknown here

    # -- request path (called by the routing core; only enqueues) ---------------------------

    def routed(self, request: RoutingRequest, replica_id: str, matched_blocks: int) -> None:
        """A request was sent to `replica_id` and its prompt inserted into the local index."""
        backend = self.backend
        units = self.core.units
        predicted = min(request.prompt_tokens, units.blocks_to_tokens(matched_blocks))
        backend.record_request(
            replica_id, prompt_tokens=request.prompt_tokens, predicted_hit_tokens=predicted
        )
        if request.block_hashes:
            backend.record_prefix_hit(request.model, request.block_hashes, matched_blocks)
            backend.publish_index(
                IndexChange(ChangeKind.INSERT, request.model, request.block_hashes, replica_id)
            )
            evicted = self._evictions(replica_id)
            if evicted:
                backend.record_eviction(replica_id, request.model, evicted)

    def completed(self, request: RoutingRequest, replica_id: str) -> None:
        """The replica finished the request and the local index refreshed its blocks."""
        self.backend.publish_index(
            IndexChange(ChangeKind.REFRESH, request.model, request.block_hashes, replica_id)
        )
        evicted = self._evictions(replica_id)  # a refresh can restore blocks, then evict others
        if evicted:
            self.backend.record_eviction(replica_id, request.model, evicted)

    def _evictions(self, replica_id: str) -> int:
        """Blocks the index evicted for `replica_id` since last asked (never negative)."""
        index = self.core.prefix_index
        if index is None:
            return 0
        now = index.evictions_of(replica_id)  # O(1): this runs twice per request
        before = self._evictions_seen.get(replica_id, 0)
        self._evictions_seen[replica_id] = now
        return max(0, now - before)  # below: the replica was removed and came back

    # -- fleet observer ------------------------------------------------------------------------

    def replica_removed(self, replica_id: str) -> None:
        self._evictions_seen.pop(replica_id, None)
        if not self._applying:
            # index first: others skip index changes about replicas they no longer know
            self.backend.publish_index(IndexChange(ChangeKind.REMOVE_REPLICA, "", (), replica_id))
            self.backend.publish_registry(RegistryChange(RegistryKind.REMOVE, replica_id))

    def replica_stats_changed(self, replica: Replica, previous: ScrapedStats) -> None:
        stats = replica.stats
        hits = stats.prefix_hit_tokens - previous.prefix_hit_tokens
        queries = stats.prefix_query_tokens - previous.prefix_query_tokens
        if queries < 0 or hits < 0:  # the replica restarted: its counters began again
            hits, queries = stats.prefix_hit_tokens, stats.prefix_query_tokens
        if hits or queries:
            self.backend.record_observed(
                replica.replica_id, hit_tokens=round(hits), query_tokens=round(queries)
            )

    def replica_added_locally(self, replica: Replica) -> None:
        self.backend.publish_registry(
            RegistryChange(RegistryKind.ADD, replica.replica_id, replica.url)
        )

    # -- StateSink: others' changes --------------------------------------------------------------

    def apply_index_change(self, change: IndexChange) -> None:
        index = self.core.prefix_index
        rid = change.replica_id
        if index is None or self.fleet.get(rid) is None:
            self.skipped_changes += 1
            return
        kind = change.kind
        if kind is ChangeKind.INSERT or kind is ChangeKind.REFRESH:
            index.insert(change.model, change.block_hashes, rid)
        elif kind is ChangeKind.EVICT:
            index.remove_blocks(change.model, change.block_hashes, rid)
        else:
            index.clear_replica(rid)
        # Evictions this caused mirror the publisher's own (which it recorded): not ours to count.
        self._evictions(rid)

    def apply_registry_change(self, change: RegistryChange) -> None:
        fleet = self.fleet
        self._applying = True
        try:
            if change.kind is RegistryKind.ADD:
                known = fleet.get(change.replica_id)
                if known is None and not any(r.url == change.url for r in fleet):
                    fleet.add(ReplicaSpec(change.replica_id, change.url), source="shared")
                    log.info("replica %s added by instance %s", change.replica_id, change.origin)
            elif fleet.get(change.replica_id) is not None:
                fleet.remove(change.replica_id)
                log.info("replica %s removed by instance %s", change.replica_id, change.origin)
        except RouterError as exc:  # e.g. a conflicting local replica: keep ours, say why
            log.warning("ignoring shared registry change %s: %s", change, exc)
        finally:
            self._applying = False

    def snapshot_holdings(self) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        index = self.core.prefix_index
        if index is not None:
            yield from index.holdings()  # oldest first, so a replay rebuilds the LRU order
