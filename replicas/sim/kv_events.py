"""KV-cache events, with vLLM's field names and order (vllm/distributed/kv_events.py).

Plain data only: the engine emits them to a sink; the publisher (ZMQ + msgpack) encodes them.
Block hashes are unsigned 64-bit integers from the simulator's own seeded chain hash.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent"]


@dataclass(frozen=True)
class BlockStored:
    """Full blocks newly cached; ``token_ids`` are the blocks' tokens, concatenated."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks evicted (their hashes no longer match anything)."""

    block_hashes: list[int]
    medium: str | None = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
