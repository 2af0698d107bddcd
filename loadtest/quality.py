"""Routing quality: one seeded workload through one routing policy on a fresh sim fleet.

For a :class:`Scenario`, :func:`measure` starts sim replicas (KV capacity set so that each holds
only part of the workload's shared prefixes), a gateway with the policy in front of them, and
drives the workload through the gateway with the load tester.  The hit rate comes from the
replicas' own counters (``vllm:prefix_cache_hits`` / ``queries`` deltas), load from their
request counters, TTFT from the streaming client.  The oracle is the same workload on one
replica with ample KV: the best hit rate any router could reach.

``benchmarks/routing_quality.py`` prints these figures for every policy;
``tests/integration/test_cache_routing.py`` asserts on them, on the same :data:`SCENARIOS`.
"""

from __future__ import annotations

import io
import math
import statistics
import tempfile
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from rich.console import Console

from loadtest.drivers import DriverConfig
from loadtest.fleet import FleetSettings, running_fleet, running_peer_router, running_ready_gateway
from loadtest.runner import RunSettings, execute
from loadtest.stats import parse_slo

__all__ = [
    "HOT_PREFIX",
    "MODEL",
    "SCENARIOS",
    "SHARED_PREFIX",
    "PolicyResult",
    "Scenario",
    "decision_counts",
    "measure",
]

MODEL = "sim-model"

WorkloadParams = Mapping[str, str | int | float | bool]


@dataclass(frozen=True, slots=True)
class Scenario:
    """The sim fleet and the workload driven through it."""

    replicas: int = 4
    num_gpu_blocks: int = 384  # per replica, 16-token blocks
    oracle_gpu_blocks: int = 8192
    time_scale: float = 0.05
    max_num_seqs: int | None = None
    workload: str = "shared-prefix"
    workload_params: WorkloadParams = field(
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
    policy_options: Mapping[str, str | int | float | bool] = field(default_factory=dict)


# Shared prefix, SGLang's generated-shared-prefix scaled down (16 groups x 10 prompts, 1,024-token
# system prompts, 64-token questions, 16 output tokens; SGLang's is 64 x 16, 2,048 / 128 / 256).
# A replica's 384 blocks of 16 tokens hold about 5 of the 16 prefixes: the fleet of 4 holds them
# all only if the router keeps each group on one replica.
SHARED_PREFIX = Scenario()

# Hot prefix: one 1,024-token prefix shared by every request, questions of 51..972 tokens (vLLM
# bench random, range ratio 0.9), at 52 req/s with the sims 4x slower than an H100: about three
# and a half replicas' worth of prefill work (~90% of the fleet), so one replica cannot serve it.
# Once every replica holds the prefix, what is left is balancing uneven prefill work; at 46 req/s
# (~80%) round robin's evenly spaced turns were as good at the median as any greedy choice, even
# one that simulates every replica's engine exactly (docs/routing.md), so the rate is where the
# choice matters for the median as well as the tail.
HOT_PREFIX = Scenario(
    num_gpu_blocks=4096,
    time_scale=4.0,
    workload="random",
    workload_params={
        "num_prompts": 10_000,
        "prefix_len": 1024,
        "input_len": 512,
        "range_ratio": 0.9,
        "output_len": 16,
    },
    num_requests=200,
    rate_per_s=52.0,
)

SCENARIOS: Mapping[str, Scenario] = {"shared-prefix": SHARED_PREFIX, "hot-prefix": HOT_PREFIX}


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """What one policy achieved on one scenario."""

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
    decisions: dict[str, float]  # the gateway's decisions by reason (empty for a peer router)
    # (send time from the first request in s, replica, TTFT in ms, cached tokens) per request
    timeline: list[tuple[float, str, float, int]] = field(default_factory=list, repr=False)

    def row(self) -> str:
        """One line for a console report."""
        shares = "/".join(str(n) for n in self.per_replica_requests.values())
        goodput = "-" if self.goodput_rps is None else f"{self.goodput_rps:.1f}"
        return (
            f"{self.policy:<12} hit {self.hit_rate:6.3f}"
            f"  load max/mean {self.max_over_mean_load:4.2f}"
            f" ({shares})  TTFT p50 {self.ttft_p50_ms:7.1f} ms p99 {self.ttft_p99_ms:7.1f} ms"
            f"  goodput {goodput} req/s  ok {self.completed} failed {self.failed}"
        )


def decision_counts(registry: CollectorRegistry) -> dict[str, float]:
    """``fleet_router_decisions_total`` summed by reason, over every policy."""
    out: dict[str, float] = {}
    for family in registry.collect():
        if family.name != "fleet_router_decisions":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                reason = sample.labels["reason"]
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


async def measure(
    policy: str, spec: Scenario, *, oracle: bool = False, sglang_python: str | None = None
) -> PolicyResult:
    """Drive ``spec``'s workload through a gateway running ``policy`` on a fresh fleet.

    ``oracle``: one replica with ``spec.oracle_gpu_blocks`` (the gateway has nothing to choose).
    ``sglang_python``: SGLang's router (``cache_aware``, installed in the venv of that python)
    instead of our gateway.
    """
    fleet = FleetSettings(
        count=1 if oracle else spec.replicas,
        time_scale=spec.time_scale,
        num_gpu_blocks=spec.oracle_gpu_blocks if oracle else spec.num_gpu_blocks,
        extra=(("model", MODEL), ("max_num_seqs", spec.max_num_seqs)),
    )
    registry: CollectorRegistry | None = None
    async with AsyncExitStack() as stack:
        urls = await stack.enter_async_context(running_fleet(fleet))
        if sglang_python is not None:
            log_path = stack.enter_context(tempfile.TemporaryDirectory()) + "/sglang-router.log"
            target = await stack.enter_async_context(
                running_peer_router(
                    "sglang_router", "cache_aware", urls, log_path=log_path, python=sglang_python
                )
            )
        else:
            from router.config import RouterConfig

            config = RouterConfig(
                replicas=tuple(f"r{i}={url}" for i, url in enumerate(urls)),
                sim_replicas=0,
                policy=policy,
                policy_options=dict(spec.policy_options),
                seed=spec.seed,
                health_interval_s=0.2,
                scrape_interval_s=0.1,
            )
            gateway = await stack.enter_async_context(running_ready_gateway(config))
            target = gateway.url
            registry = gateway.state.metrics.registry
        settings = RunSettings(
            targets=(target,),
            workload=spec.workload,
            driver=DriverConfig(
                num_requests=spec.num_requests,
                rate_per_s=spec.rate_per_s,
                concurrency=spec.concurrency,
                seed=spec.seed,
            ),
            workload_params=spec.workload_params,
            seed=spec.seed,
            model=MODEL,
            slo=parse_slo(spec.slo),
            replica_metrics=urls,
            label=policy,
        )
        outcome = await execute(settings, console=Console(file=io.StringIO()))
        decisions = {} if registry is None else decision_counts(registry)
    summary = outcome.summary
    server = summary.server
    if server is None:  # replica_metrics were given: execute always scrapes them
        raise RuntimeError("no replica counters")
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
        policy="oracle" if oracle else ("sglang-router" if sglang_python else policy),
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
