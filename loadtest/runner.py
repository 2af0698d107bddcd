"""One load-test run end to end: workload → driver → client → replica metrics → summary.

The CLI, ``compare`` and the demo all call :func:`execute` with a :class:`RunSettings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
from rich.console import Console

from loadtest.client import RequestRecord, StreamingClient
from loadtest.drivers import DriverConfig, RunResult, run_load
from loadtest.replica_metrics import ReplicaCounters, ServerStats, scrape_all, server_stats
from loadtest.report import RunMeta, live_progress
from loadtest.stats import Slo, Summary, summarize
from loadtest.workloads import Workload, make_workload

__all__ = ["RunError", "RunOutcome", "RunSettings", "discover_model", "execute"]


class RunError(RuntimeError):
    """The run could not start (e.g. no model could be discovered at the target)."""


@dataclass(frozen=True, slots=True)
class RunSettings:
    """Everything one run needs; built by the CLI or by code."""

    targets: tuple[str, ...]
    workload: str
    driver: DriverConfig
    workload_params: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    seed: int = 0
    model: str | None = None  # None: the first model of the target's /v1/models
    slo: Slo = field(default_factory=Slo)
    replica_metrics: tuple[str, ...] = ()
    request_timeout_s: float = 300.0
    label: str = ""


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """The summary plus everything needed to plot or re-summarize it."""

    summary: Summary
    result: RunResult
    meta: RunMeta
    workload: Workload


async def discover_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model id served at ``url`` (``GET /v1/models``), as vLLM's bench does."""
    models_url = url.rstrip("/") + "/v1/models"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(models_url) as response,
        ):
            if response.status != 200:
                raise RunError(f"{models_url} answered HTTP {response.status}; pass --model")
            body = await response.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise RunError(f"cannot list models at {models_url} ({exc}); pass --model") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
        raise RunError(f"{models_url} lists no model; pass --model")
    return str(data[0]["id"])


async def execute(
    settings: RunSettings,
    *,
    console: Console | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> RunOutcome:
    """Run ``settings``: warm up, snapshot the replicas' counters, measure, snapshot again."""
    console = console or Console(stderr=True)
    workload = make_workload(settings.workload, settings.workload_params, seed=settings.seed)
    driver = settings.driver
    model = settings.model or await discover_model(settings.targets[0])
    before: dict[str, ReplicaCounters] = {}
    server: ServerStats | None = None
    total = driver.num_requests
    async with (
        StreamingClient(model=model, request_timeout_s=settings.request_timeout_s) as client,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as scraper,
    ):

        async def snapshot() -> None:
            before.update(await scrape_all(scraper, settings.replica_metrics))

        with live_progress(console, total, settings.label or settings.workload) as advance:

            def record_done(record: RequestRecord) -> None:
                advance(record)
                if on_record is not None:
                    on_record(record)

            result = await run_load(
                client,
                settings.targets,
                workload,
                driver,
                on_record=record_done,
                before_measure=snapshot if settings.replica_metrics else None,
            )
        if settings.replica_metrics:
            server = server_stats(before, await scrape_all(scraper, settings.replica_metrics))
    summary = summarize(
        result.records,
        slo=settings.slo,
        server=server,
        window_s=(result.started_s, result.finished_s),
    )
    meta = RunMeta(
        label=settings.label or settings.workload,
        targets=settings.targets,
        model=model,
        workload=settings.workload,
        workload_params=dataclasses.asdict(workload.params),
        seed=settings.seed,
        num_prompts=driver.num_requests,
        duration_limit_s=driver.duration_s,
        request_rate=driver.rate_per_s,
        burstiness=driver.burstiness,
        max_concurrency=driver.concurrency,
        warmup_requests=driver.warmup_requests,
    )
    return RunOutcome(summary=summary, result=result, meta=meta, workload=workload)
