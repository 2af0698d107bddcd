"""Reading the deploy files under test: paths, YAML documents, dashboard queries, PromQL names."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import yaml

__all__ = [
    "COMPOSE_FILE",
    "DASHBOARD_FILE",
    "DOCKERFILE",
    "K8S_DIR",
    "K8S_GPU_DIR",
    "PROMETHEUS_FILE",
    "REPO",
    "RULES_FILE",
    "VLLM_SERVE",
    "DashboardQuery",
    "compose_interpolate",
    "compose_router_env",
    "dashboard_queries",
    "k8s_documents",
    "kustomization_files",
    "load_yaml",
    "metric_names",
    "rule_expressions",
    "substitute",
    "vllm_serve_argv",
]

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
K8S_DIR = REPO / "deploy" / "k8s"
K8S_GPU_DIR = K8S_DIR / "gpu"
PROMETHEUS_FILE = REPO / "deploy" / "prometheus" / "prometheus.yml"
RULES_FILE = REPO / "deploy" / "prometheus" / "rules.yml"
DASHBOARD_FILE = REPO / "deploy" / "grafana" / "dashboards" / "fleet-router.json"
VLLM_SERVE = REPO / "replicas" / "vllm" / "serve.sh"


def load_yaml(path: Path) -> Any:
    """One YAML document (YAML merge keys resolved, as Compose does)."""
    return yaml.safe_load(path.read_text(encoding="utf-8"))


_COMPOSE_VAR = re.compile(r"\$\{(?P<name>\w+)(?::?-(?P<default>[^}]*))?\}|\$(?P<bare>\w+)")


def compose_interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Resolve Compose's `${VAR}`, `${VAR:-default}` and `$VAR` in every string of `value`."""
    env = env or {}
    if isinstance(value, str):

        def repl(match: re.Match[str]) -> str:
            name = match["name"] or match["bare"]
            return env.get(name) or match["default"] or ""

        return _COMPOSE_VAR.sub(repl, value.replace("$$", "\0")).replace("\0", "$")
    if isinstance(value, list):
        return [compose_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: compose_interpolate(v, env) for k, v in value.items()}
    return value


def compose_router_env(service: dict[str, Any]) -> dict[str, str]:
    """A compose router service's environment as the router sees it, with the container path of
    FLEET_ROUTER_CONFIG mapped back to the repo file that the service mounts there."""
    env = {k: str(v) for k, v in service.get("environment", {}).items()}
    config = env.get("FLEET_ROUTER_CONFIG")
    if config:
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if config.startswith(target.rstrip("/") + "/"):
                env["FLEET_ROUTER_CONFIG"] = str(REPO / source / config[len(target) + 1 :])
                break
        else:
            raise AssertionError(f"{config} is not in a volume the router mounts")
    return env


def kustomization_files(root: Path = K8S_DIR) -> tuple[list[Path], list[Path]]:
    """(resource files, patch files) a kustomization pulls in, following directory resources."""
    kustomization = load_yaml(root / "kustomization.yaml")
    resources: list[Path] = []
    patches = [root / p["path"] for p in kustomization.get("patches", [])]
    for entry in kustomization.get("resources", []):
        path = (root / entry).resolve()
        if path.is_dir():
            sub_resources, sub_patches = kustomization_files(path)
            resources += sub_resources
            patches += sub_patches
        else:
            resources.append(path)
    return resources, patches


def k8s_documents(root: Path = K8S_DIR) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object of a kustomization (deploy/k8s by default), unpatched."""
    for path in kustomization_files(root)[0]:
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                yield path, doc


@dataclass(frozen=True, slots=True)
class DashboardQuery:
    """One PromQL target of one dashboard panel (or template variable)."""

    panel: str
    ref_id: str
    expr: str

    @property
    def label(self) -> str:
        return f"{self.panel} [{self.ref_id}]"


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # panels inside collapsed rows


def dashboard_queries(dashboard: dict[str, Any] | None = None) -> list[DashboardQuery]:
    """All PromQL expressions of the dashboard: panel targets, then template-variable queries."""
    if dashboard is None:
        dashboard = json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))
    out = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append(DashboardQuery(panel["title"], target["refId"], target["expr"]))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            text = query["query"] if isinstance(query, dict) else query
            out.append(DashboardQuery(f"variable {var['name']}", "query", text))
    return out


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>[^,)]+)\s*,\s*\w+\s*\)\s*$")


def substitute(expr: str, *, rate_interval: str, variables: dict[str, str]) -> str:
    """Turn a Grafana expression into plain PromQL, as Grafana would before sending it.

    `$__rate_interval` becomes `rate_interval`; `$var` / `${var}` become their (regex) values;
    a variable's `label_values(selector, label)` becomes the selector it reads the label from.
    """
    match = _LABEL_VALUES.match(expr)
    if match:
        expr = match["selector"]
    expr = expr.replace("$__rate_interval", rate_interval)
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    if "$" in expr:
        raise ValueError(f"unsubstituted Grafana variable left in {expr!r}")
    return expr


def metric_names(promql: str) -> set[str]:
    """Metric names selected anywhere in a PromQL expression (parsed, not pattern-matched)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    names.add(matcher.value)

    promql_parser.walk(promql_parser.parse(promql), visit)
    return names


def rule_expressions() -> list[tuple[str, str]]:
    """(rule name, expr) of every alerting/recording rule in deploy/prometheus/rules.yml."""
    rules = load_yaml(RULES_FILE)
    return [
        (rule.get("alert") or rule["record"], rule["expr"])
        for group in rules["groups"]
        for rule in group["rules"]
    ]


_FAKE_VLLM = """#!/usr/bin/env python3
import json, sys
print(json.dumps(sys.argv[1:]))
"""


def vllm_serve_argv(
    tmp_dir: Path, args: list[str] | None = None, env: dict[str, str] | None = None
) -> list[str]:
    """The argv `replicas/vllm/serve.sh` hands to `vllm`, captured by a stand-in `vllm` on PATH."""
    bin_dir = tmp_dir / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "vllm"
    fake.write_text(_FAKE_VLLM, encoding="utf-8")
    fake.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k not in _SERVE_ENV}
    run_env = {**clean, **(env or {}), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", str(VLLM_SERVE), *(args or [])],
        env=run_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    argv = json.loads(out)
    assert isinstance(argv, list)
    return [str(a) for a in argv]


_SERVE_ENV = ("MODEL", "PORT", "KV_EVENTS_PORT", "MAX_NUM_BATCHED_TOKENS", "MAX_NUM_SEQS")
