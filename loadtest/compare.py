"""``fleet-loadtest compare``: one seeded workload against several routers, side by side.

Targets, each run on a FRESH set of simulated replicas (started in-process) unless ``--replica``
points at an existing fleet:

* ``policy:NAME`` — our gateway with routing policy NAME (every registered one by default);
* ``client-rr`` — no router at all: the load tester itself sends round robin to the replicas;
* ``sglang-router`` / ``vllm-router`` — the peers' Rust routers with their ``cache_aware``
  policy, when their Python packages are installed (``pip install sglang-router vllm-router``);
  otherwise reported as "skipped: not installed".  They run with ``HF_ENDPOINT`` pointing at a
  closed local port so they never download a tokenizer.

The same workload, seed and load settings go to every target; the replicas' ``/metrics``
deltas give each target's prefix-cache hit rate, request shares and preemptions.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.fleet import FleetSettings, running_fleet, running_peer_router, running_ready_gateway
from loadtest.runner import RunOutcome, RunSettings, discover_model, execute

__all__ = [
    "PEERS",
    "CompareRow",
    "Target",
    "add_compare_arguments",
    "compare",
    "compare_table",
    "default_targets",
    "load_ratio",
    "parse_target",
    "run_compare_cli",
]

# Peer routers: name -> (Python module that launches it, policy we ask of it).
PEERS: dict[str, tuple[str, str]] = {
    "sglang-router": ("sglang_router", "cache_aware"),
    "vllm-router": ("vllm_router", "cache_aware"),
}
DEFAULT_POLICIES = ("round_robin", "least_load", "cache_aware", "kv_aware")


@dataclass(frozen=True, slots=True)
class Target:
    """One column of the comparison."""

    kind: str  # "policy" | "client-rr" | a key of PEERS
    policy: str | None = None

    @property
    def label(self) -> str:
        if self.kind == "policy":
            return f"fleet-router {self.policy}"
        if self.kind == "client-rr":
            return "client round robin (no router)"
        return f"{self.kind} {self.policy}"


def parse_target(text: str) -> Target:
    """``policy:NAME``, a bare policy name, ``client-rr``, ``sglang-router`` or ``vllm-router``."""
    text = text.strip()
    if text == "client-rr":
        return Target("client-rr")
    if text in PEERS:
        return Target(text, PEERS[text][1])
    name = text.removeprefix("policy:")
    if not name:
        raise ValueError(f"bad target {text!r}")
    return Target("policy", name)


def default_targets() -> tuple[Target, ...]:
    return (
        *(Target("policy", p) for p in DEFAULT_POLICIES),
        Target("client-rr"),
        *(Target(name, policy) for name, (_, policy) in PEERS.items()),
    )


@dataclass(frozen=True, slots=True)
class CompareRow:
    """One target's result, or why it was skipped."""

    target: Target
    outcome: RunOutcome | None = None
    note: str = ""
    router_options: dict[str, Any] = field(default_factory=dict)


def load_ratio(per_replica_requests: Mapping[str, int]) -> float | None:
    """max / mean of the per-replica request counts (1.0 = perfectly even)."""
    counts = list(per_replica_requests.values())
    if not counts or sum(counts) == 0:
        return None
    return max(counts) / (sum(counts) / len(counts))


def _registered_policies() -> set[str]:
    from router.policies import POLICIES

    return set(POLICIES)


async def _run_target(
    target: Target,
    run: RunSettings,
    fleet: FleetSettings,
    router_options: dict[str, Any],
    console: Console,
) -> CompareRow:
    if target.kind == "policy" and target.policy not in _registered_policies():
        return CompareRow(target, note="skipped: policy not registered in router.policies")
    if target.kind in PEERS and importlib.util.find_spec(PEERS[target.kind][0]) is None:
        return CompareRow(target, note="skipped: not installed")
    async with AsyncExitStack() as stack:
        urls = await stack.enter_async_context(running_fleet(fleet))
        model = run.model or await discover_model(urls[0])
        if target.kind == "client-rr":
            targets = urls
        elif target.kind == "policy":
            from router.config import RouterConfig

            assert target.policy is not None
            config = RouterConfig(
                host="127.0.0.1", port=0, replicas=urls, policy=target.policy, **router_options
            )
            gateway = await stack.enter_async_context(running_ready_gateway(config))
            targets = (gateway.url,)
        else:
            log = f"/tmp/fleet-loadtest-{target.kind}-{os.getpid()}.log"
            try:
                module, policy = PEERS[target.kind]
                peer = running_peer_router(module, policy, urls, log_path=log)
                peer_url = await stack.enter_async_context(peer)
            except (RuntimeError, OSError) as exc:
                return CompareRow(target, note=f"skipped: did not start ({exc}; log {log})")
            targets = (peer_url,)
        settings = replace(
            run, targets=tuple(targets), replica_metrics=urls, model=model, label=target.label
        )
        outcome = await execute(settings, console=console)
    return CompareRow(target, outcome=outcome, router_options=router_options)


async def compare(
    targets: Sequence[Target],
    run: RunSettings,
    fleet: FleetSettings,
    *,
    router_options: dict[str, Any] | None = None,
    console: Console | None = None,
) -> list[CompareRow]:
    """Run ``run`` against every target in turn (each on a fresh fleet); one row per target."""
    console = console or Console(stderr=True)
    rows = []
    for target in targets:
        rows.append(await _run_target(target, run, fleet, dict(router_options or {}), console))
    return rows


def _ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def compare_table(rows: Sequence[CompareRow], title: str) -> Table:
    """The side-by-side table."""
    notes = [f"{row.target.label}: {row.note}" for row in rows if row.outcome is None]
    table = Table(title=title, header_style="bold", caption="\n".join(notes) or None)
    for name, justify in (
        ("target", "left"),
        ("ok/failed", "right"),
        ("req/s", "right"),
        ("out tok/s", "right"),
        ("TTFT p50 ms", "right"),
        ("TTFT p99 ms", "right"),
        ("TPOT p50 ms", "right"),
        ("hit rate", "right"),
        ("max/mean load", "right"),
        ("preempt", "right"),
        ("goodput", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        if row.outcome is None:
            table.add_row(row.target.label, "[dim]skipped[/dim]", *[""] * 9)
            continue
        s = row.outcome.summary
        ttft, tpot = s.latency["ttft"], s.latency["tpot"]
        hit = s.prefix_cache_hit_rate
        ratio = load_ratio(s.server.per_replica_requests) if s.server else None
        table.add_row(
            row.target.label,
            f"{s.completed}/{s.failed}",
            f"{s.request_throughput:.2f}",
            f"{s.output_throughput:,.0f}",
            _ms(ttft.percentiles[50]),
            _ms(ttft.percentiles[99]),
            _ms(tpot.percentiles[50]),
            "-" if hit is None else f"{hit:.0%}",
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if s.server is None else str(s.server.preemptions),
            "-" if s.request_goodput is None else f"{s.request_goodput:.2f}",
        )
    return table


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``compare`` beyond the workload and load ones."""
    group = parser.add_argument_group("targets and fleet")
    group.add_argument(
        "--target",
        dest="targets",
        action="append",
        default=[],
        metavar="T",
        help="policy:NAME | NAME | client-rr | sglang-router | vllm-router (repeatable; "
        "default: round_robin, least_load, cache_aware, kv_aware, client-rr and both peers)",
    )
    group.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="use these replicas instead of fresh simulated ones (not fresh between targets)",
    )
    group.add_argument("--replicas", type=int, default=4, metavar="N", help="simulated replicas")
    group.add_argument(
        "--time-scale", type=float, default=0.05, help="sim speed: 0.05 = 20x faster than a GPU"
    )
    group.add_argument(
        "--num-gpu-blocks", type=int, metavar="N", help="KV capacity of each simulated replica"
    )
    group.add_argument("--model", help="model name (default: the replicas' first model)")
    group.add_argument("--slo", help="goodput SLOs, e.g. ttft=200ms,tpot=50ms")
    group.add_argument("--json", metavar="FILE", help="write every target's result as JSON")
    group.add_argument("--plot", metavar="FILE", help="write one PNG comparing the targets")
    group.add_argument("--request-timeout", type=float, default=300.0, metavar="S")


def write_outputs(rows: Sequence[CompareRow], json_path: str | None, plot_path: str | None) -> None:
    """``--json`` (a list, one document per target) and ``--plot``."""
    from loadtest.plot import PlotRun, plot_compare
    from loadtest.report import result_json, write_json

    done = [row for row in rows if row.outcome is not None]
    if json_path:
        docs: list[dict[str, Any]] = []
        for row in rows:
            if row.outcome is None:
                docs.append({"label": row.target.label, "skipped": row.note})
            else:
                docs.append(result_json(row.outcome.summary, row.outcome.meta))
        write_json(json_path, docs)
    if plot_path and done:
        plot_compare(
            plot_path,
            [
                PlotRun(
                    row.target.label,
                    row.outcome.result.records,
                    row.outcome.result.started_s,
                    row.outcome.summary,
                )
                for row in done
                if row.outcome is not None
            ],
        )


def run_compare_cli(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``fleet-loadtest compare`` after argument parsing."""
    from loadtest.cli import driver_from_args, workload_params_from_args
    from loadtest.stats import Slo, parse_slo
    from loadtest.workloads import WorkloadError, make_workload

    try:
        targets = tuple(parse_target(t) for t in args.targets) or default_targets()
        slo = parse_slo(args.slo) if args.slo else Slo()
        params = workload_params_from_args(args)
        workload = make_workload(args.workload, params, seed=args.seed)
    except (ValueError, WorkloadError) as exc:
        parser.error(str(exc))
    if args.replicas < 1:
        parser.error("--replicas must be >= 1")
    if not args.time_scale >= 0:
        parser.error("--time-scale must be >= 0")
    if args.num_gpu_blocks is not None and args.num_gpu_blocks < 1:
        parser.error("--num-gpu-blocks must be >= 1")
    driver = driver_from_args(parser, args, workload.natural_size)
    run = RunSettings(
        targets=(),
        workload=args.workload,
        workload_params=params,
        driver=driver,
        seed=args.seed,
        model=args.model,
        slo=slo,
        request_timeout_s=args.request_timeout,
    )
    fleet = FleetSettings(
        count=args.replicas,
        time_scale=args.time_scale,
        num_gpu_blocks=args.num_gpu_blocks,
        seed=args.seed,
        replicas=tuple(u.rstrip("/") for u in args.replica),
    )
    rows = asyncio.run(compare(targets, run, fleet))
    from loadtest.report import output_console

    output_console().print(compare_table(rows, f"{args.workload}, seed {args.seed}"))
    write_outputs(rows, args.json, args.plot)
    return 0 if any(row.outcome is not None for row in rows) else 1
