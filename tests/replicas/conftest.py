"""Fixtures for replica tests: real simulated replicas on 127.0.0.1.

`sim_replica` is a factory: ``replica = await sim_replica(time_scale=0.02, num_gpu_blocks=256)``
starts a real HTTP server on a free port with those `SimSettings` fields (anything not given keeps
the test defaults below) and stops it when the test ends. Other test directories may copy it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from replicas.sim import SimReplica, SimSettings, start_replica

# Fast by default: 50x quicker than the modelled H100, still real asynchronous streaming.
TEST_DEFAULTS: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "time_scale": 0.02}

StartReplica = Callable[..., Awaitable[SimReplica]]


@pytest.fixture
async def sim_replica() -> AsyncIterator[StartReplica]:
    started: list[SimReplica] = []

    async def start(**fields: Any) -> SimReplica:
        replica = await start_replica(SimSettings(**{**TEST_DEFAULTS, **fields}))
        started.append(replica)
        return replica

    try:
        yield start
    finally:
        for replica in reversed(started):
            await replica.stop()
