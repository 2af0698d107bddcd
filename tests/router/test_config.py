"""Settings: flags > environment > YAML > defaults, and validation in one place."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import RouterConfig, load_config, parse_replica_spec
from router.errors import ConfigError
from router.policies import DEFAULT_POLICY, POLICIES


def test_defaults_are_the_documented_ones() -> None:
    cfg = RouterConfig()
    assert cfg.port == 8080
    assert cfg.policy == "kv_aware" == DEFAULT_POLICY  # the cache-aware policy is the default
    assert cfg.policy in POLICIES
    assert cfg.replicas == ()
    assert cfg.embedded_sim_replicas == 4  # no replica configured → the embedded default
    assert RouterConfig(replicas=("http://a:1",)).embedded_sim_replicas == 0
    assert RouterConfig(sim_replicas=2, replicas=("http://a:1",)).embedded_sim_replicas == 2


def test_config_is_frozen_and_normalised() -> None:
    cfg = RouterConfig(replicas=["http://a:1"], policy_options={"x": 1})  # type: ignore[arg-type]
    assert cfg.replicas == ("http://a:1",)
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.policy_options["y"] = 2  # type: ignore[index]


def test_precedence_flags_over_env_over_yaml(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "port: 9000\npolicy: round_robin\nidle_timeout_s: 5\nmax_retries: 4\n"
        "replicas:\n  - http://y1:8000\n  - {name: gpu2, url: 'http://y2:8000/'}\n"
        "policy_options: {vnodes: 10}\n"
    )
    env = {
        "FLEET_ROUTER_CONFIG": str(path),
        "FLEET_ROUTER_PORT": "9001",
        "FLEET_ROUTER_IDLE_TIMEOUT_S": "7.5",
        "FLEET_ROUTER_ACCESS_LOG": "yes",
        "UNRELATED": "x",
    }
    cfg = load_config(["--port", "9002", "--policy", "session"], env)
    assert cfg.port == 9002  # flag beats env and YAML
    assert cfg.idle_timeout_s == 7.5  # env beats YAML
    assert cfg.max_retries == 4  # YAML beats default
    assert cfg.policy == "session"
    assert cfg.access_log is True
    assert cfg.policy_options == {"vnodes": 10}
    assert [(s.replica_id, s.url) for s in cfg.replica_specs] == [
        ("http://y1:8000", "http://y1:8000"),
        ("gpu2", "http://y2:8000"),
    ]


def test_repeatable_flags_and_env_lists() -> None:
    cfg = load_config(
        ["--replica", "http://a:1", "--replica", "b=http://b:2", "--policy-option", "vnodes=8",
         "--policy-option", "flag=true", "--no-access-log", "--admin-token", "s3cret"],
        {"FLEET_ROUTER_MODELS": "m1, m2"},
    )  # fmt: skip
    assert cfg.replicas == ("http://a:1", "b=http://b:2")
    assert cfg.models == ("m1", "m2")
    assert cfg.policy_options == {"vnodes": 8, "flag": True}
    assert cfg.access_log is False
    assert cfg.admin_token == "s3cret"


@pytest.mark.parametrize("name", ["REPLICAS", "MODELS", "KV_EVENTS", "POLICY_OPTIONS"])
@pytest.mark.parametrize("blank", ["", "  ", ",", " , "])
def test_an_empty_list_setting_in_env_means_none(name: str, blank: str) -> None:
    cfg = load_config([], {f"FLEET_ROUTER_{name}": blank})
    assert getattr(cfg, name.lower()) in ((), {})
    assert cfg.embedded_sim_replicas == 4  # still "no replica configured"


def test_empty_list_items_from_flags_and_yaml_mean_none(tmp_path: Path) -> None:
    cfg = load_config(["--replica", "", "--model", " ", "--policy-option", ""], {})
    assert (cfg.replicas, cfg.models, dict(cfg.policy_options)) == ((), (), {})
    path = tmp_path / "router.yaml"
    path.write_text("kv_events: ''\nreplicas: []\nmodels: ''\n")
    cfg = load_config(["--config", str(path)], {})
    assert (cfg.kv_events, cfg.replicas, cfg.models) == ((), (), ())


def test_kv_events_env_list_keeps_each_spec_replay_endpoint() -> None:
    env = {
        "FLEET_ROUTER_REPLICAS": "r0=http://a:1,r1=http://b:1",
        "FLEET_ROUTER_TOKENIZER": "sim",
        "FLEET_ROUTER_KV_EVENTS": "r0=tcp://a:5557,tcp://a:5558, r1=tcp://b:5557",
    }
    cfg = load_config([], env)
    assert cfg.kv_events == ("r0=tcp://a:5557,tcp://a:5558", "r1=tcp://b:5557")


@pytest.mark.parametrize(
    ("argv", "env", "fragment"),
    [
        (["--port", "70000"], {}, "port must be in 0..65535"),
        (["--port", "eighty"], {}, "port: cannot read 'eighty' as int"),
        (["--connect-timeout-s", "0"], {}, "connect_timeout_s must be > 0"),
        (["--max-retries", "-1"], {}, "max_retries must be >= 0"),
        (["--replica", "gpu-1:8000"], {}, "expected http(s)://host[:port]"),
        (["--replica", "http://a:1", "--replica", "http://a:1/"], {}, "appears twice"),
        (["--log-level", "loud"], {}, "log_level must be one of"),
        ([], {"FLEET_ROUTER_ACCESS_LOG": "maybe"}, "access_log: cannot read"),
        (["--policy-option", "novalue"], {}, "expected KEY=VALUE"),
        (["--no-such-flag"], {}, "unrecognised arguments"),
    ],
)
def test_invalid_settings_raise_config_error(
    argv: list[str], env: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, env)
    assert fragment in info.value.message


def test_blank_admin_token_is_unset_from_env_but_an_error_in_code() -> None:
    assert load_config([], {"FLEET_ROUTER_ADMIN_TOKEN": ""}).admin_token is None
    with pytest.raises(ConfigError, match="admin_token must not be blank"):
        RouterConfig(admin_token="  ")


def test_several_problems_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        RouterConfig(port=-1, idle_timeout_s=0, block_units=0)
    message = info.value.message
    assert "port" in message and "idle_timeout_s" in message and "block_units" in message


def test_yaml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(["--config", str(bad)], {})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("prot: 80\n")
    with pytest.raises(ConfigError, match="unknown setting 'prot'"):
        load_config(["--config", str(unknown)], {})
    with pytest.raises(ConfigError, match="config file"):
        load_config(["--config", str(tmp_path / "missing.yaml")], {})
    listing = tmp_path / "list.yaml"
    listing.write_text("- port\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(["--config", str(listing)], {})


def test_replica_spec_parsing() -> None:
    assert parse_replica_spec("http://gpu-1:8000/").replica_id == "http://gpu-1:8000"
    named = parse_replica_spec("gpu1=https://gpu-1.internal:8443")
    assert (named.replica_id, named.url) == ("gpu1", "https://gpu-1.internal:8443")
    with pytest.raises(ConfigError):
        parse_replica_spec("http://host:notaport")
