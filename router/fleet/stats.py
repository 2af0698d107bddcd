"""Parse what the router needs from a vLLM replica's Prometheus /metrics text.

A vLLM exposition is mostly histogram buckets the router never reads, and it is scraped twice a
second: only the sample lines of the handful of wanted families are read, each with one regular
expression.  prometheus_client's general text parser took several times as long (a test checks
the two agree on expositions written by prometheus_client itself).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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


# A sample line of the text exposition: `name{labels} value [timestamp]`.
_SAMPLE = re.compile(r"([^\s{]+)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _int_label(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None


def parse_vllm_metrics(text: str) -> ScrapedStats:
    """The router's view of one /metrics exposition; missing families read as zero/unknown.

    Raises ValueError on a sample line of a wanted family that cannot be read.
    """
    running = waiting = 0.0
    kv_usage: dict[str, float] = {}
    hits: dict[str, float] = {}
    queries: dict[str, float] = {}
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    for line in text.split("\n"):  # not splitlines(): a label value may hold a bare \r
        if not line.startswith(_WANTED):  # comments, and the families the router ignores
            continue
        sample = _SAMPLE.match(line)
        if sample is None:
            raise ValueError(f"unreadable sample line: {line[:120]!r}")
        name, labels, raw_value = sample.groups()
        value = float(raw_value)  # NaN, +Inf and -Inf included; ValueError otherwise
        if math.isnan(value) or name.endswith("_created"):
            continue
        if name == _RUNNING:
            running += value
        elif name == _WAITING:
            waiting += value
        elif name in _KV_USAGE:
            kv_usage[name] = max(kv_usage.get(name, 0.0), value)
        elif (base := name.removesuffix("_total")) in _HITS:
            hits[base] = hits.get(base, 0.0) + value
        elif base in _QUERIES:
            queries[base] = queries.get(base, 0.0) + value
        elif name == _CACHE_INFO:
            found = dict(_LABEL.findall(labels or ""))
            blocks = _int_label(found.get("num_gpu_blocks"))
            size = _int_label(found.get("block_size"))
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
