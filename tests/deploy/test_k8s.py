"""deploy/k8s: every object validates against the Kubernetes schemas (offline, strict), and the
objects fit together: selectors, named ports, probes, the Redis URL, GPUs, non-root, and the
router discovering the ready pods of the replica Deployment through its headless Service."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from router.config import load_config
from tests.deploy.manifests import (
    K8S_DIR,
    K8S_GPU_DIR,
    k8s_documents,
    kustomization_files,
    load_yaml,
)

# The oldest and newest Kubernetes minor versions we claim to support.
K8S_VERSIONS = ("1.29.0", "1.33.0")
WORKLOADS = ("Deployment", "StatefulSet")

ALL_DOCS = list(k8s_documents(K8S_GPU_DIR))  # the gpu overlay pulls in the base too


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _merge(base: Any, patch: Any) -> Any:
    """The strategic-merge subset our patches use: maps merge, lists of named maps merge by name,
    and a named item with `$patch: delete` removes that item."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and all("name" in p for p in patch):
        out_list = [copy.deepcopy(b) for b in base]
        names = [b.get("name") for b in base]
        for p in patch:
            if p.get("$patch") == "delete":
                assert p["name"] in names, f"$patch: delete of {p['name']}, which is not there"
                del out_list[names.index(p["name"])]
                names.remove(p["name"])
            elif p["name"] in names:
                i = names.index(p["name"])
                out_list[i] = _merge(out_list[i], p)
            else:
                out_list.append(p)
        return out_list
    return patch


def _render(root: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The objects of a kustomization with its patches applied."""
    objects = {_key(d): d for _, d in k8s_documents(root)}
    for patch_file in kustomization_files(root)[1]:
        patch = load_yaml(patch_file)
        assert _key(patch) in objects, f"{patch_file.name} patches nothing"
        objects[_key(patch)] = _merge(objects[_key(patch)], patch)
    return objects


BASE = _render(K8S_DIR)
GPU = _render(K8S_GPU_DIR)


def _of(objects: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {name: d for (k, name), d in objects.items() if k == kind}


def _workloads(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: d for (k, name), d in objects.items() if k in WORKLOADS}


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    ("path", "doc"),
    ALL_DOCS,
    ids=[f"{p.name}:{d['kind']}/{d['metadata']['name']}" for p, d in ALL_DOCS],
)
def test_object_validates_against_kubernetes_schema(
    path: Path, doc: dict[str, Any], version: str
) -> None:
    # kubernetes-validate ships the schemas; strict rejects unknown fields (typos).
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_patched_objects_still_validate(overlay: str, version: str) -> None:
    for obj in (BASE if overlay == "base" else GPU).values():
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("root", [K8S_DIR, K8S_GPU_DIR], ids=["base", "gpu"])
def test_kustomization_uses_every_file_in_its_folder(root: Path) -> None:
    resources, patches = kustomization_files(root)
    on_disk = {p.resolve() for p in root.glob("*.yaml")} - {root / "kustomization.yaml"}
    assert on_disk <= set(resources) | set(patches)
    kustomization = load_yaml(root / "kustomization.yaml")
    used = {_container(d)["image"].split(":")[0] for d in _workloads(_render(root)).values()}
    assert {i["name"] for i in kustomization.get("images", [])} <= used


@pytest.mark.parametrize("objects", [BASE, GPU], ids=["base", "gpu"])
def test_services_select_one_workload_and_target_named_ports(
    objects: dict[tuple[str, str], dict[str, Any]],
) -> None:
    workloads = _workloads(objects)
    for name, service in _of(objects, "Service").items():
        selector = service["spec"]["selector"]
        matches = [
            w
            for w in workloads.values()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, f"service {name} selects {len(matches)} workloads"
        port_names = {p["name"] for p in _container(matches[0])["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"service {name}: {port['targetPort']}"


@pytest.mark.parametrize("objects", [BASE, GPU], ids=["base", "gpu"])
def test_workloads_select_their_pods_probe_named_ports_and_set_resources(
    objects: dict[tuple[str, str], dict[str, Any]],
) -> None:
    for name, workload in _workloads(objects).items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        container = _container(workload)
        port_names = {p["name"] for p in container["ports"]}
        assert "readinessProbe" in container and "livenessProbe" in container, name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            get = container.get(probe, {}).get("httpGet")
            if get:
                assert get["port"] in port_names, f"{name} {probe}"
        resources = container["resources"]
        assert resources["requests"] and resources["limits"]["memory"], name


def test_router_deployment() -> None:
    router = _of(BASE, "Deployment")["fleet-router"]
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
    redis = _of(BASE, "Service")[url.hostname or ""]
    assert url.port in {p["port"] for p in redis["spec"]["ports"]}
    service = _of(BASE, "Service")["fleet-router"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert _of(BASE, "PodDisruptionBudget")["fleet-router"]["spec"]["minAvailable"] >= 1


def _named_port(ports: list[dict[str, Any]], name: str, key: str = "port") -> int:
    (port,) = [p[key] for p in ports if p["name"] == name]
    return int(port)


@pytest.mark.parametrize(
    ("objects", "replicas"), [(BASE, "sim-replica"), (GPU, "vllm")], ids=["base", "gpu"]
)
def test_router_discovers_the_ready_pods_of_the_replica_deployment(
    objects: dict[tuple[str, str], dict[str, Any]], replicas: str
) -> None:
    """The router resolves the replicas' headless Service (one A record per ready pod) and
    reaches every pod on its http port (and, in exact mode, its kv-events port); so the replicas
    are a plain Deployment that scales without touching the router."""
    assert _of(objects, "StatefulSet") == {}, "no workload needs a stable pod name any more"
    deployments = _of(objects, "Deployment")
    running = {n for n, d in deployments.items() if d["spec"]["replicas"] > 0}
    assert running == {"fleet-router", "redis", replicas}
    deployment = deployments[replicas]
    container = _container(deployment)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # DNS lists ready pods
    spec = _of(objects, "Service")[replicas]["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is False
    assert spec["ipFamilyPolicy"] == "SingleStack"  # one address (one replica) per pod
    assert spec["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()

    router = _container(deployments["fleet-router"])
    cfg = load_config([], env=_env(router))
    assert cfg.replicas == () and cfg.embedded_sim_replicas == 0
    (target,) = cfg.dns_targets
    namespace = load_yaml(K8S_DIR / "kustomization.yaml")["namespace"]
    assert target.host == f"{replicas}.{namespace}.svc.cluster.local"
    assert target.scheme == "http"
    # The pod's own port: the router connects to pod IPs, never through the Service's port map.
    assert target.port == _named_port(spec["ports"], "http")
    assert target.port == _named_port(container["ports"], "http", "containerPort")
    assert cfg.discover_dns_grace_rounds >= 2  # one DNS flap never drops a replica's index
    kv_port = _named_port(container["ports"], "kv-events", "containerPort")
    assert kv_port == _named_port(spec["ports"], "kv-events")
    if replicas == "sim-replica":  # exact mode on the sims' KV events, in 16-token blocks
        assert cfg.discover_dns_kv_events_port == kv_port
        assert cfg.tokenizer == "sim" and cfg.block_units == 16
    else:  # approximate mode until a tokenizer.json is provided (see gpu/router-replicas.yaml)
        assert cfg.discover_dns_kv_events_port is None and cfg.tokenizer is None
    assert cfg.kv_events == ()  # static KV-event endpoints would name no discovered replica


def test_vllm_has_a_gpu_and_exposes_kv_events() -> None:
    vllm = _of(GPU, "Deployment")["vllm"]
    # A rollout replaces pods one at a time without asking for an extra GPU.
    assert vllm["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    container = _container(vllm)
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557}
    args = container["args"]
    assert "tcp://*:5557" in args[args.index("--kv-events-config") + 1]
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("name", ["vllm", "sim-replica"])
def test_replicas_have_headless_services_with_http_and_kv_events(name: str) -> None:
    service = _of(GPU, "Service")[name]
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "http": 8000,
        "kv-events": 5557,
    }


def test_sim_replica_runs_our_image_as_non_root_listening_beyond_loopback() -> None:
    sim = _of(BASE, "Deployment")["sim-replica"]
    container = _container(sim)
    assert container["command"] == ["fleet-replica"]
    args = container["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--port") + 1] == "8000"
    assert args[args.index("--kv-events-endpoint") + 1] == "tcp://*:5557"
    security = sim["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
