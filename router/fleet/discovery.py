"""DNS discovery: the replicas behind a name, re-resolved on a timer (`--discover-dns`).

A Kubernetes headless Service publishes one A (or AAAA) record per *ready* pod, so resolving
`sim-replica.<namespace>.svc.cluster.local` lists the replicas that may take traffic now.  Every
`interval_s`, `DnsDiscovery` resolves each target with the event loop's resolver
(`loop.getaddrinfo`, which runs in the loop's executor, never blocking the loop) and reconciles
the fleet:

- a new address becomes the replica `http://ADDRESS:PORT` (id = that URL, source "dns"), probed
  at once (health and models, as an admin addition is) and, in exact mode (`kv_events_port`),
  subscribed to at `tcp://ADDRESS:KV_PORT` as soon as its model is known;
- an address missing from `grace_rounds` answers in a row is removed with `Fleet.remove`, so the
  routing core, the prefix index, the KV-event consumer and shared state hear of it exactly as
  of an admin removal; requests already sent to it finish;
- a failed resolution (error, timeout) changes nothing: it is logged and counted in
  `fleet_router_discovery_errors_total{target}`.

The decision is the pure function `reconcile`; `DnsDiscovery` only resolves, applies and counts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType

from router.config import DnsTarget, ReplicaSpec
from router.errors import RouterError
from router.fleet.registry import Fleet
from router.fleet.replica import Replica
from router.metrics import RouterMetrics
from router.prefix.kv_events import KvEventConsumer
from router.prefix.kv_spec import KvEventSource
from router.tasks import stop_task

__all__ = [
    "DnsDiscovery",
    "Reconciliation",
    "Resolver",
    "reconcile",
    "resolve_addresses",
]

log = logging.getLogger(__name__)

# (host, port) → the IP addresses it resolves to now; raises when it cannot resolve.
Resolver = Callable[[str, int], Awaitable[Iterable[str]]]
# Probe a replica just registered (the health checker's `check`: health, then models).
Probe = Callable[[Replica], Awaitable[None]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, through the running loop's `getaddrinfo` (the system
    resolver in an executor thread: /etc/hosts, search domains and the cluster DNS all apply)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """What one round changes for one target: URLs to register, URLs to forget, and how many
    answers in a row each remaining registered URL has been missing from (absent = 0)."""

    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    missing: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


def reconcile(
    resolved: Collection[str] | None,
    owned: Collection[str],
    taken: Collection[str],
    missing: Mapping[str, int],
    grace_rounds: int,
) -> Reconciliation:
    """One round of reconciliation for one target, on plain values.

    `resolved`: the replica URLs the name resolves to now, or None when resolution failed (then
    nothing changes).  `owned`: URLs this target registered that the fleet still holds.
    `taken`: URLs registered otherwise (flags, admin API, another target): never added twice.
    `missing`: the previous round's counters.  An owned URL is removed once it has been missing
    from `grace_rounds` answers in a row; one that reappears starts again from zero.
    """
    if resolved is None:
        kept = {url: missing[url] for url in owned if missing.get(url, 0) > 0}
        return Reconciliation(missing=MappingProxyType(kept))
    desired = set(resolved)
    add = sorted(desired.difference(owned, taken))
    remove: list[str] = []
    still: dict[str, int] = {}
    for url in sorted(set(owned) - desired):
        rounds = missing.get(url, 0) + 1
        if rounds >= grace_rounds:
            remove.append(url)
        else:
            still[url] = rounds
    return Reconciliation(tuple(add), tuple(remove), MappingProxyType(still))


class DnsDiscovery:
    """Keeps the fleet's "dns" replicas in step with what `targets` resolve to.

    An async context manager: entering runs one round (so a router is ready as soon as it
    serves) and starts the periodic loop; leaving cancels and awaits it.  Use `discover_all` to
    run a round by hand.
    """

    def __init__(
        self,
        fleet: Fleet,
        targets: Sequence[DnsTarget],
        *,
        metrics: RouterMetrics,
        interval_s: float = 5.0,
        grace_rounds: int = 2,
        resolver: Resolver = resolve_addresses,
        probe: Probe | None = None,
        kv_events: KvEventConsumer | None = None,
        kv_events_port: int | None = None,
    ) -> None:
        if interval_s <= 0 or grace_rounds < 1:
            raise ValueError("interval_s must be > 0 and grace_rounds >= 1")
        self._fleet = fleet
        self._metrics = metrics
        self._interval_s = interval_s
        self._grace_rounds = grace_rounds
        self._resolver = resolver
        self._probe = probe
        self._kv_events = kv_events if kv_events_port is not None else None
        self._kv_events_port = kv_events_port
        # Per target: the URLs it registered → the address each came from; missing counters.
        self._owned: dict[DnsTarget, dict[str, str]] = {t: {} for t in targets}
        self._missing: dict[DnsTarget, Mapping[str, int]] = {t: {} for t in targets}
        self._task: asyncio.Task[None] | None = None
        self.rounds = 0  # completed rounds (all targets), for tests and the curious

    @property
    def targets(self) -> tuple[DnsTarget, ...]:
        return tuple(self._owned)

    def replicas(self, target: DnsTarget) -> tuple[str, ...]:
        """The replica ids (URLs) `target` registered that the fleet still holds."""
        return tuple(sorted(self._current(target)))

    async def __aenter__(self) -> DnsDiscovery:
        await self.discover_all()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="fleet-router-dns-discovery"
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        await stop_task(task)

    async def discover_all(self) -> None:
        """One round: resolve every target, reconcile, probe newcomers, subscribe KV events."""
        await asyncio.gather(*(self.discover(target) for target in self._owned))
        self._subscribe_kv_events()
        self.rounds += 1

    async def discover(self, target: DnsTarget) -> Reconciliation:
        """Resolve `target` once and apply the reconciliation to the fleet (never raises)."""
        addresses = await self._resolve(target)
        resolved = None if addresses is None else {target.replica_url(a): a for a in addresses}
        owned = self._current(target)
        taken = {r.url for r in self._fleet} - owned.keys()
        plan = reconcile(resolved, owned, taken, self._missing[target], self._grace_rounds)
        self._missing[target] = plan.missing
        for url in plan.remove:
            self._fleet.remove(url)  # observers: routing core, KV events, shared state
            del owned[url]
            log.info("dns %s: %s no longer resolves: removed", target, url)
        added: list[Replica] = []
        for url in plan.add:
            assert resolved is not None  # additions only come from an answer
            try:
                added.append(self._fleet.add(ReplicaSpec(url, url), source="dns"))
            except RouterError as exc:  # e.g. an admin replica took the id meanwhile
                log.warning("dns %s: cannot register %s: %s", target, url, exc)
                continue
            owned[url] = resolved[url]
            log.info("dns %s: %s resolves: added", target, url)
        self._metrics.discovery_replicas.labels(str(target)).set(len(owned))
        if added and self._probe is not None:
            await asyncio.gather(*(self._probe(r) for r in added))
        return plan

    # ------------------------------------------------------------------ internals

    def _current(self, target: DnsTarget) -> dict[str, str]:
        """The target's URLs still in the fleet as "dns" replicas (one removed elsewhere, by the
        admin API or another router through shared state, is forgotten: re-added if it
        resolves)."""
        owned = self._owned[target]
        for url in list(owned):
            replica = self._fleet.get(url)
            if replica is None or replica.source != "dns":
                del owned[url]
        return owned

    async def _resolve(self, target: DnsTarget) -> list[str] | None:
        """The addresses `target` resolves to, or None on any failure (counted, logged).  A round
        never outlasts the interval: a resolver slower than that is a failure."""
        try:
            answer = await asyncio.wait_for(
                self._resolver(target.host, target.port), self._interval_s
            )
            addresses = sorted({str(a) for a in answer})
            for address in addresses:  # only IP literals become URLs
                ipaddress.ip_address(address.partition("%")[0])
        except Exception as exc:  # any failure of a resolver is one failed round
            self._metrics.discovery_errors.labels(str(target)).inc()
            log.warning("dns %s: resolution failed, keeping its replicas: %r", target, exc)
            return None
        return addresses

    def _subscribe_kv_events(self) -> None:
        """Exact mode: follow the KV events of every discovered replica whose model is known
        (its engine's events carry no model name) and that is not followed yet."""
        consumer, port = self._kv_events, self._kv_events_port
        if consumer is None or port is None:
            return
        followed = {source.replica_id for source in consumer.sources}
        for owned in self._owned.values():
            for url, address in owned.items():
                replica = self._fleet.get(url)
                if url in followed or replica is None or not replica.models:
                    continue
                host = f"[{address}]" if ":" in address else address
                consumer.add(
                    KvEventSource(url, f"tcp://{host}:{port}", model=sorted(replica.models)[0])
                )
                log.info("dns: following KV events of %s at tcp://%s:%d", url, host, port)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.discover_all()
            except Exception:  # a bug in one round must not end discovery for good
                log.exception("DNS discovery round failed")
