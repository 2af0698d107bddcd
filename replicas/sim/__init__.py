"""A vLLM-compatible simulated replica: the engine (no clock) and an aiohttp server around it.

Start one in-process::

    from replicas.sim import SimSettings, running_replica

    async with running_replica(SimSettings(port=0, time_scale=0.02)) as replica:
        ...  # replica.url speaks vLLM's OpenAI API, /metrics, KV events

or from a shell: ``fleet-replica --port 8001 --model NAME`` (or ``python -m replicas.sim``).

The server names are imported lazily, so ``import replicas.sim.engine`` (the virtual-time
simulator's path) does not pull in aiohttp and prometheus_client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from replicas.sim.settings import SettingsError, SimSettings

if TYPE_CHECKING:
    from replicas.sim.server import SimReplica, create_app, running_replica, start_replica

__all__ = [
    "SettingsError",
    "SimReplica",
    "SimSettings",
    "create_app",
    "running_replica",
    "start_replica",
]

_SERVER_NAMES = frozenset({"SimReplica", "create_app", "running_replica", "start_replica"})


def __getattr__(name: str) -> Any:
    if name in _SERVER_NAMES:
        from replicas.sim import server

        return getattr(server, name)
    raise AttributeError(f"module 'replicas.sim' has no attribute {name!r}")
