"""Scrape each replica's vLLM /metrics: load (running, waiting, KV usage), KV capacity
(`vllm:cache_config_info`) and prefix-cache counters."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.fleet.registry import Fleet
from router.fleet.replica import Replica
from router.fleet.stats import parse_vllm_metrics

__all__ = ["MetricsScraper"]

log = logging.getLogger(__name__)


class MetricsScraper:
    """Scrapes every healthy replica concurrently (the gateway calls `scrape_all` periodically)."""

    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float,
    ) -> None:
        self._fleet = fleet
        self._session = session
        self._timeout_s = timeout_s

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(r) for r in self._fleet if r.healthy))

    async def scrape(self, replica: Replica) -> None:
        """Scrape one replica (never raises: a failed scrape keeps the last values)."""
        try:
            timeout = aiohttp.ClientTimeout(total=self._timeout_s)
            async with self._session.get(replica.url + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            log.debug("scrape of %s failed: %r", replica.replica_id, exc)
            return
        try:
            stats = parse_vllm_metrics(text)
        except ValueError as exc:  # the parser raises ValueError on malformed text
            log.warning("replica %s: unreadable /metrics: %s", replica.replica_id, exc)
            return
        if self._fleet.get(replica.replica_id) is replica:  # not removed meanwhile
            self._fleet.set_stats(replica, stats)
