"""The request hot path: the modules every proxied request executes, for every policy.

A compiled build (`FLEET_ROUTER_COMPILE=1 pip install .`; setup.py) turns exactly these into C
extension modules with mypyc; everything else (CLI, configuration, the aiohttp control
application, Redis, discovery) runs a few times a second at most and stays interpreted.  This
module imports nothing of the router, so setup.py can read the list before anything is built.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from typing import Final

__all__ = ["MODULES", "compiled_modules", "hot_path_build"]

MODULES: Final = (
    "router.core",
    "router.errors",
    "router.metrics",
    "router.fleet.circuit",
    "router.fleet.registry",
    "router.fleet.replica",
    "router.fleet.stats",
    "router.http.dispatch",
    "router.http.edge",
    "router.http.openai",
    "router.http.validation",
    "router.policies.base",
    "router.policies.cache_aware",
    "router.policies.kv_aware",
    "router.policies.least_load",
    "router.policies.power_of_two",
    "router.policies.random_choice",
    "router.policies.round_robin",
    "router.policies.session",
    "router.prefix.index",
    "router.prefix.keys",
    "router.prefix.units",
    "router.proxy.deadlines",
    "router.proxy.forward",
    "router.proxy.headers",
    "router.proxy.retry",
    "router.proxy.sse",
    "router.proxy.upstream",
    "router.proxy.wakeup",
    "router.state.pending",
    "router.state.sync",
)


def compiled_modules() -> dict[str, bool]:
    """For each hot-path module: whether importing it loads an extension module (compiled)."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    found: dict[str, bool] = {}
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        found[name] = bool(spec and spec.origin and spec.origin.endswith(suffixes))
    return found


def hot_path_build() -> str:
    """'compiled', 'interpreted', or 'partly compiled' (a broken install: say so in the log)."""
    compiled = compiled_modules().values()
    if all(compiled):
        return "compiled"
    return "partly compiled" if any(compiled) else "interpreted"
