"""Index snapshots: what a new instance loads before replaying the change-stream tail.

A snapshot stores, per model, the prefix trie once (each node: its block hash and its parent)
and, per replica, the leaves it holds, oldest use first.  Shared prefixes are therefore stored
once however many replicas or paths hold them, and replaying the leaves in order as INSERT
changes rebuilds each replica's holdings and its LRU order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgpack

from router.state.codec import CodecError, pack_hashes, unpack_hashes
from router.state.records import ChangeKind, IndexChange

__all__ = ["IndexSnapshot", "ModelTrie", "SnapshotBuilder"]

_VERSION = 1


@dataclass(slots=True)
class ModelTrie:
    """One model's trie: parallel arrays of node hash and parent index (-1 for the root)."""

    hashes: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # replica id → leaf node indices in the order to replay them (least recently used first)
    leaves: dict[str, list[int]] = field(default_factory=dict)

    def path(self, node: int) -> tuple[int, ...]:
        """The block-hash path from the root to ``node``."""
        out: list[int] = []
        while node >= 0:
            out.append(self.hashes[node])
            node = self.parents[node]
        out.reverse()
        return tuple(out)


@dataclass(slots=True)
class IndexSnapshot:
    """A decoded snapshot and the change-stream id it is consistent with."""

    stream_id: str
    origin: str
    created_ms: int
    models: dict[str, ModelTrie]

    @property
    def blocks(self) -> int:
        """Distinct trie nodes over all models."""
        return sum(len(t.hashes) for t in self.models.values())

    def changes(self) -> Iterator[IndexChange]:
        """The snapshot as INSERT changes, each replica's leaves oldest first."""
        for model, trie in self.models.items():
            for replica_id, leaves in trie.leaves.items():
                for leaf in leaves:
                    yield IndexChange(
                        ChangeKind.INSERT, model, trie.path(leaf), replica_id, self.origin
                    )

    def encode(self) -> bytes:
        """msgpack bytes (hashes as packed u64, parents as packed i64)."""
        models = [
            [
                model,
                pack_hashes(trie.hashes),
                pack_hashes(trie.parents, "q"),
                [[rid, pack_hashes(leaves, "q")] for rid, leaves in trie.leaves.items()],
            ]
            for model, trie in self.models.items()
        ]
        body = {
            "v": _VERSION,
            "id": self.stream_id,
            "by": self.origin,
            "at": self.created_ms,
            "models": models,
        }
        return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]

    @classmethod
    def decode(cls, data: bytes) -> IndexSnapshot:
        """Inverse of encode; raises CodecError on anything unexpected."""
        try:
            body = msgpack.unpackb(data, raw=False)
            if body.get("v") != _VERSION:
                raise CodecError(f"snapshot version {body.get('v')!r} is not {_VERSION}")
            models: dict[str, ModelTrie] = {}
            for model, hashes, parents, leaves in body["models"]:
                trie = ModelTrie(
                    hashes=unpack_hashes(hashes).tolist(),
                    parents=unpack_hashes(parents, "q").tolist(),
                    leaves={str(rid): unpack_hashes(lv, "q").tolist() for rid, lv in leaves},
                )
                if len(trie.hashes) != len(trie.parents):
                    raise CodecError("snapshot trie arrays differ in length")
                models[str(model)] = trie
            return cls(str(body["id"]), str(body["by"]), int(body["at"]), models)
        except CodecError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.ExtraData) as exc:
            raise CodecError(f"undecodable snapshot: {exc}") from exc


class SnapshotBuilder:
    """Collects (model, replica, path) holdings into a deduplicated trie.

    Add holdings in the order they should be replayed (least recently used first); adding a path
    that is a prefix of another one already added is harmless (replay refreshes it).
    """

    def __init__(self) -> None:
        self._models: dict[str, ModelTrie] = {}
        self._nodes: dict[str, dict[tuple[int, int], int]] = {}

    def add(self, model: str, replica_id: str, path: Sequence[int]) -> None:
        if not path:
            return
        trie = self._models.get(model)
        if trie is None:
            trie = self._models[model] = ModelTrie()
            self._nodes[model] = {}
        nodes = self._nodes[model]
        parent = -1
        for block in path:
            key = (parent, block)
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = len(trie.hashes)
                trie.hashes.append(block)
                trie.parents.append(parent)
            parent = node
        trie.leaves.setdefault(replica_id, []).append(parent)

    def build(self, stream_id: str, origin: str) -> IndexSnapshot:
        return IndexSnapshot(stream_id, origin, int(time.time() * 1000), self._models)
