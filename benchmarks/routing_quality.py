"""Routing quality: the same sim fleet and workload behind each policy.

For each scenario of :data:`loadtest.quality.SCENARIOS` and each policy, fresh sim replicas, a
gateway with that policy and the seeded workload through it (:func:`loadtest.quality.measure`);
the hit rate comes from the replicas' own counters, load from their request counters.  The
"oracle" is the same workload on one replica with ample KV: the best hit rate any router could
reach.

    python benchmarks/routing_quality.py                  # both scenarios, all policies
    python benchmarks/routing_quality.py --sglang-python /path/venv/bin/python   # + sglang-router
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from loadtest.quality import SCENARIOS, measure


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
