"""``fleet-router demo``: what a newcomer runs first (under 2 minutes on 2 cores, no GPU).

1. **Routing** — real HTTP: for each of round_robin, least_load, cache_aware and kv_aware (a
   policy not registered in ``router.policies.POLICIES`` is skipped with a note) it starts fresh
   simulated replicas and a gateway in-process, runs the same seeded shared-prefix workload
   (SGLang's generated-shared-prefix, scaled down) and prints hit rate, throughput, TTFT p50/p99
   and max/mean load.  Each replica's KV cache is sized to hold only part of the system prompts,
   so where a request lands decides whether its prefix is cached.
2. **Static vs continuous batching** — virtual time on the output-variance workload.
3. **Chunked prefill on vs off** — virtual time on the long-prompt-mix workload.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.compare import CompareRow, Target, compare, compare_table
from loadtest.drivers import DriverConfig
from loadtest.fleet import FleetSettings
from loadtest.report import output_console
from loadtest.runner import RunSettings
from loadtest.virtual import (
    BatchingResult,
    ChunkedPrefillResult,
    batching_ratio,
    chunked_prefill_ratio,
)

__all__ = ["DEMO_POLICIES", "DemoSize", "kv_blocks_for", "main", "run_demo"]

DEMO_POLICIES = ("round_robin", "least_load", "cache_aware", "kv_aware")
BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class DemoSize:
    """How big the demo is (``--quick`` picks the small one)."""

    replicas: int
    groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    concurrency: int
    time_scale: float
    kv_prefix_fraction: float  # share of all system prompts one replica's KV can hold
    batching_caps: tuple[int, ...]
    batching_requests: int
    chunked_requests: int


FULL = DemoSize(
    replicas=4,
    groups=32,
    prompts_per_group=8,
    system_prompt_len=2048,
    question_len=128,
    output_len=64,
    concurrency=24,
    time_scale=1.0,
    kv_prefix_fraction=0.2,
    batching_caps=(32, 128, 512, 1536),
    batching_requests=1000,
    chunked_requests=400,
)
QUICK = DemoSize(
    replicas=3,
    groups=12,
    prompts_per_group=4,
    system_prompt_len=1024,
    question_len=64,
    output_len=16,
    concurrency=9,
    time_scale=0.2,
    kv_prefix_fraction=0.25,
    batching_caps=(512,),
    batching_requests=200,
    chunked_requests=150,
)


def kv_blocks_for(size: DemoSize) -> int:
    """Per-replica KV blocks: a fraction of all system prompts plus the requests in flight.

    Round robin spreads every group over every replica, so each replica would need all the
    prompts and its LRU keeps evicting them; a cache-aware router keeps a group on one replica,
    whose share of the prompts then fits.
    """
    prefix_blocks = size.groups * math.ceil(size.system_prompt_len / BLOCK_TOKENS)
    request_blocks = math.ceil(
        (size.system_prompt_len + size.question_len + size.output_len) / BLOCK_TOKENS
    )
    in_flight = math.ceil(size.concurrency / size.replicas) + 1
    return math.ceil(prefix_blocks * size.kv_prefix_fraction) + in_flight * request_blocks


def _registered() -> set[str]:
    from router.policies import POLICIES

    return set(POLICIES)


async def _routing(size: DemoSize, seed: int, console: Console) -> list[CompareRow]:
    registered = _registered()
    targets = [Target("policy", p) for p in DEMO_POLICIES]
    rows_by_policy: dict[str, CompareRow] = {}
    runnable = [t for t in targets if t.policy in registered]
    run = RunSettings(
        targets=(),
        workload="shared-prefix",
        workload_params={
            "num_groups": size.groups,
            "prompts_per_group": size.prompts_per_group,
            "system_prompt_len": size.system_prompt_len,
            "question_len": size.question_len,
            "output_len": size.output_len,
        },
        driver=DriverConfig(
            num_requests=size.groups * size.prompts_per_group, concurrency=size.concurrency
        ),
        seed=seed,
        request_timeout_s=120.0,
    )
    fleet = FleetSettings(
        count=size.replicas,
        time_scale=size.time_scale,
        num_gpu_blocks=kv_blocks_for(size),
        seed=seed,
    )
    for row in await compare(runnable, run, fleet, console=console):
        rows_by_policy[row.target.policy or ""] = row
    return [
        rows_by_policy.get(
            t.policy or "",
            CompareRow(t, note="skipped: not registered in router.policies.POLICIES yet"),
        )
        for t in targets
    ]


def _vs_round_robin(rows: Sequence[CompareRow]) -> list[str]:
    """One line per policy: its throughput and TTFT p50 relative to round robin."""
    base = next((r.outcome for r in rows if r.target.policy == "round_robin" and r.outcome), None)
    if base is None:
        return []
    b = base.summary
    lines = []
    for row in rows:
        if row.outcome is None or row.target.policy == "round_robin":
            continue
        s = row.outcome.summary
        hit, base_hit = s.prefix_cache_hit_rate or 0.0, b.prefix_cache_hit_rate or 0.0
        lines.append(
            f"{row.target.policy} vs round_robin: output throughput "
            f"{s.output_throughput / b.output_throughput:.2f}x, TTFT p50 "
            f"{s.latency['ttft'].percentiles[50] / b.latency['ttft'].percentiles[50]:.2f}x, "
            f"hit rate {hit:.0%} vs {base_hit:.0%}"
        )
    return lines


def _batching_table(results: Sequence[BatchingResult]) -> Table:
    table = Table(
        title="Static vs continuous batching (sim engine, virtual time; output-variance workload)",
        header_style="bold",
    )
    for name in ("output cap", "requests", "continuous tok/s", "static tok/s", "ratio"):
        table.add_column(name, justify="right")
    for r in results:
        table.add_row(
            str(r.cap),
            str(r.num_requests),
            f"{r.continuous_tok_s:,.0f}",
            f"{r.static_tok_s:,.0f}",
            f"{r.ratio:.2f}x",
        )
    return table


def _chunked_table(r: ChunkedPrefillResult) -> Table:
    table = Table(
        title=(
            "Chunked prefill on vs off (sim engine, virtual time; long-prompt-mix: 20% prompts "
            f"of 8,192 tokens, Poisson {r.rate_per_s:g} req/s, step budget 512 tokens)"
        ),
        header_style="bold",
    )
    for name in ("", "p99 ITL ms", "p50 TTFT ms"):
        table.add_column(name, justify="right")
    table.add_row(
        "chunked", f"{r.chunked_p99_itl_s * 1e3:.1f}", f"{r.chunked_p50_ttft_s * 1e3:.1f}"
    )
    table.add_row(
        "not chunked", f"{r.unchunked_p99_itl_s * 1e3:.1f}", f"{r.unchunked_p50_ttft_s * 1e3:.1f}"
    )
    table.add_row("ratio (off / on)", f"{r.ratio:.2f}x", "")
    return table


@dataclass(frozen=True, slots=True)
class DemoResult:
    routing: list[CompareRow]
    batching: list[BatchingResult]
    chunked: ChunkedPrefillResult


async def run_demo(size: DemoSize, seed: int, console: Console) -> DemoResult:
    """All three parts; prints the tables as they are ready."""
    kv = kv_blocks_for(size)
    console.print(
        f"[bold]1. Routing[/bold] (real HTTP): {size.replicas} simulated replicas, time_scale "
        f"{size.time_scale}, each with {kv} KV blocks of 16 tokens (room for "
        f"{size.kv_prefix_fraction:.0%} of all system prompts plus the requests in flight); "
        f"shared-prefix {size.groups} groups x {size.prompts_per_group} prompts, "
        f"{size.system_prompt_len}-token system prompts, {size.question_len}-token questions, "
        f"{size.output_len} output tokens; {size.concurrency} concurrent users; fresh replicas "
        "and a fresh gateway for every policy."
    )
    routing = await _routing(size, seed, console)
    console.print(compare_table(routing, "Routing policies on the shared-prefix workload"))
    for line in _vs_round_robin(routing):
        console.print(line)
    console.print("[bold]2. Batching[/bold] and [bold]3. chunked prefill[/bold] on the sim engine")
    batching = [
        batching_ratio(cap, size.batching_requests, seed=seed) for cap in size.batching_caps
    ]
    console.print(_batching_table(batching))
    chunked = chunked_prefill_ratio(size.chunked_requests, seed=seed)
    console.print(_chunked_table(chunked))
    return DemoResult(routing, batching, chunked)


def _json(result: DemoResult) -> dict[str, Any]:
    from loadtest.report import result_json

    return {
        "routing": [
            {"policy": row.target.policy, "skipped": row.note}
            if row.outcome is None
            else {"policy": row.target.policy, **result_json(row.outcome.summary, row.outcome.meta)}
            for row in result.routing
        ],
        "batching": [
            {
                "cap": b.cap,
                "num_requests": b.num_requests,
                "continuous_output_throughput": b.continuous_tok_s,
                "static_output_throughput": b.static_tok_s,
                "ratio": b.ratio,
            }
            for b in result.batching
        ],
        "chunked_prefill": {
            "num_requests": result.chunked.num_requests,
            "rate": result.chunked.rate_per_s,
            "chunked_p99_itl_ms": result.chunked.chunked_p99_itl_s * 1e3,
            "unchunked_p99_itl_ms": result.chunked.unchunked_p99_itl_s * 1e3,
            "ratio": result.chunked.ratio,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``fleet-router demo``."""
    parser = argparse.ArgumentParser(
        prog="fleet-router demo",
        description="Compare routing policies on simulated replicas, then show static vs "
        "continuous batching and chunked prefill on the simulated engine.",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller run (~15 s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, help="number of simulated replicas")
    parser.add_argument("--time-scale", type=float, help="sim speed: 0.1 = 10x faster than a GPU")
    parser.add_argument("--json", metavar="FILE", help="write all figures as JSON")
    parser.add_argument("--plot", metavar="FILE", help="PNG comparing the routing policies")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.replicas is not None:
        if args.replicas < 1:
            parser.error("--replicas must be >= 1")
        size = _replace(size, replicas=args.replicas)
    if args.time_scale is not None:
        if not args.time_scale >= 0:
            parser.error("--time-scale must be >= 0")
        size = _replace(size, time_scale=args.time_scale)
    console = output_console()
    result = asyncio.run(run_demo(size, args.seed, console))
    if args.json or args.plot:
        from loadtest.compare import write_outputs
        from loadtest.report import write_json

        write_outputs(result.routing, None, args.plot)
        if args.json:
            write_json(args.json, _json(result))
    return 0 if any(row.outcome is not None for row in result.routing) else 1


def _replace(size: DemoSize, **changes: Any) -> DemoSize:
    import dataclasses

    return dataclasses.replace(size, **changes)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
