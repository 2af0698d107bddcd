"""Exact mode end to end: the gateway consumes the sim replicas' KV events (vLLM's ZMQ format)
and routes in token mode with the sims' own tokenizer, so the blocks it predicts are the blocks
the engines cache.  Predicted hit tokens (the router's `fleet_router_predicted_hit_tokens_total`)
must be within 5% of the hits the replicas count themselves (vllm:prefix_cache_hits deltas).

Scaled-down shared-prefix workload: 12 groups x 8 prompts, 512-token system prompts, 32-token
questions, 8 output tokens; 4 replicas of 128 KV blocks (2,048 tokens: 3 prefixes and a few
questions each), so the engines evict and the index follows their BlockRemoved events.
"""

from __future__ import annotations

import io
from pathlib import Path

from prometheus_client import generate_latest
from rich.console import Console

from loadtest.drivers import DriverConfig
from loadtest.fleet import capacity_known
from loadtest.runner import RunSettings, execute
from replicas.sim import SimReplica, SimSettings, start_replica
from router.app import KV_EVENTS, running_gateway
from router.config import RouterConfig

MODEL = "sim-model"
REPLICAS = 4
NUM_GPU_BLOCKS = 128
WORKLOAD = {
    "num_groups": 12,
    "prompts_per_group": 8,
    "system_prompt_len": 512,
    "question_len": 32,
    "output_len": 8,
}


def _sum_metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_predicted_hits_match_observed_hits(tmp_path: Path) -> None:
    sims: list[SimReplica] = []
    try:
        for i in range(REPLICAS):
            sims.append(
                await start_replica(
                    SimSettings(
                        port=0,
                        model=MODEL,
                        seed=i,
                        time_scale=0.05,
                        num_gpu_blocks=NUM_GPU_BLOCKS,
                        kv_events_endpoint=f"ipc://{tmp_path}/kv{i}",
                        kv_events_replay_endpoint=f"ipc://{tmp_path}/replay{i}",
                        kv_events_encoding="array" if i % 2 else "map",  # both encodings
                    )
                )
            )
        config = RouterConfig(
            replicas=tuple(f"r{i}={s.url}" for i, s in enumerate(sims)),
            sim_replicas=0,
            policy="kv_aware",
            tokenizer="sim",
            block_units=16,
            kv_events=tuple(
                f"r{i}=ipc://{tmp_path}/kv{i},ipc://{tmp_path}/replay{i}" for i in range(REPLICAS)
            ),
            health_interval_s=0.2,
            scrape_interval_s=0.1,
            seed=3,
        )
        async with running_gateway(config) as gateway:
            consumer = gateway.app[KV_EVENTS]
            assert {s.replica_id for s in consumer.sources} == {f"r{i}" for i in range(REPLICAS)}
            assert await capacity_known(gateway)  # KV capacity scraped before traffic
            settings = RunSettings(
                targets=(gateway.url,),
                workload="shared-prefix",
                driver=DriverConfig(num_requests=96, rate_per_s=25.0, seed=3),
                workload_params=WORKLOAD,
                seed=3,
                model=MODEL,
                replica_metrics=tuple(s.url for s in sims),
            )
            outcome = await execute(settings, console=Console(file=io.StringIO()))
            summary = outcome.summary
            assert summary.failed == 0 and summary.completed == 96
            server = summary.server
            assert server is not None
            metrics = generate_latest(gateway.state.metrics.registry).decode()
            predicted = _sum_metric(metrics, "fleet_router_predicted_hit_tokens_total")
            prompt = _sum_metric(metrics, "fleet_router_predicted_prompt_tokens_total")
            observed = server.prefix_cache_hits
            print(f"predicted {predicted:.0f} observed {observed:.0f} hit tokens, "
                  f"{prompt:.0f} predicted / {server.prefix_cache_queries:.0f} observed prompt "
                  f"tokens; hit rate {server.prefix_cache_hit_rate:.3f}; "
                  f"events {consumer.describe()}")  # fmt: skip
            assert observed > 0.5 * server.prefix_cache_queries  # the workload does hit
            assert abs(predicted - observed) <= 0.05 * observed
            assert _sum_metric(metrics, "fleet_router_kv_events_total") > 0
            assert _sum_metric(metrics, "fleet_router_kv_event_gaps_total") == 0
            # The engines evicted (capacity is short) and the index followed their events.
            assert 'type="BlockRemoved"' in metrics
            index = gateway.state.core.prefix_index
            assert index is not None
            for i, sim in enumerate(sims):
                engine_blocks = len(sim.engine.cached_block_hashes())
                held = index.holds(f"r{i}")
                assert held <= NUM_GPU_BLOCKS
                assert abs(held - engine_blocks) <= 0.05 * NUM_GPU_BLOCKS, (i, held, engine_blocks)
    finally:
        for sim in reversed(sims):
            await sim.stop()
