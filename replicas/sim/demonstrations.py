"""The three demonstrations of the simulated engine, in virtual time.

Each builds a workload, runs it through `run_virtual` and returns the figures that
docs/simulator.md quotes; tests assert on them and benchmarks/sim_engine.py prints them.

1. `batching_comparison`: continuous vs static batching on the output-variance workload
   (Anyscale's study: 1,000 prompts of 512 tokens at once, exponential output lengths of mean 128
   capped at 32/128/512/1536).
2. `chunked_prefill_comparison`: decodes running while 16k-token prompts arrive, budget 2,048;
   p99 inter-token latency with and without chunked prefill.
3. `prefix_reuse`: a second request sharing a 2k-token prefix with the first.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.engine import Engine, EngineRequest
from replicas.sim.lengths import OutputLengthDistribution, draw_output_length
from replicas.sim.virtual import VirtualRun, percentile, run_virtual

__all__ = [
    "BATCHING_CAPS",
    "BatchingComparison",
    "ChunkedPrefillComparison",
    "PrefixReuse",
    "batching_comparison",
    "chunked_prefill_comparison",
    "prefix_reuse",
    "random_prompt",
]

BATCHING_CAPS = (32, 128, 512, 1536)


def random_prompt(rng: random.Random, length: int, vocab: int = 128_000) -> tuple[int, ...]:
    """``length`` random token ids (distinct prompts share no prefix block)."""
    return tuple(rng.randrange(vocab) for _ in range(length))


def _engine(config: EngineConfig, profile: str = DEFAULT_PROFILE) -> Engine:
    return Engine(config, CostModel(PROFILES[profile]))


# --- 1. continuous vs static batching ---------------------------------------------------------
@dataclass(frozen=True)
class BatchingComparison:
    cap: int
    continuous: VirtualRun
    static: VirtualRun

    @property
    def throughput_ratio(self) -> float:
        """Output-token throughput of continuous over static batching."""
        return self.continuous.output_throughput_tok_s / self.static.output_throughput_tok_s


def output_variance_workload(
    cap: int,
    *,
    num_requests: int = 1000,
    prompt_tokens: int = 512,
    mean_output_tokens: float = 128,
    seed: int = 0,
) -> list[tuple[float, EngineRequest]]:
    """All requests at t=0; output lengths exponential(mean) capped at ``cap`` = max_tokens."""
    rng = random.Random(seed)
    dist = OutputLengthDistribution("exponential", mean=mean_output_tokens)
    out = []
    for i in range(num_requests):
        rid = f"req-{i}"
        length = draw_output_length(dist, seed, rid, max_tokens=cap)
        prompt = random_prompt(rng, prompt_tokens)
        out.append((0.0, EngineRequest(rid, prompt, length, max_tokens=cap, seed=i)))
    return out


def batching_comparison(
    cap: int,
    *,
    num_requests: int = 1000,
    num_gpu_blocks: int = 4096,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    seed: int = 0,
) -> BatchingComparison:
    """Both modes with the same max_num_seqs, budget and KV capacity (default 4,096 blocks =
    65,536 tokens: the memory a 13B-class model leaves for KV on a 40 GB GPU, as in the study)."""
    workload = output_variance_workload(cap, num_requests=num_requests, seed=seed)
    runs = {}
    for mode in ("continuous", "static"):
        config = EngineConfig(
            num_gpu_blocks=num_gpu_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            scheduling=mode,
        )
        runs[mode] = run_virtual(_engine(config), workload)
    return BatchingComparison(cap, runs["continuous"], runs["static"])


# --- 2. chunked prefill ------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkedPrefillComparison:
    chunked: VirtualRun
    unchunked: VirtualRun
    stream_ids: tuple[str, ...]

    def p99_itl_s(self, run: VirtualRun) -> float:
        return percentile(run.itls(self.stream_ids), 99)

    @property
    def p99_itl_ratio(self) -> float:
        """p99 inter-token latency of the decode streams, without over with chunking."""
        return self.p99_itl_s(self.unchunked) / self.p99_itl_s(self.chunked)


def chunked_prefill_comparison(
    *,
    num_streams: int = 16,
    stream_prompt_tokens: int = 512,
    stream_output_tokens: int = 600,
    long_prompt_tokens: int = 16_384,
    num_long_prompts: int = 20,
    long_prompt_interval_s: float = 1.0,
    budget_tokens: int = 2048,
    seed: int = 0,
) -> ChunkedPrefillComparison:
    """Decode streams start at t=0; a long prompt arrives every interval from t=0.5 s.

    Without chunking a prompt longer than the budget is still prefilled whole in one step
    (real vLLM would need ``max_num_batched_tokens >= max_model_len`` for that: same effect).
    """
    rng = random.Random(seed)
    arrivals: list[tuple[float, EngineRequest]] = []
    streams = []
    for i in range(num_streams):
        rid = f"stream-{i}"
        streams.append(rid)
        prompt = random_prompt(rng, stream_prompt_tokens)
        arrivals.append((0.0, EngineRequest(rid, prompt, stream_output_tokens, seed=i)))
    for k in range(num_long_prompts):
        prompt = random_prompt(rng, long_prompt_tokens)
        t = 0.5 + k * long_prompt_interval_s
        arrivals.append((t, EngineRequest(f"long-{k}", prompt, 16, seed=1000 + k)))
    base = EngineConfig(
        num_gpu_blocks=PROFILES[DEFAULT_PROFILE].default_num_gpu_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=budget_tokens,
    )
    chunked = run_virtual(_engine(base), arrivals)
    unchunked = run_virtual(
        _engine(dataclasses.replace(base, enable_chunked_prefill=False)), arrivals
    )
    return ChunkedPrefillComparison(chunked, unchunked, tuple(streams))


# --- 3. prefix reuse ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixReuse:
    shared_prefix_tokens: int
    prompt_tokens: int
    first: VirtualRun
    second_cached_tokens: int
    first_ttft_s: float
    second_ttft_s: float

    @property
    def expected_cached_tokens(self) -> int:
        """The block-aligned shared part."""
        return self.shared_prefix_tokens // 16 * 16

    @property
    def uncached_ratio(self) -> float:
        """Uncached prompt tokens of the second request over those of the first."""
        return (self.prompt_tokens - self.second_cached_tokens) / self.prompt_tokens

    @property
    def ttft_ratio(self) -> float:
        return self.second_ttft_s / self.first_ttft_s


def prefix_reuse(
    *, shared_prefix_tokens: int = 2040, suffix_tokens: int = 1024, seed: int = 0
) -> PrefixReuse:
    """Two requests with the same ``shared_prefix_tokens`` and different suffixes; the second
    arrives after the first finished (block size 16, so 2,040 shared tokens = 2,032 cacheable)."""
    rng = random.Random(seed)
    prefix = random_prompt(rng, shared_prefix_tokens)
    a = EngineRequest("first", prefix + random_prompt(rng, suffix_tokens), 8, seed=1)
    b = EngineRequest("second", prefix + random_prompt(rng, suffix_tokens), 8, seed=2)
    engine = _engine(EngineConfig.for_profile(PROFILES[DEFAULT_PROFILE]))
    run = run_virtual(engine, [(0.0, a), (10.0, b)])
    first, second = run.requests["first"], run.requests["second"]
    return PrefixReuse(
        shared_prefix_tokens=shared_prefix_tokens,
        prompt_tokens=len(a.prompt_token_ids),
        first=run,
        second_cached_tokens=second.num_cached_tokens,
        first_ttft_s=first.ttft_s,
        second_ttft_s=second.ttft_s,
    )
