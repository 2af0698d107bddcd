"""Routing quality: the same sim fleet and workload behind each policy.

For each policy, start N sim replicas (KV capacity set so that each holds only part of the
workload's shared prefixes), a gateway with that policy in front of them, and drive a seeded
shared-prefix workload through the gateway with the load tester.  The hit rate comes from the
replicas' own counters (vllm:prefix_cache_hits / queries deltas), load from their request
counters.  The "oracle" is the same workload on one replica with ample KV: the best hit rate any
router could reach.

    python benchmarks/routing_quality.py                  # both scenarios, all policies
    python benchmarks/routing_quality.py --sglang-python /path/venv/bin/python   # + sglang-router

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

from prometheus_client import generate_latest
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
            f"{self.policy:<12} hit {self.hit_rate:6.3f}"
            f"  load max/mean {self.max_over_mean_load:4.2f}"
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


@contextlib.asynccontextmanager
async def _sglang_router(python: str, urls: Sequence[str]) -> AsyncIterator[str]:
    """SGLang's router (pip sglang-router, in the venv of `python`) in front of `urls`."""
    import os
    import socket

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # never download anything
    proc = await asyncio.create_subprocess_exec(
        python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--policy", "cache_aware", "--worker-urls", *urls, "--log-level", "warn",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            # Ready when every worker is registered and healthy (registration is asynchronous).
            for _ in range(300):
                try:
                    async with http.get(url + "/workers") as resp:
                        if resp.status == 200:
                            workers = (await resp.json()).get("workers", [])
                            if sum(1 for w in workers if w.get("is_healthy")) == len(urls):
                                break
                except (aiohttp.ClientError, ValueError):
                    pass
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("sglang-router did not start")
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def measure(
    policy: str, spec: FleetSpec, *, oracle: bool = False, sglang_python: str | None = None
) -> PolicyResult:
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
        async with contextlib.AsyncExitStack() as stack:
            if sglang_python is not None:
                target = await stack.enter_async_context(
                    _sglang_router(sglang_python, [s.url for s in sims])
                )
                registry = None
            else:
                gateway = await stack.enter_async_context(running_gateway(config))
                # Capacity is read from the replicas' /metrics before traffic starts.
                for _ in range(100):
                    if all(r.stats.num_gpu_blocks for r in gateway.fleet):
                        break
                    await asyncio.sleep(0.05)
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
                workload_params=dict(spec.workload_params),
                seed=spec.seed,
                model=MODEL,
                slo=parse_slo(spec.slo),
                replica_metrics=tuple(s.url for s in sims),
                label=policy,
            )
            quiet = Console(file=io.StringIO())
            outcome = await execute(settings, console=quiet)
            decisions = {} if registry is None else _decisions(generate_latest(registry).decode())
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


HOT_PREFIX = FleetSpec(
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
    rate_per_s=46.0,
)

SCENARIOS = {"shared-prefix": FleetSpec(), "hot-prefix": HOT_PREFIX}


async def _main(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for name in args.scenarios:
        spec = SCENARIOS[name]
        print(f"== {name}: {spec.workload} {dict(spec.workload_params)}, {spec.num_requests} "
              f"requests at {spec.rate_per_s}/s, {spec.replicas} replicas x "
              f"{spec.num_gpu_blocks} KV blocks, time_scale {spec.time_scale}")  # fmt: skip
        results = []
        if name == "shared-prefix":
            results.append(await measure("round_robin", spec, oracle=True))
            print(results[-1].row(), flush=True)
        for policy in args.policies:
            results.append(await measure(policy, spec))
            print(results[-1].row(), results[-1].decisions, flush=True)
        if args.sglang_python:
            results.append(await measure("cache_aware", spec, sglang_python=args.sglang_python))
            print(results[-1].row(), flush=True)
        out[name] = [{k: v for k, v in asdict(r).items() if k != "timeline"} for r in results]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["kv_aware", "cache_aware", "round_robin"])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument(
        "--sglang-python",
        metavar="PYTHON",
        help="python of a venv with `pip install sglang-router`: measure SGLang's router too",
    )
    args = parser.parse_args(argv)
    out = asyncio.run(_main(args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
