"""Benchmark of the simulated engine in virtual time (no HTTP, no sleeping).

Prints the engine's speed in simulated tokens (prompt + output) per wall second on a few
workloads, and the three demonstrations of `replicas.sim.demonstrations` (batching, chunked
prefill, prefix reuse) with their measured ratios.

    python benchmarks/sim_engine.py            # everything (about half a minute)
    python benchmarks/sim_engine.py --quick    # smaller speed workloads
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.demonstrations import (
    BATCHING_CAPS,
    batching_comparison,
    chunked_prefill_comparison,
    output_variance_workload,
    prefix_reuse,
    random_prompt,
)
from replicas.sim.engine import Engine, EngineRequest
from replicas.sim.virtual import percentile, run_virtual

Workload = list[tuple[float, EngineRequest]]


def _engine(**overrides: object) -> Engine:
    profile = PROFILES[DEFAULT_PROFILE]
    return Engine(EngineConfig.for_profile(profile, **overrides), CostModel(profile))


def shared_prefix_workload(groups: int, per_group: int, seed: int = 0) -> Workload:
    """SGLang's generated-shared-prefix shape: 2,048-token system prompts, 128-token questions,
    256 output tokens, Poisson arrivals at 40 req/s, shuffled."""
    rng = random.Random(seed)
    systems = [random_prompt(rng, 2048) for _ in range(groups)]
    reqs = [
        EngineRequest(f"g{g}-{i}", systems[g] + random_prompt(rng, 128), 256, seed=g * 1000 + i)
        for g in range(groups)
        for i in range(per_group)
    ]
    rng.shuffle(reqs)
    t = 0.0
    out: Workload = []
    for r in reqs:
        t += rng.expovariate(40.0)
        out.append((t, r))
    return out


def speed(name: str, make_engine: Callable[[], Engine], workload: Workload) -> None:
    run = run_virtual(make_engine(), workload)
    tokens = run.prompt_tokens + run.output_tokens
    print(
        f"  {name:<46} {tokens:>10,} tok in {run.wall_s:6.2f} s wall = "
        f"{run.simulated_tokens_per_wall_s / 1e6:5.2f} M tok/s "
        f"({run.output_tokens / run.wall_s / 1e6:4.2f} M output tok/s, "
        f"{run.num_steps:,} steps, {run.duration_s:,.0f} s virtual)"
    )


def speed_step_api(workload: Workload) -> None:
    """The per-token `step()` path the real-time server uses, for comparison."""
    engine = _engine(num_gpu_blocks=4096, max_num_seqs=256)
    for _, r in workload:
        engine.add_request(r)
    t0 = time.perf_counter()
    outputs = 0
    while engine.has_unfinished():
        outputs += len(engine.step().outputs)
    wall = time.perf_counter() - t0
    prompt = sum(len(r.prompt_token_ids) for _, r in workload)
    print(
        f"  {'Engine.step() with per-token outputs (server path)':<46} "
        f"{prompt + outputs:>10,} tok in {wall:6.2f} s wall = "
        f"{(prompt + outputs) / wall / 1e6:5.2f} M tok/s "
        f"({outputs / wall / 1e6:4.2f} M output tok/s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller speed workloads")
    args = parser.parse_args()
    scale = 1 if args.quick else 4

    print("Virtual-time engine speed (target >= 1M simulated tokens per wall second)")
    variance = output_variance_workload(1536, num_requests=1000 * scale)
    speed(
        f"output variance, {1000 * scale:,} req, continuous",
        lambda: _engine(num_gpu_blocks=4096, max_num_seqs=256),
        variance,
    )
    speed(
        f"output variance, {1000 * scale:,} req, static",
        lambda: _engine(num_gpu_blocks=4096, max_num_seqs=256, scheduling="static"),
        variance,
    )
    shared = shared_prefix_workload(16 * scale, 16)
    speed(
        f"shared prefix, {len(shared):,} req, prefix caching",
        lambda: _engine(max_num_seqs=256),
        shared,
    )
    speed_step_api(output_variance_workload(1536, num_requests=1000))

    print("\nDemonstration 1: continuous vs static batching (1,000 x 512-token prompts at once,")
    print("  exponential outputs mean 128, max_num_seqs 256, 4,096 KV blocks, budget 8,192)")
    for cap in BATCHING_CAPS:
        c = batching_comparison(cap)
        print(
            f"  cap {cap:>5}: continuous {c.continuous.output_throughput_tok_s:7,.0f} tok/s "
            f"({c.continuous.duration_s:6.1f} s), static {c.static.output_throughput_tok_s:7,.0f}"
            f" tok/s ({c.static.duration_s:6.1f} s) -> {c.throughput_ratio:4.2f}x"
        )

    print("\nDemonstration 2: chunked prefill (16 decode streams, a 16k-token prompt every 1 s,")
    print("  budget 2,048)")
    ch = chunked_prefill_comparison()
    for label, run in (("chunked", ch.chunked), ("unchunked", ch.unchunked)):
        itls = run.itls(ch.stream_ids)
        longs = [r.ttft_s for rid, r in run.requests.items() if rid.startswith("long-")]
        print(
            f"  {label:<9}: ITL p50 {percentile(itls, 50) * 1e3:6.1f} ms, "
            f"p99 {percentile(itls, 99) * 1e3:6.1f} ms, max {max(itls) * 1e3:6.1f} ms; "
            f"16k-prompt TTFT p50 {percentile(longs, 50) * 1e3:6.0f} ms"
        )
    print(f"  p99 ITL ratio (unchunked / chunked): {ch.p99_itl_ratio:.2f}x")

    print("\nDemonstration 3: prefix reuse (2,040 shared tokens + 1,024 own tokens)")
    p = prefix_reuse()
    print(
        f"  second request cached_tokens {p.second_cached_tokens} "
        f"(block-aligned shared part {p.expected_cached_tokens}); "
        f"TTFT {p.first_ttft_s * 1e3:.1f} ms -> {p.second_ttft_s * 1e3:.1f} ms "
        f"(ratio {p.ttft_ratio:.3f}; uncached-token ratio {p.uncached_ratio:.3f})"
    )


if __name__ == "__main__":
    main()
