"""Where shared fleet state lives: in this process (default) or in Redis.

The request path only enqueues (``StateBackend.publish_*`` / ``record_*``); background tasks
share the changes with other router instances and apply theirs to a ``StateSink``.
"""

from router.state.base import BackendStats, StateBackend, StateSink
from router.state.memory import MemoryBackend, MemorySettings, MemoryStore
from router.state.records import (
    ChangeKind,
    EvictionRecord,
    HotPrefix,
    IndexChange,
    RegistryChange,
    RegistryKind,
    ReplicaCounters,
)
from router.state.redis_backend import RedisBackend, RedisSettings
from router.state.schema import DEFAULT_KEY_PREFIX, KeySchema
from router.state.snapshot import IndexSnapshot, SnapshotBuilder
from router.state.sync import SharedFleet, StateSync
from router.state.wiring import SHARED_STATE, make_backend, shared_state_context

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "SHARED_STATE",
    "BackendStats",
    "ChangeKind",
    "EvictionRecord",
    "HotPrefix",
    "IndexChange",
    "IndexSnapshot",
    "KeySchema",
    "MemoryBackend",
    "MemorySettings",
    "MemoryStore",
    "RedisBackend",
    "RedisSettings",
    "RegistryChange",
    "RegistryKind",
    "ReplicaCounters",
    "SharedFleet",
    "SnapshotBuilder",
    "StateBackend",
    "StateSink",
    "StateSync",
    "make_backend",
    "shared_state_context",
]
