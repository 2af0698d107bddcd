"""The router settings the deploy files pass (compose `environment:`, pod `env:`) are settings the
router has, with values it accepts: a misspelt FLEET_ROUTER_* variable is silently ignored by the
router, so only a test catches it."""

from __future__ import annotations

import pytest

from router.config import ENV_PREFIX, RouterConfig, load_config
from router.policies import POLICIES
from tests.deploy.manifests import (
    COMPOSE_FILE,
    compose_interpolate,
    compose_router_env,
    k8s_documents,
    load_yaml,
)


def _router_envs() -> dict[str, dict[str, str]]:
    """Router environment per deploy file / workload."""
    out: dict[str, dict[str, str]] = {}
    services = compose_interpolate(load_yaml(COMPOSE_FILE))["services"]
    for name, svc in services.items():
        if svc.get("command", [""])[0] == "fleet-router":
            out[f"compose:{name}"] = compose_router_env(svc)
    for path, doc in k8s_documents():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c.get("command", [""])[0] == "fleet-router":
                env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
                out[f"{path.name}:{doc['metadata']['name']}"] = env
    return out


ENVS = _router_envs()
VARIABLES = sorted({k for env in ENVS.values() for k in env if k.startswith(ENV_PREFIX)})


def test_deploy_files_configure_routers() -> None:
    assert any(k.startswith("compose:") for k in ENVS)
    assert any(not k.startswith("compose:") for k in ENVS)


@pytest.mark.parametrize("variable", VARIABLES)
def test_variable_is_a_router_setting(variable: str) -> None:
    # FLEET_ROUTER_CONFIG names the YAML settings file; every other variable is one setting.
    settings = {*RouterConfig.__dataclass_fields__, "config"}
    assert variable[len(ENV_PREFIX) :].lower() in settings


@pytest.mark.parametrize("where", sorted(ENVS))
def test_router_accepts_the_values(where: str) -> None:
    cfg = load_config([], env=ENVS[where])
    assert cfg.port == 8080
    # Compose lists its 4 sim replicas; Kubernetes discovers the replica pods through DNS.
    if where.startswith("compose:"):
        assert len(cfg.replica_specs) == 4 and cfg.discover_dns == ()
    else:
        assert cfg.replica_specs == () and len(cfg.dns_targets) == 1
    assert cfg.embedded_sim_replicas == 0
    assert cfg.policy in POLICIES
    assert POLICIES[cfg.policy].uses_prefix, "the deploy stack is there to route on prefixes"
