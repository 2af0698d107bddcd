"""Paged KV cache with prefix caching: a pool of fixed-size blocks and their chain hashes.

Every block is in exactly one of three states, so ``free + cached_free + used == num_blocks``:

- *used*: referenced by at least one running request (``ref > 0``);
- *cached free*: unreferenced but holding a full, hashed block — kept in an LRU so a later request
  with the same prefix can reuse it; evicted (a `BlockRemoved` event) only when a block is needed
  and no plain free block is left;
- *free*: unreferenced and holding nothing worth keeping.

All operations are O(1) per block. Hashes are registered once (`BlockStored` event) when a block
becomes full; one hash maps to at most one block.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

import xxhash

from replicas.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["BlockPool", "hash_block", "root_hash"]

_MASK64 = (1 << 64) - 1


def root_hash(seed: int) -> int:
    """The parent hash of a request's first block (vLLM's NONE_HASH), derived from the seed."""
    return xxhash.xxh3_64_intdigest(b"fleet-router-sim-root", seed=seed & _MASK64)


def hash_block(parent: int, token_ids: Sequence[int], extra: bytes, seed: int) -> int:
    """Chain hash of one full block: H(parent hash, block token ids, extra keys)."""
    data = parent.to_bytes(8, "little") + array("I", token_ids).tobytes() + extra
    return xxhash.xxh3_64_intdigest(data, seed=seed & _MASK64)


class BlockPool:
    """The KV blocks of one replica. Requests hold lists of block ids handed out here."""

    __slots__ = (
        "_cached_free",
        "_free",
        "_sink",
        "block_size",
        "by_hash",
        "caching",
        "hash_of",
        "num_blocks",
        "num_used",
        "ref",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        sink: Callable[[KVEvent], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_caching
        self._sink = sink
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        # Plain free blocks as a stack (popping from the end is O(1)); block 0 comes out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached free blocks, least recently freed first.
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self.num_used = 0

    # --- counts -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    @property
    def num_allocatable(self) -> int:
        return len(self._free) + len(self._cached_free)

    def cached_hashes(self) -> set[int]:
        """Every hash a new request could hit right now (used or cached free)."""
        return set(self.by_hash)

    # --- prefix hits --------------------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks holding the longest cached run of ``hashes[:max_blocks]`` (not yet taken)."""
        by_hash = self.by_hash
        out: list[int] = []
        for i in range(min(max_blocks, len(hashes))):
            block = by_hash.get(hashes[i])
            if block is None:
                break
            out.append(block)
        return out

    def count_unreferenced(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the cached-free list (taking them shrinks it)."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        """Reference cached blocks found by `match_prefix`."""
        ref = self.ref
        cached_free = self._cached_free
        for b in blocks:
            if ref[b] == 0:
                del cached_free[b]
                self.num_used += 1
            ref[b] += 1

    # --- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting least recently freed cached blocks if needed; ``None``
        (and no change) when fewer than ``n`` are allocatable."""
        free = self._free
        if n > len(free) + len(self._cached_free):
            return None
        k = min(n, len(free))
        out = free[len(free) - k :]
        del free[len(free) - k :]
        if k < n:
            removed: list[int] = []
            popitem = self._cached_free.popitem
            hash_of = self.hash_of
            by_hash = self.by_hash
            for _ in range(n - k):
                b, _none = popitem(last=False)
                h = hash_of[b]
                if h is not None:
                    hash_of[b] = None
                    del by_hash[h]
                    removed.append(h)
                out.append(b)
            if removed and self._sink is not None:
                self._sink(BlockRemoved(block_hashes=removed))
        ref = self.ref
        for b in out:
            ref[b] = 1
        self.num_used += n
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; tail blocks first so they are evicted first."""
        ref = self.ref
        hash_of = self.hash_of
        cached_free = self._cached_free
        free = self._free
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                self.num_used -= 1
                if hash_of[b] is None:
                    free.append(b)
                else:
                    cached_free[b] = None

    # --- hashing ------------------------------------------------------------------------------
    def store(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        start: int,
        end: int,
        token_ids: Callable[[int, int], list[int]],
    ) -> None:
        """Register ``hashes[start:end]`` for ``blocks[start:end]`` (newly full blocks).

        A hash already held by another block (two requests computed the same block at once)
        leaves this block plain. ``token_ids(first, last)`` gives the blocks' tokens for events.
        """
        hash_of = self.hash_of
        by_hash = self.by_hash
        sink = self._sink
        run_start = -1
        for i in range(start, end):
            b = blocks[i]
            h = hashes[i]
            if hash_of[b] is None and h not in by_hash:
                hash_of[b] = h
                by_hash[h] = b
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                if sink is not None:
                    self._emit_stored(hashes, run_start, i, token_ids)
                run_start = -1
        if run_start >= 0 and sink is not None:
            self._emit_stored(hashes, run_start, end, token_ids)

    def _emit_stored(
        self,
        hashes: Sequence[int],
        start: int,
        end: int,
        token_ids: Callable[[int, int], list[int]],
    ) -> None:
        assert self._sink is not None
        self._sink(
            BlockStored(
                block_hashes=list(hashes[start:end]),
                parent_block_hash=hashes[start - 1] if start > 0 else None,
                token_ids=token_ids(start, end),
                block_size=self.block_size,
            )
        )

    def clear_cache(self) -> None:
        """Forget every hash (cached free blocks become plain free) and emit AllBlocksCleared."""
        hash_of = self.hash_of
        for b in self.by_hash.values():
            hash_of[b] = None
        self.by_hash.clear()
        # Reversed so the least recently freed block is handed out last from the stack.
        self._free.extend(reversed(self._cached_free))
        self._cached_free.clear()
        if self._sink is not None:
            self._sink(AllBlocksCleared())

    def check(self) -> None:
        """Assert the pool's invariants (tests and debugging; O(num_blocks))."""
        used = sum(1 for r in self.ref if r > 0)
        assert used == self.num_used, (used, self.num_used)
        assert min(self.ref) >= 0
        assert len(self._free) + len(self._cached_free) + self.num_used == self.num_blocks
        assert all(self.ref[b] == 0 and self.hash_of[b] is None for b in self._free)
        assert all(self.ref[b] == 0 and self.hash_of[b] is not None for b in self._cached_free)
        assert len(set(self._free)) == len(self._free)
        for h, b in self.by_hash.items():
            assert self.hash_of[b] == h
        assert sum(1 for h in self.hash_of if h is not None) == len(self.by_hash)
