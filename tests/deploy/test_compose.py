"""docker-compose.yml: valid against the Compose Specification, and wired together correctly."""

from __future__ import annotations

import subprocess
import sys
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.deploy.manifests import (
    COMPOSE_FILE,
    PROMETHEUS_FILE,
    REPO,
    compose_interpolate,
    compose_router_env,
    load_yaml,
)


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return compose_interpolate(load_yaml(COMPOSE_FILE))["services"]  # type: ignore[no-any-return]


def _routers(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if s.get("command", [""])[0] == "fleet-router"}


def _sims(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if s.get("command", [""])[0] == "fleet-replica"}


def _ports(service: dict[str, Any]) -> set[int]:
    """Container ports a service listens on (from `expose`, `ports` and its command)."""
    ports = {int(p) for p in service.get("expose", [])}
    ports |= {int(str(p).rsplit(":", 1)[-1]) for p in service.get("ports", [])}
    cmd = [str(c) for c in service.get("command", [])]
    if "--port" in cmd:
        ports.add(int(cmd[cmd.index("--port") + 1]))
    return ports


def test_validates_against_the_compose_specification() -> None:
    # check-jsonschema ships the Compose Specification schema: no network needed.
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_two_routers_share_one_redis(services: dict[str, dict[str, Any]]) -> None:
    routers = _routers(services)
    assert len(routers) >= 2
    urls = {r["environment"]["FLEET_ROUTER_REDIS_URL"] for r in routers.values()}
    assert len(urls) == 1
    url = urlsplit(urls.pop())
    assert url.scheme == "redis" and url.hostname in services
    assert url.port in _ports(services[url.hostname]) or url.port == 6379
    host_ports = [p.split(":")[0] for r in routers.values() for p in r["ports"]]
    assert len(set(host_ports)) == len(routers), "each router needs its own host port"
    for router in routers.values():
        assert "redis" in router["depends_on"]


@pytest.mark.parametrize(("stack", "replica_image"), [("sim", "fleet-router"), ("vllm", "vllm/")])
def test_routers_point_at_the_replicas_of_their_stack(stack: str, replica_image: str) -> None:
    """FLEET_STACK picks deploy/compose/<stack>.yaml: its replicas (and KV-event endpoints) are
    the stack's replica services, at ports those services listen on."""
    from router.config import load_config

    services = compose_interpolate(load_yaml(COMPOSE_FILE), {"FLEET_STACK": stack})["services"]
    replicas = {n for n, s in services.items() if s["image"].startswith(replica_image)}
    replicas -= set(_routers(services))
    assert len(replicas) == (4 if stack == "sim" else 2)
    for router in _routers(services).values():
        cfg = load_config(router["command"][2:], env=compose_router_env(router))
        assert cfg.port == 8080 and cfg.embedded_sim_replicas == 0
        hosts = {urlsplit(spec.url).hostname: spec for spec in cfg.replica_specs}
        assert set(hosts) == replicas
        for host, spec in hosts.items():
            assert spec.replica_id == host
            assert urlsplit(spec.url).port in _ports(services[host])
        for text in cfg.kv_events:
            replica_id, endpoint = text.split("=", 1)
            url = urlsplit(endpoint)
            assert url.scheme == "tcp" and url.hostname == replica_id
            assert url.port in _ports(services[replica_id])
        if stack == "sim":  # exact mode on the sims' KV events, in the engines' block size
            assert {t.split("=")[0] for t in cfg.kv_events} == replicas
            assert cfg.tokenizer == "sim" and cfg.block_units == 16


def test_sim_replicas_listen_where_prometheus_and_routers_look(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, sim in _sims(services).items():
        cmd = sim["command"]
        assert cmd[cmd.index("--port") + 1] == "8000"
        assert cmd[cmd.index("--kv-events-endpoint") + 1] == "tcp://*:5557"
        assert sim["environment"]["HEALTHCHECK_URL"].endswith(":8000/health"), name
        assert "profiles" not in sim, "sim replicas are part of the default stack"


def test_vllm_replicas_are_gpu_profile_only_with_nvidia_reservations(
    services: dict[str, dict[str, Any]],
) -> None:
    vllm = {n: s for n, s in services.items() if s["image"].startswith("vllm/vllm-openai")}
    assert vllm
    gpu_ids = []
    for name, svc in vllm.items():
        assert svc["profiles"] == ["gpu"], name
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        gpu_ids += device["device_ids"]
        assert {8000, 5557} <= _ports(svc)
    assert len(gpu_ids) == len(set(gpu_ids)), "two vLLM replicas on one GPU"


def test_prometheus_scrapes_every_router_and_replica(services: dict[str, dict[str, Any]]) -> None:
    config = load_yaml(PROMETHEUS_FILE)
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in services, f"{target}: no such service"
        assert int(port) in _ports(services[host]), target
    listening = {
        f"{name}:{port}"
        for name, svc in services.items()
        if name in _routers(services) or name in _sims(services) or "vllm" in svc["image"]
        for port in _ports(svc)
        if port in (8000, 8080)
    }
    assert listening <= targets


def test_mounted_files_exist(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name}: {source} does not exist"
        build = svc.get("build")
        if build:
            assert (REPO / build["context"] / build["dockerfile"]).is_file()


def test_grafana_mounts_provisioning_where_the_dashboard_provider_looks(
    services: dict[str, dict[str, Any]],
) -> None:
    grafana = services["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = load_yaml(REPO / "deploy/grafana/provisioning/dashboards/fleet-router.yml")
    path = provider["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/dashboards"] == path
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (REPO / "deploy/grafana/dashboards" / home.removeprefix(path + "/")).is_file()
