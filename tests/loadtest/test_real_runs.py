"""Real runs: the load tester against real sim replicas and a real gateway on 127.0.0.1."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import orjson
import pytest

from loadtest.client import StreamingClient
from loadtest.drivers import DriverConfig, run_load
from loadtest.plot import PlotRun, plot_run
from loadtest.report import JSON_KEYS, result_json, write_json
from loadtest.runner import RunSettings, execute
from loadtest.stats import parse_slo
from loadtest.trace import write_trace
from loadtest.workloads import RequestSpec, make_workload
from replicas.sim import SimSettings, running_replica
from router.app import running_gateway
from router.config import RouterConfig

SMALL_SHARED = {
    "num_groups": 4,
    "prompts_per_group": 6,
    "system_prompt_len": 256,
    "question_len": 32,
    "output_len": 8,
}
ROOT = Path(__file__).resolve().parents[2]
MODEL = SimSettings().model


@asynccontextmanager
async def fleet(n: int, **sim: object) -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        urls = []
        for i in range(n):
            settings = SimSettings(port=0, time_scale=0.05, seed=i).replace(**sim)
            urls.append((await stack.enter_async_context(running_replica(settings))).url)
        yield urls


async def test_run_through_the_router_gives_a_sane_report(tmp_path: Path) -> None:
    async with (
        fleet(2) as urls,
        running_gateway(
            RouterConfig(replicas=tuple(urls), policy="round_robin", port=0)
        ) as gateway,
    ):
        settings = RunSettings(
            targets=(gateway.url,),
            workload="shared-prefix",
            workload_params=SMALL_SHARED,
            driver=DriverConfig(num_requests=24, concurrency=4, warmup_requests=2),
            slo=parse_slo("ttft=10s,tpot=1s"),
            replica_metrics=tuple(urls),
            request_timeout_s=30,
        )
        outcome = await execute(settings)
    s = outcome.summary
    assert (s.completed, s.failed, s.errors) == (24, 0, {})
    assert len(outcome.result.warmup_records) == 2
    assert s.total_output_tokens == 24 * 8
    assert s.total_input_tokens == 24 * (256 + 32)
    ttft, e2e = s.latency["ttft"], s.latency["e2el"]
    assert 0 < ttft.percentiles[50] <= e2e.percentiles[50]
    assert s.latency["itl"].count == 24 * 7 and s.latency["tpot"].count == 24
    assert s.request_goodput == pytest.approx(s.request_throughput)  # generous SLOs: all good
    assert s.max_concurrent_requests <= 4
    # server side, over the measured phase only (the warm-up was before the snapshot)
    assert s.server is not None and not s.server.unreachable
    assert sum(s.server.per_replica_requests.values()) == 24
    assert s.server.per_replica_share == {urls[0]: 0.5, urls[1]: 0.5}  # round robin
    assert s.server.preemptions == 0
    rate = s.prefix_cache_hit_rate
    assert rate is not None and 0.3 < rate < 1  # 4 prompts of 256 tokens shared 6 times
    assert set(s.client_replica_share) == set(urls) or len(s.client_replica_share) == 2
    assert s.cached_tokens is not None and s.cached_tokens > 0
    doc = result_json(s, outcome.meta)
    assert list(doc) == list(JSON_KEYS)
    write_json(tmp_path / "r.json", doc)
    back = orjson.loads((tmp_path / "r.json").read_bytes())
    assert back["completed"] == 24 and back["model_id"] == outcome.meta.model
    plot_run(
        tmp_path / "r.png",
        PlotRun("run", outcome.result.records, outcome.result.started_s, s),
    )
    assert (tmp_path / "r.png").stat().st_size > 20_000


async def test_open_loop_rate_and_duration_bound() -> None:
    async with fleet(1) as urls:
        workload = make_workload("random", {"input_len": 32, "output_len": 4})
        async with StreamingClient(model=MODEL) as client:
            poisson = await run_load(
                client, urls, workload, DriverConfig(num_requests=40, rate_per_s=80.0, seed=1)
            )
            bounded = await run_load(
                client, urls, workload, DriverConfig(duration_s=0.6, concurrency=2)
            )
    sends = sorted(r.send_s for r in poisson.records)
    assert len(sends) == 40 and all(r.ok for r in poisson.records)
    offered = 39 / (sends[-1] - sends[0])
    assert 30 < offered < 200  # asked 80/s; Poisson with 40 samples, a noisy machine
    assert bounded.records and all(r.ok for r in bounded.records)
    assert max(r.send_s for r in bounded.records) <= bounded.started_s + 0.6 + 0.05


async def test_multi_turn_sessions_stick_and_grow() -> None:
    async with (
        fleet(3) as urls,
        running_gateway(RouterConfig(replicas=tuple(urls), policy="session", port=0)) as gateway,
    ):
        settings = RunSettings(
            targets=(gateway.url,),
            workload="multi-turn",
            workload_params={"num_conversations": 4, "turns": 3, "system_prompt_len": 64,
                             "user_len": 8, "output_len": 6, "think_time_s": 0.02},
            driver=DriverConfig(num_requests=12, concurrency=4),
        )  # fmt: skip
        outcome = await execute(settings)
    records = outcome.result.records
    assert len(records) == 12 and all(r.ok for r in records)
    by_session: dict[str, list] = {}
    for r in records:
        by_session.setdefault(r.spec.session or "", []).append(r)
    # the budget counts requests, so a user may start a fifth conversation before another
    # user's last turn takes the last slot: conversations are cut, never reordered
    assert len(by_session) >= 4
    assert sum(len(turns) == 3 for turns in by_session.values()) >= 2
    for turns in by_session.values():
        turns.sort(key=lambda r: r.spec.turn)
        assert [r.spec.turn for r in turns] == list(range(len(turns)))
        assert len({r.replica for r in turns}) == 1  # the session policy keeps it on one replica
        tokens = [r.prompt_tokens for r in turns]
        assert tokens == sorted(set(tokens))  # the history grows turn by turn
        # each turn was sent after the previous answer arrived
        assert all(b.send_s >= (a.end_s or 0) for a, b in itertools.pairwise(turns))


async def test_errors_are_classified_by_cause() -> None:
    spec = RequestSpec(request_id="e", prompt="abc " * 8, max_tokens=4, prompt_tokens=8)
    async with (
        fleet(1, failure_rate=1.0) as failing,
        fleet(1, stall_before_first_byte_s=5.0) as stalled,
    ):
        async with StreamingClient(model=MODEL) as client:
            http = await client.send(failing[0], spec)
            refused = await client.send("http://127.0.0.1:9", spec)
        async with StreamingClient(model=MODEL, request_timeout_s=0.3) as client:
            slow = await client.send(stalled[0], spec)
    assert http.error == "http_500" and http.status == 500
    assert refused.error == "connection"
    assert slow.error == "timeout"


async def test_trace_replay_keeps_the_timestamps(tmp_path: Path) -> None:
    specs = [RequestSpec(request_id=str(i), prompt="abc " * 16, max_tokens=2) for i in range(4)]
    path = tmp_path / "t.jsonl"
    times = [0.0, 0.3, 0.6, 1.2]
    write_trace(str(path), zip(times, specs, strict=True))
    async with fleet(1) as urls, StreamingClient(model=MODEL) as client:
        result = await run_load(
            client,
            urls,
            make_workload("trace", {"path": str(path)}),
            DriverConfig(num_requests=4),
        )
    sends = sorted(r.send_s - result.started_s for r in result.records)
    # Never early; late by less than most of the smallest gap (a busy machine delays a send,
    # but a send pushed a slot late, or offsets added up, would miss this bound).
    late_s = 0.8 * min(b - a for a, b in itertools.pairwise(times))
    for got, want in zip(sends, times, strict=True):
        assert want - 0.005 <= got <= want + late_s


async def test_cli_run_writes_json_and_plot(tmp_path: Path) -> None:
    async with fleet(1) as urls:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "loadtest", "run", "--target", urls[0],
            "--workload", "prefix-repetition",
            "-W", "num_prompts=12", "-W", "prefix_len=64", "-W", "suffix_len=16",
            "-W", "output_len=4",
            "--rate", "200", "--burstiness", "0.5", "--slo", "ttft=5s",
            "--replica-metrics", urls[0], "--json", str(tmp_path / "o.json"),
            "--plot", str(tmp_path / "o.png"),
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="160"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert b"TTFT" in out and b"prefix cache hit rate" in out
    doc = orjson.loads((tmp_path / "o.json").read_bytes())
    assert list(doc) == list(JSON_KEYS)
    assert doc["completed"] == 12 and doc["request_rate"] == 200 and doc["burstiness"] == 0.5
    assert doc["request_goodput"] is not None and doc["per_replica_share"] == {urls[0]: 1.0}
    assert (tmp_path / "o.png").stat().st_size > 20_000


async def test_locust_headless_against_the_router(tmp_path: Path) -> None:
    async with (
        fleet(2) as urls,
        running_gateway(RouterConfig(replicas=tuple(urls), policy="least_load", port=0)) as gateway,
    ):
        env = dict(
            os.environ,
            PYTHONPATH="",  # the locustfile must find the package by itself
            FLEET_LOADTEST_PARAMS="num_groups=4,prompts_per_group=4,system_prompt_len=64,"
            "question_len=8,output_len=4",
        )
        proc = await asyncio.create_subprocess_exec(
            "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
            "-u", "4", "-r", "4", "-t", "3s", "--host", gateway.url,
            "--csv", str(tmp_path / "loc"), "--only-summary", "--stop-timeout", "2",
            cwd=tmp_path, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()[-2000:]
    rows = {
        (line.split(",")[0], line.split(",")[1]): line.split(",")
        for line in (tmp_path / "loc_stats.csv").read_text().splitlines()[1:]
    }
    for kind in ("TTFT", "TPOT", "E2E", "POST"):
        row = rows[(kind, "/v1/completions")]
        assert int(row[2]) > 10 and int(row[3]) == 0  # requests, no failures
    assert float(rows[("TTFT", "/v1/completions")][8]) == pytest.approx(4.0)  # avg length = tokens
