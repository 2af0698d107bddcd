"""The typed application state of one gateway (no module globals: two gateways can coexist)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from router.config import RouterConfig
from router.core import RoutingCore
from router.fleet.health import HealthChecker
from router.fleet.registry import Fleet
from router.fleet.scraper import MetricsScraper
from router.metrics import RouterMetrics
from router.proxy.forward import Proxy

__all__ = ["STATE", "GatewayState"]


@dataclass(slots=True)
class GatewayState:
    """Everything one gateway's handlers need; `proxy` and `health` exist once it has started."""

    config: RouterConfig
    metrics: RouterMetrics
    fleet: Fleet
    core: RoutingCore
    proxy: Proxy | None = None
    health: HealthChecker | None = None
    scraper: MetricsScraper | None = None
    draining: bool = False
    # In-process sim replicas of the embedded default (replicas.sim.SimReplica objects).
    sims: list[Any] = field(default_factory=list)
    # The loop the gateway runs on (set at start-up; saves a lookup per request).
    loop: asyncio.AbstractEventLoop | None = None
    # The session header's name as raw headers are compared (lower-case bytes).
    session_header: bytes = field(init=False, default=b"")

    def __post_init__(self) -> None:
        self.session_header = self.config.session_header.lower().encode("latin-1")

    def require_proxy(self) -> Proxy:
        if self.proxy is None:
            raise RuntimeError("the gateway has not started")
        return self.proxy


STATE: web.AppKey[GatewayState] = web.AppKey("fleet_router_state", GatewayState)
