"""Live: the dashboard and the alert rules work against the real thing.

A router configured as deployed (kv_aware, exact mode on KV events, Redis-backed state) in front
of three sim replicas on 127.0.0.1 (two healthy with a small KV cache, so the index evicts, and KV
events on; one failing every generation, so retries, upstream errors and an open circuit happen)
serves shared-prefix, unique and over-long prompts. Debian's prometheus scrapes all four every
second. Then: every metric name the dashboard and rules use is in a /metrics output, and every
dashboard query evaluated through Prometheus' HTTP API returns data.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from dockerfile_parse import DockerfileParser
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.deploy.live import (
    LiveStack,
    TrafficReport,
    drive_traffic,
    finite_values,
    prometheus_binary,
    wait_until,
)
from tests.deploy.manifests import (
    DOCKERFILE,
    dashboard_queries,
    metric_names,
    rule_expressions,
    substitute,
)

# Grafana's $__rate_interval is max(4 x scrape interval, interval + scrape); over a test this
# short, a window covering the whole run is the sensible stand-in.
RATE_INTERVAL = "2m"
VARIABLES = {"model": ".*"}
N_REQUESTS = 80


def _dockerfile() -> list[dict[str, str]]:
    return list(DockerfileParser(path=str(DOCKERFILE)).structure)


def _used_metrics() -> list[str]:
    names: set[str] = set()
    for query in dashboard_queries():
        names |= metric_names(substitute(query.expr, rate_interval="1m", variables=VARIABLES))
    for _, expr in rule_expressions():
        names |= metric_names(expr)
    return sorted(names)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[LiveStack, TrafficReport]]:
    if prometheus_binary() is None:
        pytest.fail("prometheus missing: install Debian's prometheus (scripts/test does)")
    live = LiveStack(tmp_path_factory.mktemp("live"))
    try:
        small_kv = ["--num-gpu-blocks", "48"]
        # ipc:// endpoints: the sims bind them (vLLM's rule binds only `*`/`::` for tcp://, i.e.
        # every interface), the router connects; nothing leaves this machine.
        kv_endpoints = {name: f"ipc://{live.tmp / name}.kv" for name in ("r1", "r2")}
        for seed, (name, endpoint) in enumerate(kv_endpoints.items(), start=1):
            events = ["--kv-events-endpoint", endpoint]
            live.start_replica(name, [*small_kv, "--seed", str(seed), *events])
        live.start_replica("r3", ["--seed", "3", "--failure-rate", "1.0"])
        # As deployed: kv_aware, exact mode on the sims' KV events (token mode, the engines'
        # 16-token blocks), state shared through a real Redis.
        router_extra = ["--policy", "kv_aware", "--tokenizer", "sim", "--block-units", "16"]
        for name, endpoint in kv_endpoints.items():
            router_extra += ["--kv-events", f"{name}={endpoint}"]
        router_extra += ["--redis-url", request.getfixturevalue("redis_server_url")]
        live.start_router(router_extra)
        live.wait_ready()
        live.start_prometheus(live.scrape_targets())
        wait_until("prometheus scraped every target", lambda: len(live.query("up == 1")) == 4, 20)
        report = drive_traffic(live.router_url, n=N_REQUESTS)
        # Wait until Prometheus holds the router's final counts (a scrape after the last request).
        final = live.router_requests_total()
        wait_until(
            "prometheus caught up with the router",
            lambda: finite_values(live.query("sum(fleet_router_requests_total)")) == [final],
            15,
        )
        yield live, report
    except BaseException:
        for name in live.procs:
            print(f"--- {name} log ---\n{live.log(name)}")
        raise
    finally:
        live.close()


def test_traffic_was_served_with_the_expected_outcomes(
    stack: tuple[LiveStack, TrafficReport],
) -> None:
    _, report = stack
    overflow = N_REQUESTS // 10
    assert len(report.statuses) == N_REQUESTS
    # Over-long prompts: the replica's 400, passed through. Everything else succeeds, the failing
    # replica's 500s having been retried elsewhere.
    assert report.count(400) == overflow
    assert report.count(200) == N_REQUESTS - overflow


@pytest.fixture(scope="module")
def exposed(stack: tuple[LiveStack, TrafficReport]) -> set[str]:
    live, _ = stack
    names: set[str] = set()
    for url in [live.router_url, *live.replica_urls.values()]:
        for family in text_string_to_metric_families(live.metrics_text(url)):
            names |= {sample.name for sample in family.samples}
    return names


def _log_tails(live: LiveStack) -> str:
    """What the processes said last: the why of a missing series (e.g. a KV-event consumer that
    stopped, or a replica that published nothing)."""
    return "\n".join(f"--- {name} log (tail) ---\n{live.log(name)}" for name in live.procs)


@pytest.mark.parametrize("metric", _used_metrics())
def test_metric_used_by_dashboard_or_rules_is_exposed(
    metric: str, exposed: set[str], stack: tuple[LiveStack, TrafficReport]
) -> None:
    assert metric in exposed, f"{metric} not exposed\n{_log_tails(stack[0])}"


def _query_cases() -> list[Any]:
    return [
        pytest.param(
            substitute(query.expr, rate_interval=RATE_INTERVAL, variables=VARIABLES),
            id=query.label,
        )
        for query in dashboard_queries()
    ]


@pytest.mark.parametrize("promql", _query_cases())
def test_dashboard_query_returns_data(promql: str, stack: tuple[LiveStack, TrafficReport]) -> None:
    live, _ = stack
    result = live.query(promql)
    assert result, f"no series: {promql}\n{_log_tails(live)}"
    assert finite_values(result), f"only NaN/Inf: {promql} -> {result}"


def test_alert_rules_load_and_evaluate(stack: tuple[LiveStack, TrafficReport]) -> None:
    live, _ = stack
    expected = {name for name, _ in rule_expressions()}

    def evaluated() -> dict[str, str]:
        rules = live.rules()
        if set(rules) != expected or any(
            r.get("lastEvaluation", "").startswith("0001") for r in rules.values()
        ):
            return {}  # not all loaded, or not all evaluated once yet
        return {name: r["health"] for name, r in rules.items()}

    health = wait_until("alert rules evaluated", evaluated, 10)
    assert set(health.values()) == {"ok"}, health


@pytest.mark.parametrize("target", ["router", "dead"])
def test_image_healthcheck_command(target: str, stack: tuple[LiveStack, TrafficReport]) -> None:
    """The Dockerfile's HEALTHCHECK command, run as Docker would, against a live router (exit 0)
    and against a port nobody listens on (non-zero)."""
    live, _ = stack
    (check,) = [i["value"] for i in _dockerfile() if i["instruction"] == "HEALTHCHECK"]
    argv = orjson.loads(check[check.index("CMD") + 3 :])
    url = live.router_url if target == "router" else f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "HEALTHCHECK_URL": url + "/health"}
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    result = subprocess.run(argv, env=env, capture_output=True, timeout=30)
    assert (result.returncode == 0) == (target == "router"), result.stderr
