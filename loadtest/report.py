"""Presenting a run: a live progress bar, the end-of-run table (rich), the JSON result file.

The JSON keeps vLLM bench serve's field names (``completed``, ``request_throughput``,
``mean_ttft_ms``, ``p99_itl_ms``, ``request_goodput``, ...) so existing tooling reads it, plus the
run's description (``date``, ``backend``, ``model_id``, ``num_prompts``, ``request_rate``,
``burstiness``, ``max_concurrency``) and our extras (``prefix_cache_hit_rate``,
``per_replica_share``, ``preemptions``, ``errors``, ...).  :data:`JSON_KEYS` is the stable set.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadtest.client import RequestRecord
from loadtest.stats import LATENCY_METRICS, PERCENTILES, Summary

__all__ = [
    "JSON_KEYS",
    "RunMeta",
    "live_progress",
    "output_console",
    "result_json",
    "summary_table",
    "write_json",
]


@dataclass(frozen=True, slots=True)
class RunMeta:
    """What was run, for the JSON file and the table's title."""

    label: str
    targets: tuple[str, ...]
    model: str
    workload: str
    workload_params: Mapping[str, Any]
    seed: int
    num_prompts: int | None
    duration_limit_s: float | None
    request_rate: float | None  # None: closed loop or a trace's own timing; inf: all at once
    burstiness: float
    max_concurrency: int | None
    warmup_requests: int
    date: str = field(default_factory=lambda: datetime.now().strftime("%Y%m%d-%H%M%S"))


def _meta_dict(meta: RunMeta) -> dict[str, Any]:
    rate: float | str | None = meta.request_rate
    if meta.request_rate is not None and math.isinf(meta.request_rate):
        rate = "inf"  # as vLLM writes it
    return {
        "date": meta.date,
        "backend": "fleet-loadtest",
        "label": meta.label,
        "model_id": meta.model,
        "target": list(meta.targets),
        "workload": meta.workload,
        "workload_params": dict(meta.workload_params),
        "seed": meta.seed,
        "num_prompts": meta.num_prompts,
        "duration_limit_s": meta.duration_limit_s,
        "request_rate": rate,
        "burstiness": meta.burstiness,
        "max_concurrency": meta.max_concurrency,
        "warmup_requests": meta.warmup_requests,
    }


def result_json(summary: Summary, meta: RunMeta) -> dict[str, Any]:
    """The JSON document of one run."""
    return {**_meta_dict(meta), **summary.to_dict()}


def write_json(path: str | Path, document: Mapping[str, Any] | Sequence[Any]) -> None:
    """Write ``document`` as indented JSON."""
    Path(path).write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")


def _golden_keys() -> tuple[str, ...]:
    keys = [
        "date", "backend", "label", "model_id", "target", "workload", "workload_params", "seed",
        "num_prompts", "duration_limit_s", "request_rate", "burstiness", "max_concurrency",
        "warmup_requests",
        "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
        "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
        "max_output_tokens_per_s", "max_concurrent_requests",
    ]  # fmt: skip
    for name in LATENCY_METRICS:
        keys += [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
        keys += [f"p{p}_{name}_ms" for p in PERCENTILES]
    keys += [
        "offered_rate", "achieved_rate", "slo", "prefix_cache_hit_rate", "per_replica_share",
        "preemptions", "client_replica_share", "cached_tokens", "errors",
    ]  # fmt: skip
    return tuple(keys)


JSON_KEYS: tuple[str, ...] = _golden_keys()


def output_console() -> Console:
    """A console for the result tables: at least 150 columns when not a terminal (files, pipes,
    CI logs), so wide comparison tables are not squeezed to 80."""
    console = Console()
    if console.is_terminal:
        return console
    return Console(width=max(150, console.width))


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _share(shares: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in shares.items()) or "-"


def summary_table(summary: Summary, title: str) -> Table:
    """The end-of-run table."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("completed / failed", f"{summary.completed} / {summary.failed}"),
        ("duration (s)", _fmt(summary.duration)),
        ("offered rate (req/s)", _fmt(summary.offered_rate)),
        ("achieved rate (req/s)", _fmt(summary.request_throughput)),
        ("output tokens/s", _fmt(summary.output_throughput, 1)),
        ("total tokens/s", _fmt(summary.total_token_throughput, 1)),
        ("peak output tokens/s", _fmt(summary.max_output_tokens_per_s, 1)),
        ("input / output tokens", f"{summary.total_input_tokens} / {summary.total_output_tokens}"),
    ]
    if summary.request_goodput is not None:
        rows.append((f"goodput (req/s, {summary.slo.describe()})", _fmt(summary.request_goodput)))
    for name in LATENCY_METRICS:
        stats = summary.latency[name]
        p = stats.percentiles
        rows.append(
            (
                f"{name.upper()} ms mean / p50 / p90 / p99",
                f"{stats.mean:.1f} / {p[50]:.1f} / {p[90]:.1f} / {p[99]:.1f}",
            )
        )
    if summary.server is not None:
        rate = summary.server.prefix_cache_hit_rate
        rows += [
            ("prefix cache hit rate", "-" if rate is None else f"{rate:.1%}"),
            ("replica share (/metrics)", _share(summary.server.per_replica_share)),
            ("preemptions", str(summary.server.preemptions)),
        ]
        if summary.server.unreachable:
            rows.append(("metrics unreachable", ", ".join(summary.server.unreachable)))
    if summary.client_replica_share:
        rows.append(("replica share (x-fleet-replica)", _share(summary.client_replica_share)))
    if summary.cached_tokens is not None:
        rows.append(("cached prompt tokens (usage)", str(summary.cached_tokens)))
    if summary.errors:
        rows.append(("errors", ", ".join(f"{k}: {v}" for k, v in summary.errors.items())))
    for key, value in rows:
        table.add_row(key, value)
    return table


@contextmanager
def live_progress(console: Console, total: int | None, label: str) -> Iterator[Any]:
    """Yield a callback for finished requests; draws a progress bar only on a terminal."""
    if not console.is_terminal:
        yield lambda record: None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[errors]} errors"),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=total, errors=0)
        errors = 0

        def advance(record: RequestRecord) -> None:
            nonlocal errors
            if record.warmup:
                return
            errors += 0 if record.ok else 1
            progress.update(task, advance=1, errors=errors)

        yield advance
