"""Parse what the router needs from a vLLM replica's Prometheus /metrics text.

Only the handful of families the router reads are kept before parsing (a vLLM exposition is
mostly histogram buckets), then prometheus_client's own text parser does the parsing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ScrapedStats", "parse_vllm_metrics"]

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # current, retired
_CACHE_INFO = "vllm:cache_config_info"
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
_WANTED = (_RUNNING, _WAITING, *_KV_USAGE, _CACHE_INFO, *_HITS, *_QUERIES)


@dataclass(frozen=True, slots=True)
class ScrapedStats:
    """One scrape of one replica (summed over the models/engines it exposes)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    prefix_hit_tokens: float = 0.0
    prefix_query_tokens: float = 0.0


def _keep(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return len(parts) >= 3 and parts[2].startswith(_WANTED)
    return line.startswith(_WANTED)


def _int_label(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None


def parse_vllm_metrics(text: str) -> ScrapedStats:
    """The router's view of one /metrics exposition; missing families read as zero/unknown."""
    kept = "\n".join(line for line in text.splitlines() if _keep(line)) + "\n"
    running = waiting = 0.0
    kv_usage: dict[str, float] = {}
    hits: dict[str, float] = {}
    queries: dict[str, float] = {}
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            value = sample.value
            if math.isnan(value):
                continue
            name = sample.name
            if name == _RUNNING:
                running += value
            elif name == _WAITING:
                waiting += value
            elif name in _KV_USAGE:
                kv_usage[name] = max(kv_usage.get(name, 0.0), value)
            elif name.removesuffix("_total") in _HITS and not name.endswith("_created"):
                base = name.removesuffix("_total")
                hits[base] = hits.get(base, 0.0) + value
            elif name.removesuffix("_total") in _QUERIES and not name.endswith("_created"):
                base = name.removesuffix("_total")
                queries[base] = queries.get(base, 0.0) + value
            elif name == _CACHE_INFO:
                blocks = _int_label(sample.labels.get("num_gpu_blocks"))
                size = _int_label(sample.labels.get("block_size"))
                if blocks is not None:
                    num_gpu_blocks = (num_gpu_blocks or 0) + blocks
                if size is not None:
                    block_size = size

    def first(values: dict[str, float], names: tuple[str, ...]) -> float:
        # Prefer the current name; fall back to the retired one on older vLLM.
        for name in names:
            if name in values:
                return values[name]
        return 0.0

    return ScrapedStats(
        running=int(running),
        waiting=int(waiting),
        kv_usage=first(kv_usage, _KV_USAGE),
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        prefix_hit_tokens=first(hits, _HITS),
        prefix_query_tokens=first(queries, _QUERIES),
    )
