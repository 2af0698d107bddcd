"""Exact mode: replay a replica's KV-cache events onto the prefix index.

vLLM's block hashes depend on its own hash seed, so the router cannot recompute them.  Instead it
hashes the `token_ids` of each BlockStored with its own chain (router.prefix.keys, token mode: the
same function that hashes prompts) and keeps, per replica, a map engine hash → own hash; a
BlockRemoved is translated through that map.  Own hashes are chained, so one own hash names a
whole prefix; to hand the index a full path, the indexer also remembers each own block's parent
(shared by all replicas of a model, reference-counted).  This only matches what the router
predicts when the router hashes prompts in token mode with the replicas' tokenizer and
`block_size` (and the request has no `cache_salt`: the engine does not tell us salts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from router.prefix.index import PrefixIndex
from router.prefix.keys import chain_seed, hash_token_blocks
from router.prefix.kv_decode import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch

__all__ = ["ExactIndexer"]

_ROOT = -1  # parent marker of a model's first block (own hashes are unsigned)


@dataclass(slots=True)
class _ReplicaState:
    model: str
    # engine hash -> (model, own hash) for every block the engine told us it holds
    engine_to_own: dict[Hashable, tuple[str, int]] = field(default_factory=dict)


class _Chains:
    """own hash -> parent own hash for one model, with a reference count per own hash."""

    __slots__ = ("parent", "refs")

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}
        self.refs: Counter[int] = Counter()

    def add(self, own: int, parent: int) -> None:
        self.parent[own] = parent
        self.refs[own] += 1

    def release(self, own: int) -> None:
        left = self.refs[own] - 1
        if left > 0:
            self.refs[own] = left
        else:
            self.refs.pop(own, None)
            self.parent.pop(own, None)

    def path_to(self, own: int) -> tuple[int, ...] | None:
        """The own hashes from the model's first block down to `own`; None if a link is gone."""
        path = [own]
        parent = self.parent.get(own)
        limit = len(self.parent)  # guards against a cycle (only a hash collision could make one)
        while parent is not None and parent != _ROOT:
            if len(path) > limit:
                return None
            path.append(parent)
            parent = self.parent.get(parent)
        if parent is None:
            return None
        path.reverse()
        return tuple(path)


class ExactIndexer:
    """Applies decoded KV-event batches of registered replicas to a `PrefixIndex`.

    `counts` holds events applied per (replica, type) and `unresolved` events whose parent block
    was never announced (missed events); the consumer turns both into metrics.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._replicas: dict[str, _ReplicaState] = {}
        self._chains: dict[str, _Chains] = {}
        self.counts: Counter[tuple[str, str]] = Counter()
        self.unresolved: Counter[str] = Counter()

    def add_replica(self, replica_id: str, model: str) -> None:
        """Start tracking `replica_id`, whose engine serves `model` (the name requests use)."""
        if replica_id not in self._replicas:
            self._replicas[replica_id] = _ReplicaState(model)

    def remove_replica(self, replica_id: str) -> None:
        """Stop tracking `replica_id` and forget what its events told the index."""
        self.reset_replica(replica_id)
        self._replicas.pop(replica_id, None)

    def reset_replica(self, replica_id: str) -> None:
        """Forget the replica's cache contents (AllBlocksCleared, engine restart, lost events)."""
        state = self._replicas.get(replica_id)
        if state is None:
            return
        for model, own in state.engine_to_own.values():
            self._chains[model].release(own)
        state.engine_to_own.clear()
        self.index.clear_replica(replica_id)

    def apply(self, replica_id: str, batch: KvEventBatch) -> Counter[str]:
        """Apply one engine step's events, in order; returns how many of each type."""
        applied: Counter[str] = Counter()
        state = self._replicas.get(replica_id)
        if state is None:
            return applied
        for event in batch.events:
            if isinstance(event, BlockStored):
                kind = "BlockStored"
                self._stored(replica_id, state, event)
            elif isinstance(event, BlockRemoved):
                kind = "BlockRemoved"
                self._removed(replica_id, state, event)
            else:
                assert isinstance(event, AllBlocksCleared)
                kind = "AllBlocksCleared"
                self.reset_replica(replica_id)
            self.counts[replica_id, kind] += 1
            applied[kind] += 1
        return applied

    def _stored(self, replica_id: str, state: _ReplicaState, event: BlockStored) -> None:
        if event.medium not in (None, "GPU"):
            return  # offloaded copies (CPU, disk) are not where a prefill can start from
        model = event.lora_name or state.model
        chains = self._chains.get(model)
        if chains is None:
            chains = self._chains[model] = _Chains()
        if event.parent_block_hash is None:
            parent_path: tuple[int, ...] = ()
            seed = chain_seed(model)
        else:
            parent = state.engine_to_own.get(event.parent_block_hash)
            found = chains.path_to(parent[1]) if parent is not None else None
            if found is None:
                self.unresolved[replica_id] += 1
                return
            parent_path = found
            seed = found[-1]
        own = hash_token_blocks(event.token_ids, seed, event.block_size)
        if len(own) != len(event.block_hashes):
            self.unresolved[replica_id] += 1
            return
        previous = parent_path[-1] if parent_path else _ROOT
        for engine_hash, own_hash in zip(event.block_hashes, own, strict=True):
            old = state.engine_to_own.get(engine_hash)
            if old is not None:
                self._chains[old[0]].release(old[1])
            state.engine_to_own[engine_hash] = (model, own_hash)
            chains.add(own_hash, previous)
            previous = own_hash
        self.index.insert(model, parent_path + tuple(own), replica_id)

    def _removed(self, replica_id: str, state: _ReplicaState, event: BlockRemoved) -> None:
        if event.medium not in (None, "GPU"):
            return
        for engine_hash in event.block_hashes:
            entry = state.engine_to_own.pop(engine_hash, None)
            if entry is None:
                continue
            model, own = entry
            chains = self._chains[model]
            path = chains.path_to(own)
            if path is not None:
                self.index.remove_blocks(model, path, replica_id)
            chains.release(own)
