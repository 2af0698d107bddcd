"""deploy/k8s: every object validates against the Kubernetes schemas (offline, strict), and the
objects fit together (selectors, named ports, probes, Redis URL, GPU resources, non-root)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from tests.deploy.manifests import K8S_DIR, k8s_documents, load_yaml

# The oldest and newest Kubernetes minor versions we claim to support.
K8S_VERSIONS = ("1.29.0", "1.33.0")

DOCS = list(k8s_documents())


def _objects(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    ("path", "doc"), DOCS, ids=[f"{p.name}:{d['kind']}/{d['metadata']['name']}" for p, d in DOCS]
)
def test_object_validates_against_kubernetes_schema(
    path: Path, doc: dict[str, Any], version: str
) -> None:
    # kubernetes-validate ships the schemas; strict rejects unknown fields (typos).
    kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(K8S_DIR / "kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    images = {i["name"] for i in kustomization["images"]}
    used = {_container(d)["image"].split(":")[0] for d in _objects("Deployment").values()}
    assert images <= used


def test_every_service_selects_a_workload_and_targets_named_ports() -> None:
    deployments = _objects("Deployment")
    for name, service in _objects("Service").items():
        selector = service["spec"]["selector"]
        matches = [
            d
            for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, f"service {name} selects {len(matches)} deployments"
        port_names = {p["name"] for p in _container(matches[0])["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"service {name}: {port['targetPort']}"


def test_deployments_select_their_own_pods_and_probe_named_ports() -> None:
    for name, deployment in _objects("Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        container = _container(deployment)
        port_names = {p["name"] for p in container["ports"]}
        assert "readinessProbe" in container and "livenessProbe" in container, name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            get = container.get(probe, {}).get("httpGet")
            if get:
                assert get["port"] in port_names, f"{name} {probe}"
        resources = container["resources"]
        assert resources["requests"] and resources["limits"]["memory"], name


def test_router_deployment() -> None:
    router = _objects("Deployment")["fleet-router"]
    assert router["spec"]["replicas"] >= 2
    pod = router["spec"]["template"]["spec"]
    container = _container(router)
    assert container["command"][:2] == ["fleet-router", "serve"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The Redis URL names the Redis Service and its port.
    url = urlsplit(_env(container)["FLEET_ROUTER_REDIS_URL"])
    redis = _objects("Service")[url.hostname or ""]
    assert url.port in {p["port"] for p in redis["spec"]["ports"]}
    # The router Service reaches the router's port; a PDB keeps one instance up during drains.
    service = _objects("Service")["fleet-router"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert _objects("PodDisruptionBudget")["fleet-router"]["spec"]["minAvailable"] >= 1


def test_vllm_deployment_has_a_gpu_and_exposes_kv_events() -> None:
    vllm = _objects("Deployment")["vllm"]
    container = _container(vllm)
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557}
    args = container["args"]
    assert "tcp://*:5557" in args[args.index("--kv-events-config") + 1]
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("name", ["vllm", "sim-replica"])
def test_replicas_have_headless_services_with_http_and_kv_events(name: str) -> None:
    service = _objects("Service")[name]
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "http": 8000,
        "kv-events": 5557,
    }


def test_sim_replica_runs_our_image_as_non_root() -> None:
    sim = _objects("Deployment")["sim-replica"]
    container = _container(sim)
    assert container["command"] == ["fleet-replica"]
    args = container["args"]
    assert args[args.index("--port") + 1] == "8000"
    assert args[args.index("--kv-events-endpoint") + 1] == "tcp://*:5557"
    security = sim["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
