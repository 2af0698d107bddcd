"""The Grafana dashboard and the Prometheus files, checked statically.

That every metric exists and every query returns data is shown against live servers in
test_live.py; here: the JSON is well formed for Grafana provisioning, every query parses as
PromQL, the panels an operator needs (request rate and errors, in-flight, KV usage, predicted vs
observed hits, evictions, retries, circuits, the Redis backend) are there, and promtool accepts
the Prometheus config.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any

import pytest

from tests.deploy.manifests import (
    DASHBOARD_FILE,
    PROMETHEUS_FILE,
    REPO,
    RULES_FILE,
    dashboard_queries,
    load_yaml,
    metric_names,
    rule_expressions,
    substitute,
)

VARIABLES = {"model": ".*"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_panels_use_the_provisioned_datasource_by_uid(dashboard: dict[str, Any]) -> None:
    provisioned = load_yaml(REPO / "deploy/grafana/provisioning/datasources/prometheus.yml")
    (source,) = provisioned["datasources"]
    uid = source["uid"]
    assert source["type"] == "prometheus"
    for panel in _panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid
    for var in dashboard["templating"]["list"]:
        assert var["datasource"]["uid"] == uid


def test_layout_ids_and_variables(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = {
        name
        for q in dashboard_queries(dashboard)
        for name in re.findall(r"\$\{?(\w+)", q.expr)
        if not name.startswith("__")
    }
    assert used <= defined
    assert set(VARIABLES) == defined


def test_every_query_parses_as_promql(dashboard: dict[str, Any]) -> None:
    for query in dashboard_queries(dashboard):
        promql = substitute(query.expr, rate_interval="1m", variables=VARIABLES)
        assert metric_names(promql), query.label


def _expr_by_title(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in _panels(dashboard)}


@pytest.mark.parametrize(
    ("title_word", "metric"),
    [
        ("TTFT", "fleet_router_ttft_seconds_bucket"),
        ("TTFT", "vllm:time_to_first_token_seconds_bucket"),
        ("ITL", "vllm:inter_token_latency_seconds_bucket"),
        ("E2E", "vllm:e2e_request_latency_seconds_bucket"),
        ("E2E", "fleet_router_request_duration_seconds_bucket"),
    ],
)
def test_latency_panels_show_p50_and_p99_from_histogram_buckets(
    dashboard: dict[str, Any], title_word: str, metric: str
) -> None:
    exprs = next(e for t, e in _expr_by_title(dashboard).items() if title_word in t)
    for quantile in ("0.5", "0.99"):
        assert any(
            e.startswith(f"histogram_quantile({quantile},") and f"rate({metric}{{" in e
            for e in exprs
        ), f"{title_word}: no p{quantile} over rate({metric})"


@pytest.mark.parametrize(
    "metric",
    [
        "fleet_router_requests_total",  # request rate and errors per replica
        "fleet_router_upstream_errors_total",
        "fleet_router_replica_in_flight",
        "fleet_router_replica_kv_usage",
        "fleet_router_predicted_hit_tokens_total",  # predicted vs observed hit rate
        "vllm:prefix_cache_hits_total",
        "fleet_router_replica_observed_hit_tokens",
        "fleet_router_index_evictions_total",
        "fleet_router_retries_total",
        "fleet_router_circuit_state",
        "fleet_router_state_backend_up",  # Redis backend state
    ],
)
def test_dashboard_covers(dashboard: dict[str, Any], metric: str) -> None:
    used = set().union(
        *(
            metric_names(substitute(q.expr, rate_interval="1m", variables=VARIABLES))
            for q in dashboard_queries(dashboard)
        )
    )
    assert metric in used


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool missing: install Debian's prometheus (scripts/test does)")
    return found


def test_promtool_accepts_the_prometheus_config_and_rules() -> None:
    # `check config` also checks the rule files it names (resolved relative to the config).
    result = subprocess.run(
        [_promtool(), "check", "config", str(PROMETHEUS_FILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{RULES_FILE.name}" in load_yaml(PROMETHEUS_FILE)["rule_files"][0]
    assert f"SUCCESS: {len(rule_expressions())} rules found" in result.stdout + result.stderr
