"""Routing quality: the same sim fleet and workload behind each policy.

For each policy, start N sim replicas (KV capacity set so that each holds only part of the
workload's shared prefixes), a gateway with that policy in front of them, and drive a seeded
shared-prefix workload through the gateway with the load tester.  The hit rate comes from the
replicas' own counters (vllm:prefix_cache_hits / queries deltas), load from their request
counters.  The "oracle" is the same workload on one replica with ample KV: the best hit rate any
router could reach.

    python benchmarks/routing_quality.py                # full run, prints a table
    python benchmarks/routing_quality.py --quick        # the integration test's scale

The integration tests (tests/integration/test_cache_routing.py) call `measure` at a small scale.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import statistics
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console

from loadtest.drivers import DriverConfig
from loadtest.runner import RunSettings, execute
from loadtest.stats import parse_slo
from replicas.sim import SimReplica, SimSettings, start_replica
from router.app import running_gateway
from router.config import RouterConfig

__all__ = ["FleetSpec", "PolicyResult", "measure", "running_fleet"]

MODEL = "sim-model"


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The sim fleet and the workload driven through it."""

    replicas: int = 4
    num_gpu_blocks: int = 384  # per replica, 16-token blocks
    oracle_gpu_blocks: int = 8192
    time_scale: float = 0.05
    max_num_seqs: int | None = None
    workload: str = "shared-prefix"
    workload_params: Mapping[str, Any] = field(
        default_factory=lambda: {
            "num_groups": 16,
            "prompts_per_group": 10,
            "system_prompt_len": 1024,
            "question_len": 64,
            "output_len": 16,
        }
    )
    num_requests: int = 160
    rate_per_s: float = 40.0
    concurrency: int | None = None
    seed: int = 1
    slo: str = "ttft:500"
    policy_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    hit_rate: float
    completed: int
    failed: int
    per_replica_requests: dict[str, int]
    max_over_mean_load: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    goodput_rps: float | None
    throughput_rps: float
    decisions: dict[str, float]
    # (send time from the first request in s, replica, TTFT in ms, cached tokens) per request
    timeline: list[tuple[float, str, float, int]] = field(default_factory=list, repr=False)

    def row(self) -> str:
        shares = "/".join(str(n) for n in self.per_replica_requests.values())
        goodput = "-" if self.goodput_rps is None else f"{self.goodput_rps:.1f}"
        return (
            f"{self.policy:<12} hit {self.hit_rate:6.3f}  load max/mean {self.max_over_mean_load:4.2f}"
            f" ({shares})  TTFT p50 {self.ttft_p50_ms:7.1f} ms p99 {self.ttft_p99_ms:7.1f} ms"
            f"  goodput {goodput} req/s  ok {self.completed} failed {self.failed}"
        )


@contextlib.asynccontextmanager
async def running_fleet(
    count: int, spec: FleetSpec, num_gpu_blocks: int, **extra: Any
) -> AsyncIterator[list[SimReplica]]:
    """`count` sim replicas serving MODEL with the given KV capacity."""
    sims: list[SimReplica] = []
    try:
        for i in range(count):
            settings = SimSettings(
                port=0,
                model=MODEL,
                seed=i,
                time_scale=spec.time_scale,
                num_gpu_blocks=num_gpu_blocks,
                max_num_seqs=spec.max_num_seqs,
                **extra,
            )
            sims.append(await start_replica(settings))
        yield sims
    finally:
        for sim in reversed(sims):
            await sim.stop()


def _decisions(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("fleet_router_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


async def measure(policy: str, spec: FleetSpec, *, oracle: bool = False) -> PolicyResult:
    """Drive `spec`'s workload through a gateway running `policy` (or one big replica)."""
    count = 1 if oracle else spec.replicas
    blocks = spec.oracle_gpu_blocks if oracle else spec.num_gpu_blocks
    async with running_fleet(count, spec, blocks) as sims:
        config = RouterConfig(
            replicas=tuple(f"r{i}={s.url}" for i, s in enumerate(sims)),
            sim_replicas=0,
            policy=policy,
            policy_options=dict(spec.policy_options),
            seed=spec.seed,
            health_interval_s=0.2,
            scrape_interval_s=0.1,
        )
        async with running_gateway(config) as gateway:
            # Capacity is read from the replicas' /metrics before traffic starts.
            for _ in range(100):
                if all(r.stats.num_gpu_blocks for r in gateway.fleet):
                    break
                await asyncio.sleep(0.05)
            settings = RunSettings(
                targets=(gateway.url,),
                workload=spec.workload,
                driver=DriverConfig(
                    num_requests=spec.num_requests,
                    rate_per_s=spec.rate_per_s,
                    concurrency=spec.concurrency,
                    seed=spec.seed,
                ),
                workload_params=dict(spec.workload_params),
                seed=spec.seed,
                model=MODEL,
                slo=parse_slo(spec.slo),
                replica_metrics=tuple(s.url for s in sims),
                label=policy,
            )
            quiet = Console(file=io.StringIO())
            outcome = await execute(settings, console=quiet)
            registry_text = gateway.state.metrics.registry
            from prometheus_client import generate_latest

            decisions = _decisions(generate_latest(registry_text).decode())
    summary = outcome.summary
    server = summary.server
    assert server is not None
    per_replica = dict(server.per_replica_requests)
    loads = list(per_replica.values())
    mean = statistics.fmean(loads) if loads else 0.0
    ttft = summary.latency["ttft"]
    records = sorted(outcome.result.records, key=lambda r: r.send_s)
    t0 = records[0].send_s if records else 0.0
    timeline = [
        (r.send_s - t0, r.replica or "?", (r.ttft_s or 0.0) * 1000, r.cached_tokens or 0)
        for r in records
    ]
    return PolicyResult(
        policy="oracle" if oracle else policy,
        hit_rate=server.prefix_cache_hit_rate or 0.0,
        completed=summary.completed,
        failed=summary.failed,
        per_replica_requests=per_replica,
        max_over_mean_load=max(loads) / mean if mean else math.inf,
        ttft_p50_ms=ttft.median,
        ttft_p99_ms=ttft.percentiles.get(99, ttft.median),
        goodput_rps=summary.request_goodput,
        throughput_rps=summary.request_throughput,
        decisions=decisions,
        timeline=timeline,
    )


async def _main(args: argparse.Namespace) -> None:
    spec = FleetSpec()
    results = [await measure("round_robin", spec, oracle=True)]
    for policy in args.policies:
        results.append(await measure(policy, spec))
    for r in results:
        print(r.row())
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["kv_aware", "cache_aware", "round_robin"])
    parser.add_argument("--json", action="store_true")
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
