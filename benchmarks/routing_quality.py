"""Routing quality: the same sim fleet and workload behind each policy.

For each scenario of :data:`loadtest.quality.SCENARIOS` and each policy, fresh sim replicas, a
gateway with that policy and the seeded workload through it (:func:`loadtest.quality.measure`);
the hit rate comes from the replicas' own counters, load from their request counters.  The
"oracle" is the same workload on one replica with ample KV: the best hit rate any router could
reach.

    python benchmarks/routing_quality.py                  # both scenarios, all policies
    python benchmarks/routing_quality.py --sglang-python /path/venv/bin/python   # + sglang-router
    python benchmarks/routing_quality.py --virtual --seeds 12   # hot prefix in virtual time

``--virtual``: the hot-prefix scenario without HTTP or sleeping, so without wall-clock noise:
one sim ``Engine`` per replica, stepped by its cost model (``time_scale`` applied; a step's
tokens appear at its end, as in the sim server), and the policy in the loop fed what the router
would know (in flight, pending prefill tokens until the first token, a real ``PrefixIndex`` over
token blocks, ``running``/``waiting`` as of the last 0.1 s scrape).  Beside round robin and
kv_aware, ``clairvoyant``: for each request, a copy of every replica's engine is run with it
added and the earliest first token wins; a greedy bound, not an optimum.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from loadtest.quality import HOT_PREFIX, SCENARIOS, Scenario, measure
from loadtest.virtual import engine_arrivals
from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.engine import Engine, EngineRequest
from replicas.sim.virtual import percentile
from router.policies.base import Policy, ReplicaView, RoutingRequest
from router.policies.kv_aware import KvAware, KvAwareSettings
from router.prefix.index import PrefixIndex
from router.prefix.keys import routing_key_hashes

BLOCK_TOKENS = 16
VIRTUAL_SCRAPE_S = 0.1


def _first_token_s(engine: Engine, request: EngineRequest, start_s: float, scale: float) -> float:
    """When ``request`` would get its first token on a copy of ``engine`` (steps from start_s)."""
    trial = copy.deepcopy(engine)
    trial.add_request(request)
    t = start_s
    while True:
        step = trial.step_summary()
        t += step.duration_s * scale
        if any(r.request_id == request.request_id for r in step.first_tokens):
            return t


def virtual_run(policy: str, spec: Scenario) -> tuple[float, float, list[int]]:
    """(TTFT p50 ms, p99 ms, requests per replica) of ``spec`` routed by ``policy`` in virtual
    time: ``round_robin``, ``kv_aware`` (``spec.policy_options``) or ``clairvoyant``."""
    n = spec.replicas
    arrivals = engine_arrivals(
        spec.workload,
        spec.workload_params,
        spec.num_requests,
        rate_per_s=spec.rate_per_s,
        seed=spec.seed,
    )
    profile = PROFILES[DEFAULT_PROFILE]
    config = EngineConfig(
        num_gpu_blocks=spec.num_gpu_blocks, max_num_seqs=profile.default_max_num_seqs
    )
    engines = [Engine(config, CostModel(profile)) for _ in range(n)]
    ids = [f"r{i}" for i in range(n)]
    kv: Policy = KvAware(
        KvAwareSettings(seed=spec.seed, **{k: float(v) for k, v in spec.policy_options.items()})
    )
    index = PrefixIndex()
    for rid in ids:
        index.set_capacity(rid, spec.num_gpu_blocks)
    step_end: list[float | None] = [None] * n  # end of the step in progress
    step_out: list[tuple[list[str], list[str]]] = [([], [])] * n
    in_flight = [0] * n
    pending = [0] * n
    scraped = [(0, 0)] * n
    next_scrape = 0.0
    leases: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    sent: dict[str, float] = {}
    ttft: dict[str, float] = {}
    turn = 0

    def start_step(k: int, now: float) -> None:
        engine = engines[k]
        if not engine.has_unfinished():
            step_end[k] = None
            return
        step = engine.step_summary()
        step_end[k] = now + step.duration_s * spec.time_scale
        step_out[k] = (
            [r.request_id for r in step.first_tokens],
            [r.request_id for r in step.finished],
        )

    i = 0
    while i < len(arrivals) or any(e is not None for e in step_end):
        busy = [(e, k) for k, e in enumerate(step_end) if e is not None]
        next_step = min(busy) if busy else (float("inf"), -1)
        if i < len(arrivals) and arrivals[i][0] <= next_step[0]:
            now, request = arrivals[i]
            i += 1
            while next_scrape <= now:
                scraped = [(e.stats().num_running, e.stats().num_waiting) for e in engines]
                next_scrape += VIRTUAL_SCRAPE_S
            tokens = len(request.prompt_token_ids)
            hashes, _ = routing_key_hashes(
                "completions", {"prompt": list(request.prompt_token_ids)}, "m", BLOCK_TOKENS
            )
            matches = index.match("m", hashes)
            if policy == "round_robin":
                k = turn % n
                turn += 1
            elif policy == "clairvoyant":
                k = min(
                    range(n),
                    key=lambda j: _first_token_s(
                        engines[j], request, step_end[j] or now, spec.time_scale
                    ),
                )
            else:
                routed = RoutingRequest(
                    model="m",
                    block_hashes=hashes,
                    prompt_units=tokens,
                    prompt_tokens=tokens,
                    block_units=BLOCK_TOKENS,
                )
                views = [
                    ReplicaView(
                        ids[j],
                        in_flight=in_flight[j],
                        running=scraped[j][0],
                        waiting=scraped[j][1],
                        capacity_blocks=spec.num_gpu_blocks,
                        matched_blocks=matches.get(ids[j], 0),
                        pending_prefill_tokens=pending[j],
                        held_blocks=index.holds(ids[j]),
                    )
                    for j in range(n)
                ]
                k = ids.index(kv.choose(routed, views).replica_id)
            uncached = max(0, tokens - matches.get(ids[k], 0) * BLOCK_TOKENS)
            index.insert("m", hashes, ids[k])
            in_flight[k] += 1
            pending[k] += uncached
            leases[request.request_id] = (k, uncached, hashes)
            sent[request.request_id] = now
            engines[k].add_request(request)
            if step_end[k] is None:
                start_step(k, now)
        else:
            now, k = next_step
            firsts, finished = step_out[k]
            for rid in firsts:
                ttft[rid] = now - sent[rid]
                pending[k] -= leases[rid][1]
            for rid in finished:
                in_flight[k] -= 1
                index.refresh("m", leases[rid][2], ids[k])
            start_step(k, now)
    values = [ttft[rid] * 1000 for rid in sent]
    loads = [sum(1 for k, _, _ in leases.values() if k == j) for j in range(n)]
    return percentile(values, 50), percentile(values, 99), loads


def _virtual(spec: Scenario, seeds: int) -> None:
    print(f"== hot-prefix in virtual time, {spec.rate_per_s}/s, seeds 1..{seeds}: "
          "TTFT p50 / p99 ms, and / round robin's")  # fmt: skip
    ratios: dict[str, list[tuple[float, float]]] = {"kv_aware": [], "clairvoyant": []}
    for seed in range(1, seeds + 1):
        run = replace(spec, seed=seed)
        rr = virtual_run("round_robin", run)
        line = f"seed {seed:2d}  round_robin {rr[0]:6.1f} / {rr[1]:6.1f}"
        for policy, out in ratios.items():
            p50, p99, _loads = virtual_run(policy, run)
            out.append((p50 / rr[0], p99 / rr[1]))
            line += f"  {policy} {p50:6.1f} / {p99:6.1f} ({out[-1][0]:.2f} / {out[-1][1]:.2f})"
        print(line, flush=True)
    for policy, out in ratios.items():
        p50s, p99s = [a for a, _ in out], [b for _, b in out]
        print(f"{policy:<12} / round robin: p50 mean {statistics.fmean(p50s):.3f} "
              f"(max {max(p50s):.3f}), p99 mean {statistics.fmean(p99s):.3f} "
              f"(max {max(p99s):.3f})")  # fmt: skip


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
    parser.add_argument("--virtual", action="store_true", help="hot prefix in virtual time")
    parser.add_argument("--seeds", type=int, default=12, help="workload seeds for --virtual")
    parser.add_argument("--rate", type=float, help="--virtual: requests/s (default: scenario's)")
    args = parser.parse_args(argv)
    if args.virtual:
        spec = HOT_PREFIX if args.rate is None else replace(HOT_PREFIX, rate_per_s=args.rate)
        _virtual(spec, args.seeds)
        return
    out = asyncio.run(_main(args))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
