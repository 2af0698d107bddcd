"""PNG figures with matplotlib's Agg canvas (no display, no pyplot global state).

* :func:`plot_run`: latency CDFs (TTFT, TPOT, ITL, E2E), per-replica request share, and output
  throughput over time for one run.
* :func:`plot_compare`: the same panels side by side for several targets of ``compare``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loadtest.client import RequestRecord
from loadtest.stats import Summary, throughput_timeline

__all__ = ["PlotRun", "plot_compare", "plot_run"]


@dataclass(frozen=True, slots=True)
class PlotRun:
    """What one curve needs: a label, the measured records, the window start, the summary."""

    label: str
    records: Sequence[RequestRecord]
    started_s: float
    summary: Summary


def _latencies_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    done = [r for r in records if r.ok]
    return {
        "TTFT": [t * 1000 for r in done if (t := r.ttft_s) is not None],
        "TPOT": [t * 1000 for r in done if (t := r.tpot_s) is not None],
        "ITL": [gap * 1000 for r in done for gap in r.itl_s],
        "E2E": [t * 1000 for r in done if (t := r.e2e_s) is not None],
    }


def _cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=float))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)


def _bucket_s(duration_s: float) -> float:
    # About 40 points across the run, never finer than 50 ms nor coarser than 1 s.
    return min(1.0, max(0.05, duration_s / 40))


def _timeline(ax: Axes, run: PlotRun) -> None:
    bucket = _bucket_s(run.summary.duration)
    series = throughput_timeline(run.records, run.started_s, bucket)
    if series:
        ax.plot(np.arange(len(series)) * bucket, series, label=run.label)


def _shares(run: PlotRun) -> Mapping[str, float]:
    if run.summary.server is not None and run.summary.server.per_replica_requests:
        return run.summary.server.per_replica_share
    return run.summary.client_replica_share


def _short(name: str) -> str:
    return name.removeprefix("http://").removeprefix("https://")


def _save(fig: Figure, path: str | Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)


def plot_run(path: str | Path, run: PlotRun) -> None:
    """One run: four latency CDFs, replica shares, throughput over time."""
    fig = Figure(figsize=(12, 8))
    axes = fig.subplots(2, 2)
    lat = _latencies_ms(run.records)
    ax = axes[0][0]
    _cdf(ax, lat["TTFT"], "TTFT")
    _cdf(ax, lat["E2E"], "E2E")
    ax.set(title="TTFT and E2E latency CDF", xlabel="ms", ylabel="fraction of requests")
    ax.legend(loc="lower right")
    ax = axes[0][1]
    _cdf(ax, lat["TPOT"], "TPOT")
    _cdf(ax, lat["ITL"], "ITL")
    ax.set(title="TPOT and ITL CDF", xlabel="ms", ylabel="fraction")
    ax.legend(loc="lower right")
    ax = axes[1][0]
    shares = _shares(run)
    if shares:
        ax.bar([_short(k) for k in shares], [v * 100 for v in shares.values()])
        ax.tick_params(axis="x", labelrotation=20)
    ax.set(title="Per-replica request share", ylabel="% of requests")
    ax = axes[1][1]
    _timeline(ax, run)
    ax.set(title="Output throughput over time", xlabel="s", ylabel="tokens/s")
    fig.suptitle(run.label)
    _save(fig, path)


def plot_compare(path: str | Path, runs: Sequence[PlotRun]) -> None:
    """Several targets side by side: TTFT CDFs, throughput, hit rate, throughput over time."""
    fig = Figure(figsize=(13, 8))
    axes = fig.subplots(2, 2)
    labels = [run.label for run in runs]
    ax = axes[0][0]
    for run in runs:
        _cdf(ax, _latencies_ms(run.records)["TTFT"], run.label)
    ax.set(title="TTFT CDF", xlabel="ms", ylabel="fraction of requests")
    ax.legend(loc="lower right", fontsize="small")
    ax = axes[0][1]
    ax.bar(labels, [run.summary.output_throughput for run in runs])
    ax.set(title="Output throughput", ylabel="tokens/s")
    ax.tick_params(axis="x", labelrotation=20)
    ax = axes[1][0]
    ax.bar(labels, [(run.summary.prefix_cache_hit_rate or 0.0) * 100 for run in runs])
    ax.set(title="Prefix cache hit rate (replica /metrics)", ylabel="%")
    ax.tick_params(axis="x", labelrotation=20)
    ax = axes[1][1]
    for run in runs:
        _timeline(ax, run)
    ax.set(title="Output throughput over time", xlabel="s", ylabel="tokens/s")
    ax.legend(loc="upper right", fontsize="small")
    _save(fig, path)
