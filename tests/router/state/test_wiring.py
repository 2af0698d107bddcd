"""How a gateway picks and exposes its state backend (no servers needed)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from router.app import create_app
from router.config import RouterConfig
from router.errors import ConfigError
from router.http.appstate import STATE
from router.state import SHARED_STATE, MemoryBackend, RedisBackend, SharedFleet


def test_default_is_in_process_and_exported() -> None:
    app = create_app(RouterConfig(replicas=("http://127.0.0.1:9",), sim_replicas=0))
    sync = app[SHARED_STATE]
    assert isinstance(sync.backend, MemoryBackend)
    assert isinstance(app[STATE].fleet, SharedFleet) and app[STATE].core.state_sync is sync
    text = generate_latest(app[STATE].metrics.registry).decode()
    assert 'fleet_router_state_backend_up{backend="memory"} 1.0' in text
    assert 'fleet_router_state_dropped_updates_total{backend="memory"} 0.0' in text
    assert 'fleet_router_state_errors_total{backend="memory",op="write"} 0.0' in text


def test_redis_url_selects_the_redis_backend_with_its_prefix() -> None:
    config = RouterConfig(
        replicas=("http://127.0.0.1:9",),
        sim_replicas=0,
        redis_url="redis://127.0.0.1:1/0",
        redis_prefix="team-a:",
    )
    backend = create_app(config)[SHARED_STATE].backend
    assert isinstance(backend, RedisBackend)
    assert backend.keys.changes == "team-a:changes"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"workers": 2, "replicas": ("http://h:1",), "port": 8080}, "needs --redis-url"),
        ({"workers": 2, "redis_url": "redis://h:6379", "port": 8080}, "needs --replica"),
        (
            {"workers": 2, "redis_url": "redis://h:6379", "replicas": ("http://h:1",), "port": 0},
            "fixed --port",
        ),
        ({"workers": 0}, "workers must be >= 1"),
        ({"redis_url": "http://h:6379"}, "redis_url must start with"),
        ({"redis_prefix": ""}, "redis_prefix must not be empty"),
    ],
)
def test_bad_shared_state_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterConfig(**settings)  # type: ignore[arg-type]
