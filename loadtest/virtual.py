"""The load tester's workloads in the simulated engine's virtual time (no HTTP, no sleeping).

Used by the demo for the two engine-level comparisons, where wall-clock noise of a shared
2-core machine would only blur exact modelled figures:

* :func:`batching_ratio`: continuous over static batching, output-token throughput, on the
  ``output-variance`` workload (everything at t=0, exponential outputs capped);
* :func:`chunked_prefill_ratio`: p99 inter-token latency without over with chunked prefill on
  the ``long-prompt-mix`` workload at a Poisson rate.

Prompts are tokenized with the sim's own tokenizer, so lengths are the workload's exactly.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from loadtest.arrivals import arrival_offsets
from loadtest.workloads import make_workload, take_requests
from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.engine import Engine, EngineRequest
from replicas.sim.tokenizer import SimTokenizer
from replicas.sim.virtual import VirtualRun, percentile, run_virtual

__all__ = [
    "BatchingResult",
    "ChunkedPrefillResult",
    "batching_ratio",
    "chunked_prefill_ratio",
    "engine_arrivals",
]


def engine_arrivals(
    workload: str,
    params: Mapping[str, str | int | float | bool],
    count: int,
    *,
    rate_per_s: float | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
) -> list[tuple[float, EngineRequest]]:
    """The first ``count`` requests of a single-turn workload as timed engine requests.

    Each generates exactly the workload's ``max_tokens``; ``max_tokens`` here sets the limit
    the engine is told instead (static batching reserves KV for it, not knowing the length).
    """
    specs = take_requests(make_workload(workload, params, seed=seed), count)
    offsets = (
        [0.0] * len(specs)
        if rate_per_s is None
        else arrival_offsets(len(specs), rate_per_s, 1.0, random.Random(seed))
    )
    tokenizer = SimTokenizer()
    out = []
    for i, (at, spec) in enumerate(zip(offsets, specs, strict=True)):
        if spec.prompt is None:
            raise ValueError(f"{workload}: only single-turn completion workloads run here")
        ids = tuple(tokenizer.encode(spec.prompt))
        request = EngineRequest(
            spec.request_id,
            ids,
            spec.max_tokens,
            max_tokens=spec.max_tokens if max_tokens is None else max(max_tokens, spec.max_tokens),
            seed=i,
        )
        out.append((at, request))
    return out


def _run(arrivals: list[tuple[float, EngineRequest]], config: EngineConfig) -> VirtualRun:
    return run_virtual(Engine(config, CostModel(PROFILES[DEFAULT_PROFILE])), arrivals)


@dataclass(frozen=True, slots=True)
class BatchingResult:
    cap: int
    num_requests: int
    continuous_tok_s: float
    static_tok_s: float

    @property
    def ratio(self) -> float:
        return self.continuous_tok_s / self.static_tok_s


def batching_ratio(
    cap: int,
    num_requests: int,
    *,
    num_gpu_blocks: int = 4096,
    max_num_seqs: int = 256,
    seed: int = 0,
) -> BatchingResult:
    """Continuous vs static batching, same KV capacity, sequence limit and token budget."""
    # Every request is sent with max_tokens = cap and stops at its own (exponential) length,
    # as in the study: static batching can only plan for the cap.
    arrivals = engine_arrivals(
        "output-variance",
        {"cap": cap, "num_prompts": num_requests},
        num_requests,
        max_tokens=cap,
        seed=seed,
    )
    runs = {
        mode: _run(
            arrivals,
            EngineConfig(
                num_gpu_blocks=num_gpu_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=8192,
                scheduling=mode,
            ),
        )
        for mode in ("continuous", "static")
    }
    return BatchingResult(
        cap,
        num_requests,
        runs["continuous"].output_throughput_tok_s,
        runs["static"].output_throughput_tok_s,
    )


@dataclass(frozen=True, slots=True)
class ChunkedPrefillResult:
    num_requests: int
    rate_per_s: float
    chunked_p99_itl_s: float
    unchunked_p99_itl_s: float
    chunked_p50_ttft_s: float
    unchunked_p50_ttft_s: float

    @property
    def ratio(self) -> float:
        """p99 ITL without chunked prefill over with it (> 1: chunking smooths decoding)."""
        return self.unchunked_p99_itl_s / self.chunked_p99_itl_s


def chunked_prefill_ratio(
    num_requests: int,
    *,
    rate_per_s: float = 8.0,
    long_len: int = 8192,
    long_fraction: float = 0.2,
    budget_tokens: int = 512,
    seed: int = 0,
) -> ChunkedPrefillResult:
    """Chunked prefill on vs off with a ``budget_tokens`` step budget."""
    params = {
        "num_prompts": num_requests,
        "short_len": 256,
        "long_len": long_len,
        "long_fraction": long_fraction,
        "output_len": 128,
    }
    arrivals = engine_arrivals(
        "long-prompt-mix", params, num_requests, rate_per_s=rate_per_s, seed=seed
    )
    base = EngineConfig(
        num_gpu_blocks=PROFILES[DEFAULT_PROFILE].default_num_gpu_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=budget_tokens,
    )
    chunked = _run(arrivals, base)
    unchunked = _run(
        arrivals,
        EngineConfig(
            num_gpu_blocks=base.num_gpu_blocks,
            max_num_seqs=256,
            max_num_batched_tokens=budget_tokens,
            enable_chunked_prefill=False,
        ),
    )
    return ChunkedPrefillResult(
        num_requests=num_requests,
        rate_per_s=rate_per_s,
        chunked_p99_itl_s=percentile(chunked.itls(), 99),
        unchunked_p99_itl_s=percentile(unchunked.itls(), 99),
        chunked_p50_ttft_s=percentile(chunked.ttfts(), 50),
        unchunked_p50_ttft_s=percentile(unchunked.ttfts(), 50),
    )
