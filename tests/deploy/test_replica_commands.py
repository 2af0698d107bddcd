"""The sim-replica commands in the deploy files are accepted by the real `fleet-replica` CLI, and
listen where the routers, Prometheus and the Services expect them (not on loopback)."""

from __future__ import annotations

import pytest

from replicas.sim.cli import build_parser, settings_from_args
from replicas.sim.settings import SimSettings
from tests.deploy.manifests import (
    COMPOSE_FILE,
    K8S_DIR,
    compose_interpolate,
    k8s_documents,
    load_yaml,
)


def _commands() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    services = compose_interpolate(load_yaml(COMPOSE_FILE))["services"]
    for name, svc in services.items():
        if svc.get("command", [""])[0] == "fleet-replica":
            out[f"compose:{name}"] = [str(a) for a in svc["command"][1:]]
    for path, doc in k8s_documents(K8S_DIR):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c.get("command") == ["fleet-replica"]:
                out[f"{path.name}:{doc['metadata']['name']}"] = [str(a) for a in c["args"]]
    return out


COMMANDS = _commands()


def test_both_deploy_files_run_sim_replicas() -> None:
    assert sum(k.startswith("compose:") for k in COMMANDS) == 4
    assert any(not k.startswith("compose:") for k in COMMANDS)


@pytest.mark.parametrize("where", sorted(COMMANDS))
def test_sim_command_is_accepted_by_the_sim_cli(where: str) -> None:
    settings = settings_from_args(build_parser().parse_args(COMMANDS[where]))
    assert isinstance(settings, SimSettings)
    assert settings.host == "0.0.0.0", "a container must listen beyond loopback"
    assert settings.port == 8000
    assert settings.kv_events_endpoint == "tcp://*:5557"
    assert settings.enable_prefix_caching and settings.enable_chunked_prefill
