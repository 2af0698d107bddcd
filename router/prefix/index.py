"""The prefix index: which replica holds which prompt prefix, as a pygtrie trie per model.

A trie key is the tuple of a prompt's chained block hashes (router.prefix.keys), one trie level
per block.  Each node's value says which replicas hold that block and when each last used it.
One walk down the trie returns, for every replica at once, how many leading blocks of a prompt it
holds.  Each replica's share is bounded by its KV capacity (in our block units): when it is full,
its least-recently-used *leaves* go first, as in vLLM's free-block LRU; a hard global cap bounds
the whole index.  Time is a logical counter (one tick per insert/refresh), so the index is pure,
deterministic and usable in virtual time.

Representation (chosen to stay near 150 bytes per block; benchmarks/prefix_index.py measures it):

- A node's value is a tuple of ints `stamp << 16 | slot`, one per holding replica (`slot` is a
  small per-replica number).  One insert stamps a whole path with the same stamp, so the nodes of
  that path share one value tuple: a block costs pygtrie's node and child link, not a dict.
- Stamps never decrease from a node to its parent (every touch stamps the whole path from the
  root), so a replica's least-recently-stamped block is always one of its leaves.
- Per replica, an insertion-ordered map stamp → path ("records") replaces a per-block LRU list:
  the oldest record's blocks that still carry its stamp are exactly the replica's LRU leaves and
  their chain; they are evicted deepest first.  A record is dropped as soon as a newer insert
  re-stamps its deepest block, so records never outnumber a replica's leaves.

The walk uses pygtrie's node objects (`_root`, `children.get/add/delete`, `value`) directly: its
public generators allocate a step object per level, several times slower for 500-block prompts.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import pygtrie

__all__ = ["BYTES_PER_BLOCK_ESTIMATE", "Holding", "IndexSettings", "IndexStats", "PrefixIndex"]

_SLOT_BITS: Final = 16
_SLOT_MASK: Final = (1 << _SLOT_BITS) - 1
_MAX_SLOTS: Final = 1 << _SLOT_BITS

# Measured by benchmarks/prefix_index.py (tracemalloc, one replica per block, 8k-token prompts);
# used only for the `approx_bytes` statistic and metric.
BYTES_PER_BLOCK_ESTIMATE: Final = 150

_Node = Any  # pygtrie's private node type (pygtrie ships no type information)
_Path = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """Bounds of the prefix index, in blocks of the routing key (see router.prefix.units)."""

    # A replica's capacity when its KV size is unknown (not scraped yet, or not a vLLM replica).
    default_capacity_blocks: int = 1 << 16
    # Hard cap on trie nodes over all models and replicas (memory bound, ~150 B each).
    max_blocks: int = 2_000_000

    def __post_init__(self) -> None:
        if self.default_capacity_blocks < 0:
            raise ValueError("default_capacity_blocks must be >= 0")
        if self.max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the index's size and evictions."""

    blocks_by_model: dict[str, int]
    blocks: int
    approx_bytes: int
    held_blocks: dict[str, int]  # blocks each replica is believed to hold
    evictions: dict[str, int]  # blocks evicted per replica since it was added (capacity or cap)


class Holding(NamedTuple):
    """One prompt prefix a replica holds: the block-hash path from the root."""

    model: str
    replica_id: str
    block_hashes: tuple[int, ...]


class _ModelTrie:
    __slots__ = ("model", "nodes", "trie")

    def __init__(self, model: str) -> None:
        self.model = model
        self.trie: pygtrie.Trie = pygtrie.Trie()
        self.nodes = 0


@dataclass(slots=True, eq=False)
class _Holder:
    """What the index keeps per replica."""

    replica_id: str
    slot: int
    capacity_blocks: int | None = None
    blocks: int = 0
    evictions: int = 0
    # stamp -> (model trie, path); insertion order is stamp order (oldest first).
    records: OrderedDict[int, tuple[_ModelTrie, _Path]] = field(default_factory=OrderedDict)


def _stamp_of(value: tuple[int, ...], slot: int) -> int | None:
    for packed in value:
        if packed & _SLOT_MASK == slot:
            return packed >> _SLOT_BITS
    return None


def _with_slot(value: tuple[int, ...], slot: int, packed: int) -> tuple[int, ...]:
    return (*(p for p in value if p & _SLOT_MASK != slot), packed)


def _without_slot(value: tuple[int, ...], slot: int) -> tuple[int, ...]:
    return tuple(p for p in value if p & _SLOT_MASK != slot)


class PrefixIndex:
    """Prefix index over all models, facade over one pygtrie trie per model.

    Not thread-safe by design: one event loop owns it.
    """

    def __init__(self, settings: IndexSettings | None = None) -> None:
        self.settings = settings or IndexSettings()
        self._tries: dict[str, _ModelTrie] = {}
        self._holders: dict[str, _Holder] = {}
        self._slot_owner: dict[int, _Holder] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._tick = 0
        self._nodes = 0

    # ------------------------------------------------------------------ queries

    def match(self, model: str, block_hashes: _Path) -> dict[str, int]:
        """For every replica holding a prefix of `block_hashes`: how many leading blocks it holds.

        One walk for all replicas; replicas holding nothing are absent.  Does not touch LRU state.
        """
        mt = self._tries.get(model)
        if mt is None or not block_hashes:
            return {}
        node: _Node = mt.trie._root
        prev: object = None
        alive: set[int] = set()
        found: dict[int, int] = {}
        depth = 0
        for step in block_hashes:
            child = node.children.get(step)
            if child is None:
                break
            value = child.value
            if value is not prev:
                # Values are shared along a path stamped by one insert: only recompute on change.
                slots = {p & _SLOT_MASK for p in value}
                if depth == 0:
                    alive = slots
                else:
                    for gone in alive - slots:
                        found[gone] = depth
                    alive &= slots
                if not alive:
                    break
                prev = value
            node = child
            depth += 1
        for slot in alive:
            found[slot] = depth
        owners = self._slot_owner
        return {owners[slot].replica_id: n for slot, n in found.items() if n > 0}

    def holds(self, replica_id: str) -> int:
        """Blocks `replica_id` is believed to hold (0 for an unknown replica)."""
        holder = self._holders.get(replica_id)
        return holder.blocks if holder is not None else 0

    def evictions_of(self, replica_id: str) -> int:
        """Blocks evicted from `replica_id`'s share since it was added (O(1); `stats()` builds
        dicts over every replica and model, too much for the request path)."""
        holder = self._holders.get(replica_id)
        return holder.evictions if holder is not None else 0

    def capacity_of(self, replica_id: str) -> int:
        """The capacity in blocks in force for `replica_id` (its own, else the default)."""
        holder = self._holders.get(replica_id)
        if holder is None or holder.capacity_blocks is None:
            return self.settings.default_capacity_blocks
        return holder.capacity_blocks

    def stats(self) -> IndexStats:
        """Sizes and eviction counts, for metrics and the admin API."""
        by_model = {model: mt.nodes for model, mt in self._tries.items()}
        return IndexStats(
            blocks_by_model=by_model,
            blocks=self._nodes,
            approx_bytes=self._nodes * BYTES_PER_BLOCK_ESTIMATE,
            held_blocks={h.replica_id: h.blocks for h in self._holders.values()},
            evictions={h.replica_id: h.evictions for h in self._holders.values()},
        )

    def holdings(self) -> Iterator[Holding]:
        """Everything the index holds, as paths, least recently used first over the whole index.

        One path per LRU record (at most one per leaf a replica holds), cut to the blocks the
        replica still holds.  Inserting them in this order into an empty index with the same
        settings rebuilds every replica's holdings *and* LRU order (what snapshots rely on).

        Lazy: the records are listed when iteration starts and each path is read when it is
        yielded, so the index may change between items (a consumer that reads a slice per
        event-loop turn gets paths that were held at the time each was read).
        """
        per_replica = [
            [(stamp, holder, mt, path) for stamp, (mt, path) in holder.records.items()]
            for holder in self._holders.values()
        ]
        # Records are in stamp order per replica; stamps are unique over the index.
        for _stamp, holder, mt, path in heapq.merge(*per_replica, key=lambda r: r[0]):
            if self._holders.get(holder.replica_id) is not holder:
                continue  # removed meanwhile (its slot may belong to another replica now)
            if self._tries.get(mt.model) is not mt:
                continue  # the model's trie emptied and was dropped meanwhile
            held = self._held_depth(mt, path, holder.slot)
            if held:
                yield Holding(mt.model, holder.replica_id, path[:held])

    @property
    def blocks(self) -> int:
        """Trie nodes over all models (a block held by two replicas counts once)."""
        return self._nodes

    @property
    def replicas(self) -> tuple[str, ...]:
        """Replicas the index knows (holding blocks or with a capacity set)."""
        return tuple(self._holders)

    # ------------------------------------------------------------------ updates

    def insert(self, model: str, block_hashes: _Path, replica_id: str) -> None:
        """Record that `replica_id` holds (or is about to hold) these blocks; they become its
        most recently used.  Called speculatively right after a routing decision."""
        if not block_hashes:
            return
        block_hashes = tuple(block_hashes)  # kept by the LRU record: must not change under us
        holder = self._holder(replica_id)
        mt = self._tries.get(model)
        if mt is None:
            mt = self._tries[model] = _ModelTrie(model)
        self._touch(mt, block_hashes, holder)
        self._enforce_capacity(holder)
        self._enforce_global_cap()

    def refresh(self, model: str, block_hashes: _Path, replica_id: str) -> None:
        """On completion: the replica has now computed these blocks, so they are its most recently
        used; blocks the index evicted meanwhile are restored (vLLM kept them while in use)."""
        self.insert(model, block_hashes, replica_id)

    def set_capacity(self, replica_id: str, capacity_blocks: int | None) -> None:
        """Bound `replica_id`'s share (None: the configured default); evicts LRU blocks if over."""
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        holder = self._holder(replica_id)
        holder.capacity_blocks = capacity_blocks
        self._enforce_capacity(holder)

    def remove_blocks(self, model: str, block_hashes: _Path, replica_id: str) -> int:
        """Forget that `replica_id` holds the block named by `block_hashes` (the path from the root
        to it) *and every block below it*: a prefix cache cannot reach a block whose parent is
        gone.  Returns the number of blocks removed.  Used by exact mode on BlockRemoved."""
        holder = self._holders.get(replica_id)
        mt = self._tries.get(model)
        if holder is None or mt is None or not block_hashes:
            return 0
        block_hashes = tuple(block_hashes)
        nodes = self._walk(mt, block_hashes)
        if len(nodes) < len(block_hashes):
            return 0
        depth = len(block_hashes) - 1
        slot = holder.slot
        parent = nodes[depth - 1] if depth > 0 else mt.trie._root
        removed, stamps = self._drop_subtree(mt, parent, block_hashes[depth], slot, thorough=False)
        holder.blocks -= removed
        # Records whose path ran through the removed block keep only the part above it.
        records = holder.records
        top = block_hashes[depth]
        for stamp in stamps:
            record = records.get(stamp)
            if record is None or record[0] is not mt:
                continue
            path = record[1]
            if len(path) > depth and path[depth] == top:
                if depth > 0 and _stamp_of(nodes[depth - 1].value, slot) == stamp:
                    records[stamp] = (mt, path[:depth])
                else:
                    del records[stamp]
        self._prune_path(mt, nodes[:depth], block_hashes)
        self._drop_empty_tries()
        return removed

    def clear_replica(self, replica_id: str) -> None:
        """Forget everything `replica_id` holds (e.g. on AllBlocksCleared); keep its capacity."""
        holder = self._holders.get(replica_id)
        if holder is None:
            return
        for mt in list(self._tries.values()):
            root = mt.trie._root
            for step, _child in list(root.children.items()):
                self._drop_subtree(mt, root, step, holder.slot, thorough=True)
        holder.records.clear()
        holder.blocks = 0
        self._drop_empty_tries()

    def remove_replica(self, replica_id: str) -> None:
        """Forget `replica_id` entirely: its blocks, capacity and counters."""
        holder = self._holders.get(replica_id)
        if holder is None:
            return
        self.clear_replica(replica_id)
        del self._holders[replica_id]
        del self._slot_owner[holder.slot]
        self._free_slots.append(holder.slot)

    # ------------------------------------------------------------------ internals

    def _holder(self, replica_id: str) -> _Holder:
        holder = self._holders.get(replica_id)
        if holder is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                if self._next_slot >= _MAX_SLOTS:
                    raise ValueError(f"more than {_MAX_SLOTS} replicas in one prefix index")
                slot = self._next_slot
                self._next_slot += 1
            holder = self._holders[replica_id] = _Holder(replica_id, slot)
            self._slot_owner[slot] = holder
        return holder

    def _walk(self, mt: _ModelTrie, path: _Path) -> list[_Node]:
        """The existing nodes along `path`, from depth 0, stopping at the first missing one."""
        nodes: list[_Node] = []
        node = mt.trie._root
        for step in path:
            node = node.children.get(step)
            if node is None:
                break
            nodes.append(node)
        return nodes

    def _held_depth(self, mt: _ModelTrie, path: _Path, slot: int) -> int:
        """How many leading blocks of `path` the replica in `slot` holds."""
        node = mt.trie._root
        prev: object = None
        depth = 0
        for step in path:
            node = node.children.get(step)
            if node is None:
                break
            value = node.value
            if value is not prev:  # shared along a path stamped by one insert: check on change
                if _stamp_of(value, slot) is None:
                    break
                prev = value
            depth += 1
        return depth

    def _touch(self, mt: _ModelTrie, path: _Path, holder: _Holder) -> None:
        self._tick += 1
        stamp = self._tick
        slot = holder.slot
        packed = stamp << _SLOT_BITS | slot
        node = mt.trie._root
        prev_old: object = None
        prev_new: tuple[int, ...] = ()
        prev_had: int | None = None
        added = 0
        created = 0
        # old stamp of this replica -> deepest depth where this path met it
        last_depth_of: dict[int, int] = {}
        for depth, step in enumerate(path):
            children = node.children
            child = children.get(step)
            if child is None:
                child = children.add(node, step)
                child.value = ()
                created += 1
                old: tuple[int, ...] = ()
            else:
                old = child.value
            if old is not prev_old:
                prev_old = old
                prev_had = _stamp_of(old, slot)
                prev_new = _with_slot(old, slot, packed)
            if prev_had is None:
                added += 1
            else:
                last_depth_of[prev_had] = depth
            child.value = prev_new
            node = child
        mt.nodes += created
        self._nodes += created
        holder.blocks += added
        records = holder.records
        for old_stamp, depth in last_depth_of.items():
            record = records.get(old_stamp)
            # The record's deepest block was re-stamped: its whole path carries newer stamps.
            if record is not None and record[0] is mt and len(record[1]) == depth + 1:
                del records[old_stamp]
        records[stamp] = (mt, path)

    def _enforce_capacity(self, holder: _Holder) -> None:
        capacity = self.capacity_of(holder.replica_id)
        while holder.blocks > capacity and holder.records:
            self._evict_from_oldest(holder, holder.blocks - capacity)

    def _enforce_global_cap(self) -> None:
        cap = self.settings.max_blocks
        while self._nodes > cap:
            oldest: _Holder | None = None
            oldest_stamp = 0
            for holder in self._holders.values():
                if holder.records:
                    stamp = next(iter(holder.records))
                    if oldest is None or stamp < oldest_stamp:
                        oldest, oldest_stamp = holder, stamp
            if oldest is None:
                return
            # Evicting a block shared with another replica frees no node: the loop goes on.
            self._evict_from_oldest(oldest, self._nodes - cap)

    def _evict_from_oldest(self, holder: _Holder, wanted: int) -> None:
        """Evict up to `wanted` blocks of `holder`'s oldest record, deepest first."""
        stamp, (mt, path) = next(iter(holder.records.items()))
        slot = holder.slot
        nodes = self._walk(mt, path)
        evicted = 0
        prev_old: object = None
        prev_new: tuple[int, ...] = ()
        for depth in range(len(nodes) - 1, -1, -1):
            if evicted >= wanted:
                break
            node = nodes[depth]
            old = node.value
            if _stamp_of(old, slot) != stamp:
                continue
            if old is not prev_old:
                prev_old = old
                prev_new = _without_slot(old, slot)
            node.value = prev_new
            evicted += 1
            if not prev_new and not node.children:
                parent = nodes[depth - 1] if depth > 0 else mt.trie._root
                parent.children.delete(parent, path[depth])
                mt.nodes -= 1
                self._nodes -= 1
        holder.blocks -= evicted
        holder.evictions += evicted
        if evicted < wanted or not any(
            _stamp_of(nodes[d].value, slot) == stamp for d in range(len(nodes) - 1, -1, -1)
        ):
            del holder.records[stamp]
        if mt.nodes == 0:
            self._tries.pop(mt.model, None)

    def _drop_subtree(
        self, mt: _ModelTrie, parent: _Node, step: int, slot: int, *, thorough: bool
    ) -> tuple[int, set[int]]:
        """Remove `slot` from the child of `parent` at `step` and the blocks below it, pruning
        nodes left empty.  Returns (blocks the slot held there, their stamps).  Unless
        `thorough`, only descends through blocks the slot holds (enough when holders nest)."""
        removed = 0
        stamps: set[int] = set()
        # Iterative post-order walk: prompts can be thousands of blocks deep.
        stack: list[tuple[_Node, int, _Node, bool]] = [
            (parent, step, parent.children.get(step), False)
        ]
        while stack:
            par, st, node, expanded = stack.pop()
            if node is None:
                continue
            if not expanded:
                stack.append((par, st, node, True))
                for child_step, child in list(node.children.items()):
                    if thorough or _stamp_of(child.value, slot) is not None:
                        stack.append((node, child_step, child, False))
                continue
            value = node.value
            stamp = _stamp_of(value, slot)
            if stamp is not None:
                node.value = _without_slot(value, slot)
                removed += 1
                stamps.add(stamp)
            if not node.value and not node.children:
                par.children.delete(par, st)
                mt.nodes -= 1
                self._nodes -= 1
        return removed, stamps

    def _prune_path(self, mt: _ModelTrie, nodes: list[_Node], path: _Path) -> None:
        for depth in range(len(nodes) - 1, -1, -1):
            node = nodes[depth]
            if node.value or node.children:
                return
            parent = nodes[depth - 1] if depth > 0 else mt.trie._root
            parent.children.delete(parent, path[depth])
            mt.nodes -= 1
            self._nodes -= 1

    def _drop_empty_tries(self) -> None:
        for model in [m for m, mt in self._tries.items() if mt.nodes == 0]:
            del self._tries[model]
