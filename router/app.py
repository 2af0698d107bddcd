"""Assemble one gateway: `create_app(config)` and `running_gateway(config)`.

Every resource is paired with its teardown in an aiohttp cleanup context, in this order (torn
down in reverse): embedded sim replicas → the upstream pool, control session and proxy → the
first health round → background loops (health checks, metrics scraping) → KV events → DNS
discovery.  The aiohttp application is the control plane; clients reach it, and the data plane,
through the edge server `running_gateway` puts in front of it (router.http.edge).
No state lives in module globals: each app carries its own fleet, metrics registry and sessions
under typed `AppKey`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from router.config import ReplicaSpec, RouterConfig
from router.core import RoutingCore
from router.fleet.circuit import CircuitBreaker
from router.fleet.discovery import DnsDiscovery, Resolver, resolve_addresses
from router.fleet.health import HealthChecker
from router.fleet.registry import Fleet
from router.fleet.scraper import MetricsScraper
from router.http.admin import add_admin_routes
from router.http.appstate import STATE, GatewayState
from router.http.dispatch import Dispatch
from router.http.edge import EdgeServer
from router.http.errors import error_middleware
from router.http.openai import add_openai_routes
from router.http.ops import add_ops_routes
from router.metrics import RouterMetrics
from router.policies import POLICIES, PolicySettings, make_policy
from router.prefix.exact import ExactIndexer
from router.prefix.index import IndexSettings, PrefixIndex
from router.prefix.kv_events import KvEventConsumer
from router.prefix.kv_spec import kv_event_sources
from router.prefix.tokenizer import load_routing_tokenizer
from router.prefix.units import KeyUnits
from router.proxy.deadlines import Deadlines
from router.proxy.forward import Proxy
from router.proxy.retry import ExponentialBackoff, RetryPolicy, Timeouts
from router.proxy.upstream import Origin, UpstreamPool
from router.state import SHARED_STATE, SharedFleet, StateSync, make_backend, shared_state_context

__all__ = [
    "DNS_DISCOVERY",
    "KV_EVENTS",
    "STATE",
    "Gateway",
    "GatewayState",
    "create_app",
    "running_gateway",
]

log = logging.getLogger("router")

# Exact mode's KV-event consumer, when configured.
KV_EVENTS = web.AppKey("fleet_router_kv_events", KvEventConsumer)
# `--discover-dns`: the loop keeping the fleet's "dns" replicas in step with DNS.
DNS_DISCOVERY = web.AppKey("fleet_router_dns_discovery", DnsDiscovery)


@dataclass(frozen=True, slots=True)
class Gateway:
    """A running gateway (from `running_gateway`)."""

    url: str
    app: web.Application
    state: GatewayState
    edge: EdgeServer

    @property
    def fleet(self) -> Fleet:
        return self.state.fleet


def create_app(config: RouterConfig, *, dns_resolver: Resolver | None = None) -> web.Application:
    """A gateway application for `config` (start it with any aiohttp runner).  `dns_resolver`
    replaces the system resolver of `--discover-dns` (tests point names at chosen addresses)."""
    metrics = RouterMetrics(CollectorRegistry(auto_describe=True))
    fleet = SharedFleet(  # a Fleet whose admin changes are shared (router.state)
        metrics=metrics,
        circuit_factory=lambda: CircuitBreaker(
            config.circuit_failure_threshold, config.circuit_open_s, config.circuit_half_open_trials
        ),
    )
    spec = POLICIES.get(config.policy)
    policy = make_policy(
        config.policy,
        PolicySettings(
            seed=config.seed, block_units=config.block_units, options=config.policy_options
        ),
    )
    # Prefix index, token mode and exact mode: see docs/routing.md.
    uses_prefix = spec.uses_prefix if spec is not None else True
    tokenizer = load_routing_tokenizer(config.tokenizer) if config.tokenizer else None
    core = RoutingCore(
        fleet=fleet,
        policy=policy,
        metrics=metrics,
        uses_prefix=uses_prefix,
        units=KeyUnits.token_mode(config.block_units)
        if tokenizer is not None
        else KeyUnits(block_units=config.block_units, units_per_token=config.chars_per_token),
        prefix_index=PrefixIndex(
            IndexSettings(
                default_capacity_blocks=config.prefix_capacity_blocks,
                max_blocks=config.prefix_max_blocks,
            )
        )
        if uses_prefix or config.kv_events or config.discover_dns_kv_events_port
        else None,
        tokenizer=tokenizer,
        retry_after_s=config.retry_after_s,
    )
    if core.prefix_index is not None:
        metrics.prefix.watch_index(core.prefix_index)
    fleet.observers.append(core)
    # Shared fleet state: in-process, or Redis with --redis-url (docs/redis.md).
    sync = StateSync(make_backend(config.redis_url, config.redis_prefix), core, fleet)
    core.state_sync = fleet.sync = sync
    fleet.observers.append(sync)
    metrics.watch_state_backend(sync.backend)
    for replica_spec in config.replica_specs:
        fleet.add(replica_spec, source="static")

    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[error_middleware])
    app[STATE] = GatewayState(config=config, metrics=metrics, fleet=fleet, core=core)
    app[SHARED_STATE] = sync
    app.cleanup_ctx.append(_embedded_sims)
    # After the sims (they are replicas to sync about), before the first health round (replicas
    # added on other instances get probed with the rest); stopped after the loops, so it flushes.
    app.cleanup_ctx.append(shared_state_context)
    app.cleanup_ctx.append(_client_sessions)
    app.cleanup_ctx.append(_background_loops)
    app.cleanup_ctx.append(_kv_events)
    app.cleanup_ctx.append(
        functools.partial(_dns_discovery, resolver=dns_resolver or resolve_addresses)
    )
    add_openai_routes(app)
    add_ops_routes(app)
    if config.admin_token is not None:
        add_admin_routes(app)
    return app


async def _embedded_sims(app: web.Application) -> AsyncIterator[None]:
    """The zero-configuration default: N simulated replicas in this process."""
    state = app[STATE]
    count = state.config.embedded_sim_replicas
    if count:
        from replicas.sim import SimSettings, start_replica  # only the embedded default needs it

        cfg = state.config
        base = SimSettings(port=0, time_scale=cfg.sim_time_scale)
        if cfg.sim_model:
            base = base.replace(model=cfg.sim_model)
        for i in range(count):
            settings = base.replace(seed=i)
            sim = await start_replica(settings)
            state.sims.append(sim)
            state.fleet.add(ReplicaSpec(replica_id=sim.url, url=sim.url), source="sim")
        log.info(
            "no replica configured: started %d simulated replicas in-process (model %s, "
            "time_scale %g): %s",
            count,
            base.model,
            cfg.sim_time_scale,
            ", ".join(s.url for s in state.sims),
        )
    try:
        yield
    finally:
        for sim in reversed(state.sims):
            await sim.stop()
        state.sims.clear()


async def _client_sessions(app: web.Application) -> AsyncIterator[None]:
    """The proxy's connection pool (router.proxy.upstream, sized for thousands of concurrent
    streams) and a small aiohttp session for health checks and scrapes, so probes never queue
    behind traffic."""
    state = app[STATE]
    cfg = state.config
    pool = UpstreamPool(
        connect_timeout_s=cfg.connect_timeout_s,
        limit=cfg.max_connections,
        limit_per_origin=cfg.max_connections_per_replica,
    )
    scrape_pool = UpstreamPool(connect_timeout_s=cfg.scrape_timeout_s, limit_per_origin=2)
    control_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=64, ttl_dns_cache=300),
        timeout=aiohttp.ClientTimeout(total=max(cfg.health_timeout_s, cfg.scrape_timeout_s)),
    )
    state.loop = asyncio.get_running_loop()
    deadlines = Deadlines()
    deadlines.start()
    state.proxy = Proxy(
        core=state.core,
        pool=pool,
        deadlines=deadlines,
        timeouts=Timeouts(
            connect_s=cfg.connect_timeout_s,
            first_byte_s=cfg.first_byte_timeout_s,
            idle_s=cfg.idle_timeout_s,
            total_s=cfg.total_timeout_s,
        ),
        retry=RetryPolicy(
            max_retries=cfg.max_retries,
            backoff=ExponentialBackoff(
                cfg.retry_backoff_base_s, cfg.retry_backoff_max_s, random.Random(cfg.seed)
            ),
        ),
        metrics=state.metrics,
    )
    state.health = HealthChecker(
        state.fleet,
        control_session,
        timeout_s=cfg.health_timeout_s,
        models_refresh_interval_s=cfg.models_refresh_interval_s,
    )
    if cfg.scrape_interval_s > 0:
        state.scraper = MetricsScraper(
            state.fleet,
            scrape_pool,
            timeout_s=cfg.scrape_timeout_s,
        )
    try:
        yield
    finally:
        await deadlines.stop()
        await pool.close()
        await scrape_pool.close()
        await control_session.close()
        state.proxy = state.health = state.scraper = None


async def _background_loops(app: web.Application) -> AsyncIterator[None]:
    """Probe every replica once before serving (so a healthy fleet is ready at once), then run
    the health-check and scrape loops until the app stops."""
    state = app[STATE]
    cfg = state.config
    assert state.health is not None
    health = state.health
    await health.check_all()
    up = sum(1 for r in state.fleet if r.up)
    log.info("fleet: %d of %d replicas up; models: %s", up, len(state.fleet),
             ", ".join(sorted(state.fleet.models())) or "none yet")  # fmt: skip
    loops: list[tuple[str, Callable[[], Awaitable[None]], float]] = [
        ("health", health.check_all, cfg.health_interval_s)
    ]
    if state.scraper is not None:
        await state.scraper.scrape_all()
        loops.append(("scrape", state.scraper.scrape_all, cfg.scrape_interval_s))
    tasks = [
        asyncio.create_task(_every(interval, tick, name), name=f"fleet-router-{name}")
        for name, tick, interval in loops
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _kv_events(app: web.Application) -> AsyncIterator[None]:
    """Exact mode: consume the configured replicas' KV events into the prefix index (after the
    first health round, which discovered the model each replica serves)."""
    state = app[STATE]
    cfg = state.config
    index = state.core.prefix_index
    if not (cfg.kv_events or cfg.discover_dns_kv_events_port) or index is None:
        yield
        return

    def model_of(replica_id: str) -> str | None:
        replica = state.fleet.get(replica_id)
        if replica is not None and replica.models:
            return sorted(replica.models)[0]
        return cfg.models[0] if cfg.models else None

    sources, skipped = kv_event_sources(cfg.kv_events, model_of)
    if skipped:
        log.warning("exact mode: no model known yet for %s; their KV events are not consumed",
                    ", ".join(skipped))  # fmt: skip
    consumer = KvEventConsumer(
        ExactIndexer(index),
        on_events=state.metrics.prefix.kv_events_applied,
        on_gap=state.metrics.prefix.kv_event_gap,
    )
    async with consumer:
        for source in sources:
            consumer.add(source)
        app[KV_EVENTS] = consumer
        # A replica removed from the fleet (admin API, shared state) is no longer consumed.
        state.fleet.observers.append(consumer)
        try:
            yield
        finally:
            state.fleet.observers.remove(consumer)


async def _dns_discovery(app: web.Application, *, resolver: Resolver) -> AsyncIterator[None]:
    """`--discover-dns`: register what the names resolve to before serving, then follow DNS
    (after the KV-event consumer, which discovered replicas in exact mode join)."""
    state = app[STATE]
    cfg = state.config
    if not cfg.discover_dns:
        yield
        return
    assert state.health is not None
    discovery = DnsDiscovery(
        state.fleet,
        cfg.dns_targets,
        metrics=state.metrics,
        interval_s=cfg.discover_dns_interval_s,
        grace_rounds=cfg.discover_dns_grace_rounds,
        resolver=resolver,
        probe=state.health.check,
        kv_events=app.get(KV_EVENTS),
        kv_events_port=cfg.discover_dns_kv_events_port,
    )
    async with discovery:
        app[DNS_DISCOVERY] = discovery
        log.info("dns discovery: %s", ", ".join(
            f"{t} → {len(discovery.replicas(t))} replicas" for t in discovery.targets))  # fmt: skip
        yield


async def _every(interval_s: float, tick: Callable[[], Awaitable[None]], name: str) -> None:
    """Run `tick` every `interval_s`; one failed round is logged, never fatal to the loop."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await tick()
        except Exception:
            log.exception("background %s round failed", name)


@contextlib.asynccontextmanager
async def running_gateway(
    config: RouterConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    dns_resolver: Resolver | None = None,
    reuse_port: bool = False,
) -> AsyncIterator[Gateway]:
    """Run a gateway for `config` on `host:port` (0 = a free port) until the block exits; on exit
    it stops accepting and lets in-flight requests finish for up to `config.drain_timeout_s`.

    Clients talk to the edge server (router.http.edge): it answers the OpenAI endpoints itself
    and relays every other request to the aiohttp application, which listens only on a Unix
    socket in a private directory and owns every resource (its cleanup contexts)."""
    app = create_app(config, dns_resolver=dns_resolver)
    state = app[STATE]
    runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    socket_dir = tempfile.mkdtemp(prefix="fleet-router-")
    try:
        control_path = os.path.join(socket_dir, "control.sock")
        await web.UnixSite(runner, control_path).start()
        relay_pool = UpstreamPool(connect_timeout_s=5.0)
        edge = EdgeServer(
            Dispatch(state, relay_pool, Origin.unix(control_path)),
            max_body_bytes=config.max_body_bytes,
            access_log=logging.getLogger("router.access") if config.access_log else None,
        )
        bound_port = await edge.start(host, port, reuse_port=reuse_port)
        try:
            yield Gateway(url=f"http://{host}:{bound_port}", app=app, state=state, edge=edge)
        finally:
            # /ready says 503 to whoever still asks while the requests in flight finish.
            state.draining = True
            log.info("shutting down: draining in-flight requests (up to %gs)",
                     config.drain_timeout_s)  # fmt: skip
            await edge.shutdown(config.drain_timeout_s)
            await relay_pool.close()
    finally:
        await runner.cleanup()
        shutil.rmtree(socket_dir, ignore_errors=True)
