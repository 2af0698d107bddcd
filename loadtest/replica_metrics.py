"""Server-side figures from the replicas' Prometheus ``/metrics``, as deltas over a run.

Each replica is scraped before and after the measured phase; counters are summed over their
labels (``model_name``, ``engine``, ``finished_reason``) and subtracted.  From the deltas:

* fleet prefix-cache hit rate = Σ ``vllm:prefix_cache_hits`` / Σ ``vllm:prefix_cache_queries``
  (both counted in tokens),
* per-replica request share = each replica's ``vllm:request_success`` / the fleet's,
* preemptions = Σ ``vllm:num_preemptions``.

The retired ``vllm:gpu_prefix_cache_*`` names are read when the current ones are absent.
Parsing uses ``prometheus_client``'s exposition parser.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "ReplicaCounters",
    "ServerStats",
    "metrics_url",
    "parse_counters",
    "scrape_all",
    "server_stats",
]

# Our field -> metric names to try in order (family names, i.e. without `_total`).
_COUNTERS: Mapping[str, tuple[str, ...]] = {
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "preemptions": ("vllm:num_preemptions",),
    "requests": ("vllm:request_success",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
}


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """Counter totals of one replica at one moment (``None``: the scrape failed)."""

    url: str
    values: Mapping[str, float] | None


@dataclass(frozen=True, slots=True)
class ServerStats:
    """Deltas over the run, fleet-wide and per replica."""

    prefix_cache_hits: float
    prefix_cache_queries: float
    preemptions: int
    per_replica_requests: Mapping[str, int]
    unreachable: tuple[str, ...] = field(default=())

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def per_replica_share(self) -> dict[str, float]:
        total = sum(self.per_replica_requests.values())
        if total <= 0:
            return {url: 0.0 for url in self.per_replica_requests}
        return {url: n / total for url, n in self.per_replica_requests.items()}


def metrics_url(url: str) -> str:
    """A replica base URL or a full ``/metrics`` URL → the ``/metrics`` URL."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def parse_counters(text: str) -> dict[str, float]:
    """Sum the counters we use over all their label sets (missing counters are 0)."""
    # Summed per sample name without `_total`: exposition writers differ on whether the
    # `# TYPE` line names the family with or without the suffix, and so the parser's families.
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            totals[name] = totals.get(name, 0.0) + sample.value
    out: dict[str, float] = {}
    for key, names in _COUNTERS.items():
        out[key] = next((totals[name] for name in names if name in totals), 0.0)
    return out


async def _scrape(session: aiohttp.ClientSession, url: str) -> ReplicaCounters:
    try:
        async with session.get(metrics_url(url)) as response:
            if response.status != 200:
                return ReplicaCounters(url, None)
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return ReplicaCounters(url, None)
    try:
        return ReplicaCounters(url, parse_counters(text))
    except ValueError:  # not a Prometheus exposition
        return ReplicaCounters(url, None)


async def scrape_all(
    session: aiohttp.ClientSession, urls: Sequence[str]
) -> dict[str, ReplicaCounters]:
    """Scrape every replica concurrently."""
    results = await asyncio.gather(*(_scrape(session, url) for url in urls))
    return {r.url: r for r in results}


def _delta(before: Mapping[str, float], after: Mapping[str, float], key: str) -> float:
    return max(0.0, after[key] - before[key])  # a restarted replica resets its counters


def server_stats(
    before: Mapping[str, ReplicaCounters], after: Mapping[str, ReplicaCounters]
) -> ServerStats:
    """Deltas between two snapshots; a replica missing from either is listed as unreachable."""
    hits = queries = preemptions = 0.0
    per_replica: dict[str, int] = {}
    unreachable: list[str] = []
    for url, end in after.items():
        start = before.get(url)
        if start is None or start.values is None or end.values is None:
            unreachable.append(url)
            continue
        a, b = start.values, end.values
        hits += _delta(a, b, "prefix_cache_hits")
        queries += _delta(a, b, "prefix_cache_queries")
        preemptions += _delta(a, b, "preemptions")
        per_replica[url] = round(_delta(a, b, "requests"))
    return ServerStats(
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        preemptions=round(preemptions),
        per_replica_requests=per_replica,
        unreachable=tuple(unreachable),
    )
