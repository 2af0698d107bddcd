"""A real fleet on 127.0.0.1 for the live deploy checks: sim replicas and a router as subprocesses
(the same CLIs the compose file and the pods run), Debian's prometheus scraping them, traffic.

Everything started here is stopped by `LiveStack.close()`; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.deploy.manifests import REPO, RULES_FILE

__all__ = ["MODEL", "LiveStack", "TrafficReport", "prometheus_binary", "scrape_interval_s"]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
scrape_interval_s = 1.0


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """A blocking GET for the fixture (no event loop runs there)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def wait_until(
    what: str, check: Any, timeout_s: float, procs: Sequence[subprocess.Popen[bytes]] = ()
) -> Any:
    """Poll `check()` until it returns a truthy value; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: process {proc.args!r} exited with {proc.returncode}")
        try:
            value = check()
            if value:
                return value
        except (OSError, ValueError) as exc:
            last_error = exc
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not true after {timeout_s}s (last error: {last_error})")


@dataclass
class TrafficReport:
    statuses: list[int] = field(default_factory=list)

    def count(self, status: int) -> int:
        return sum(1 for s in self.statuses if s == status)


@dataclass
class LiveStack:
    """Sim replicas + one router + prometheus, on free ports of 127.0.0.1."""

    tmp: Path
    router_args: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[IO[bytes]] = field(default_factory=list)
    replica_urls: dict[str, str] = field(default_factory=dict)
    router_url: str = ""
    prometheus_url: str = ""

    # --- processes ------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        self._logs.append(log)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def start_replica(self, name: str, extra: Sequence[str] = ()) -> None:
        port = free_port()
        self._spawn(
            name,
            [sys.executable, "-m", "replicas.sim", "--host", "127.0.0.1", "--port", str(port),
             "--model", MODEL, "--time-scale", "0.05", *extra],
        )  # fmt: skip
        self.replica_urls[name] = f"http://127.0.0.1:{port}"

    def start_router(self, extra: Sequence[str] = ()) -> None:
        port = free_port()
        replicas = [
            a for name, url in self.replica_urls.items() for a in ("--replica", f"{name}={url}")
        ]
        self.router_args = [
            "serve", "--host", "127.0.0.1", "--port", str(port), *replicas,
            # Fast health/scrape/circuit cycles so a short test sees them all.
            "--health-interval-s", "0.5", "--scrape-interval-s", "0.25",
            "--circuit-open-s", "1", "--max-retries", "2", "--drain-timeout-s", "1", *extra,
        ]  # fmt: skip
        self._spawn("router", [sys.executable, "-m", "router", *self.router_args])
        self.router_url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        procs = list(self.procs.values())
        for name, url in self.replica_urls.items():
            wait_until(
                f"replica {name} /health",
                lambda u=url: http_get(u + "/health")[0] == 200,
                timeout_s,
                procs,
            )
        wait_until(
            "router /ready",
            lambda: http_get(self.router_url + "/ready")[0] == 200,
            timeout_s,
            procs,
        )

    def start_prometheus(self, targets: dict[str, list[str]]) -> None:
        """Debian's prometheus on a generated config; `targets`: job name -> host:port list."""
        binary = prometheus_binary()
        assert binary is not None
        port = free_port()
        interval = f"{scrape_interval_s:g}s"
        config = self.tmp / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": interval, "evaluation_interval": interval},
                    "rule_files": [str(RULES_FILE)],  # the deploy alert rules must load too
                    "scrape_configs": [
                        {"job_name": job, "static_configs": [{"targets": hosts}]}
                        for job, hosts in targets.items()
                    ],
                }
            ),
            encoding="utf-8",
        )
        proc = self._spawn(
            "prometheus",
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
             "--log.level=warn"],
        )  # fmt: skip
        self.prometheus_url = f"http://127.0.0.1:{port}"
        wait_until(
            "prometheus /-/ready",
            lambda: http_get(self.prometheus_url + "/-/ready")[0] == 200,
            30,
            [proc],
        )

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for log in self._logs:
            log.close()

    # --- prometheus -----------------------------------------------------------------------------
    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query through Prometheus' HTTP API; the result vector."""
        url = self.prometheus_url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        status, body = http_get(url, timeout_s=10)
        data = orjson.loads(body)
        assert status == 200 and data["status"] == "success", f"{promql}: {data}"
        result = data["data"]["result"]
        assert data["data"]["resultType"] == "vector", promql
        return result  # type: ignore[no-any-return]

    def rules(self) -> dict[str, dict[str, Any]]:
        """Prometheus' view of its loaded rules, by name."""
        status, body = http_get(self.prometheus_url + "/api/v1/rules", timeout_s=10)
        assert status == 200
        groups = orjson.loads(body)["data"]["groups"]
        return {r["name"]: r for g in groups for r in g["rules"]}

    def scrape_targets(self) -> dict[str, list[str]]:
        """Prometheus jobs: the router and the replicas, as host:port."""
        return {
            "fleet-router": [self.router_url.removeprefix("http://")],
            "sim-replica": [u.removeprefix("http://") for u in self.replica_urls.values()],
        }

    def router_requests_total(self) -> float:
        """The router's own count of answered requests, from its /metrics."""
        families = text_string_to_metric_families(self.metrics_text(self.router_url))
        return sum(
            s.value for f in families for s in f.samples if s.name == "fleet_router_requests_total"
        )

    def metrics_text(self, base_url: str) -> str:
        status, body = http_get(base_url + "/metrics", timeout_s=5)
        assert status == 200
        return body.decode()


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in result) if math.isfinite(v)]


# --- traffic ------------------------------------------------------------------------------------

_DOCS = [
    " ".join(f"{topic} section {i}: the replica keeps this prefix cached." for i in range(12))
    for topic in ("alpha", "bravo", "charlie", "delta")
]


def _bodies(n: int) -> list[dict[str, Any]]:
    """Shared-prefix chats (cache hits), unique long prompts (index evictions), and a few prompts
    too long for the replicas' context (a replica's 400, passed through by the router)."""
    bodies: list[dict[str, Any]] = []
    for i in range(n):
        if i % 10 == 9:
            content = "overflow " * 4000
        elif i % 3 == 2:
            content = f"unique {i} " + f"filler {i} " * 120
        else:
            content = _DOCS[i % len(_DOCS)] + f" Question {i}?"
        bodies.append(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 12,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return bodies


async def _drive(router_url: str, n: int, concurrency: int, min_duration_s: float) -> TrafficReport:
    report = TrafficReport()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in _bodies(n):
        queue.put_nowait(body)
    # Spread the requests over several scrapes so every counter and histogram changes between
    # two of them (rate() needs two differing samples).
    pause_s = min_duration_s * concurrency / n

    async def worker(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            async with session.post(router_url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                report.statuses.append(resp.status)
            await asyncio.sleep(pause_s)

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return report


def drive_traffic(
    router_url: str, n: int = 80, concurrency: int = 4, min_duration_s: float = 5.0
) -> TrafficReport:
    """Send `n` streaming chat requests through the router, spread over `min_duration_s`."""
    return asyncio.run(_drive(router_url, n, concurrency, min_duration_s))
