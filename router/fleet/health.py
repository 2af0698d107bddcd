"""Active health checks and model discovery.

Every health interval, each replica gets `GET /health` with a timeout.  A refused connection marks
it down at once (the process is gone); a timeout or error status only after two in a row (a
busy replica may answer one probe late).  A healthy replica whose models are unknown, or due for
re-discovery, is asked `GET /v1/models`.  All replicas are probed concurrently, so one stalled
replica never delays the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from router.fleet.registry import Fleet
from router.fleet.replica import Replica

__all__ = ["HealthChecker", "fetch_models"]

log = logging.getLogger(__name__)

_FAILURES_TO_EJECT = 2


async def fetch_models(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> list[dict[str, Any]]:
    """The replica's /v1/models `data` entries; raises on any failure."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url + "/v1/models", timeout=timeout) as resp:
        resp.raise_for_status()
        payload = orjson.loads(await resp.read())
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models answer has no `data` list")
    return [card for card in data if isinstance(card, dict)]


class HealthChecker:
    """Probes the replicas of a fleet (the gateway calls `check_all` periodically)."""

    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float,
        models_refresh_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._timeout_s = timeout_s
        self._models_refresh_interval_s = models_refresh_interval_s
        self._clock = clock

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self._fleet))

    async def check(self, replica: Replica) -> None:
        """Probe one replica and update its state (never raises)."""
        was_up = replica.up
        try:
            timeout = aiohttp.ClientTimeout(total=self._timeout_s)
            async with self._session.get(replica.url + "/health", timeout=timeout) as resp:
                await resp.read()
                ok, error = resp.status == 200, f"/health answered {resp.status}"
            refused = False
        except aiohttp.ClientConnectorError as exc:
            ok, error, refused = False, f"cannot connect: {exc.os_error or exc}", True
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, error, refused = False, f"/health failed: {type(exc).__name__}", False

        if ok:
            replica.consecutive_health_failures = 0
            if not replica.models or self._discovery_due(replica):
                await self._discover(replica)
            replica.healthy = bool(replica.models)
            if replica.healthy:
                replica.last_error = None
        else:
            replica.consecutive_health_failures += 1
            replica.last_error = error
            if refused or replica.consecutive_health_failures >= _FAILURES_TO_EJECT:
                replica.healthy = False
        self._fleet.publish(replica)
        if replica.up != was_up:
            log.info(
                "replica %s is %s%s",
                replica.replica_id,
                "up" if replica.up else "down",
                "" if replica.up else f" ({replica.last_error})",
            )

    def _discovery_due(self, replica: Replica) -> bool:
        last = replica.models_fetched_at
        return last is None or self._clock() - last >= self._models_refresh_interval_s

    async def _discover(self, replica: Replica) -> None:
        try:
            cards = await fetch_models(self._session, replica.url, self._timeout_s)
        except (aiohttp.ClientError, TimeoutError, ValueError, orjson.JSONDecodeError) as exc:
            replica.last_error = f"/v1/models failed: {type(exc).__name__}: {exc}"
            return
        replica.models_fetched_at = self._clock()
        self._fleet.set_models(replica, cards)
        if not replica.models:
            replica.last_error = "/v1/models lists no model"
