"""How a gateway gets its state backend: chosen from the config, run by a cleanup context."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from router.state.base import StateBackend
from router.state.memory import MemoryBackend
from router.state.redis_backend import RedisBackend, RedisSettings
from router.state.schema import DEFAULT_KEY_PREFIX
from router.state.sync import StateSync

__all__ = ["SHARED_STATE", "make_backend", "shared_state_context"]

SHARED_STATE: web.AppKey[StateSync] = web.AppKey("fleet_router_shared_state", StateSync)


def make_backend(redis_url: str | None, redis_prefix: str = DEFAULT_KEY_PREFIX) -> StateBackend:
    """Redis when a URL is given, else the in-process backend."""
    if redis_url:
        return RedisBackend(RedisSettings(url=redis_url, key_prefix=redis_prefix))
    return MemoryBackend()


async def shared_state_context(app: web.Application) -> AsyncIterator[None]:
    """Warm up from shared state before serving; flush and stop the backend's tasks at exit.

    A Redis that cannot be reached does not stop the gateway from starting (it routes on local
    state and syncs once Redis answers).
    """
    sync = app[SHARED_STATE]
    await sync.backend.start(sync)
    try:
        yield
    finally:
        await sync.backend.stop()
