"""The prefix index on plain values, against a brute-force model of what it must do."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.prefix.index import IndexSettings, PrefixIndex
from router.prefix.keys import chain_seed, hash_token_blocks

SEED = chain_seed("m")


def path_of(tokens: list[int]) -> tuple[int, ...]:
    """Chained hashes with one token per block, as the router would compute them."""
    return tuple(hash_token_blocks(tokens, SEED, 1))


@dataclass
class Model:
    """Brute force: every (replica, prefix) holding with its last-use tick; LRU = lowest tick,
    deepest first among equals (a path is stamped as a whole)."""

    capacity: int
    held: dict[str, dict[tuple[int, ...], int]] = field(default_factory=dict)
    tick: int = 0

    def insert(self, path: tuple[int, ...], replica: str) -> None:
        self.tick += 1
        mine = self.held.setdefault(replica, {})
        for k in range(1, len(path) + 1):
            mine[path[:k]] = self.tick
        while len(mine) > self.capacity:
            victim = min(mine, key=lambda p: (mine[p], -len(p)))
            del mine[victim]

    def match(self, path: tuple[int, ...]) -> dict[str, int]:
        out = {}
        for replica, mine in self.held.items():
            k = 0
            while k < len(path) and path[: k + 1] in mine:
                k += 1
            if k:
                out[replica] = k
        return out


token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=8)
ops = st.lists(st.tuples(st.sampled_from(["r0", "r1", "r2"]), token_lists), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, capacity=st.integers(1, 12), probe=token_lists)
def test_index_matches_the_brute_force_model(
    ops: list[tuple[str, list[int]]], capacity: int, probe: list[int]
) -> None:
    index = PrefixIndex(IndexSettings(default_capacity_blocks=capacity))
    model = Model(capacity)
    for replica, tokens in ops:
        index.insert("m", path_of(tokens), replica)
        model.insert(path_of(tokens), replica)
        for r in ("r0", "r1", "r2"):
            # Capacity is never exceeded, and the index agrees with the model block for block.
            assert index.holds(r) == len(model.held.get(r, {})) <= capacity
    for replica, tokens in ops:
        assert index.match("m", path_of(tokens)) == model.match(path_of(tokens)), replica
    assert index.match("m", path_of(probe)) == model.match(path_of(probe))


@settings(max_examples=100, deadline=None)
@given(ops=ops, probe=token_lists)
def test_a_match_never_exceeds_what_was_inserted(
    ops: list[tuple[str, list[int]]], probe: list[int]
) -> None:
    index = PrefixIndex()
    longest: dict[str, int] = {}
    probe_path = path_of(probe)
    for replica, tokens in ops:
        path = path_of(tokens)
        index.insert("m", path, replica)
        common = next(
            (i for i, (a, b) in enumerate(zip(path, probe_path, strict=False)) if a != b), None
        )
        shared = common if common is not None else min(len(path), len(probe_path))
        longest[replica] = max(longest.get(replica, 0), shared)
    for replica, matched in index.match("m", probe_path).items():
        assert 0 < matched <= longest[replica] <= len(probe_path)


def test_eviction_is_lru_by_leaves() -> None:
    index = PrefixIndex(IndexSettings(default_capacity_blocks=6))
    a, b, c = path_of([1, 1, 1]), path_of([2, 2, 2]), path_of([3, 3, 3])
    index.insert("m", a, "r")
    index.insert("m", b, "r")
    index.refresh("m", a, "r")  # a is now newer than b
    index.insert("m", c, "r")  # over capacity by 3: b goes, deepest block first
    assert index.match("m", a) == {"r": 3}
    assert index.match("m", b) == {}
    assert index.match("m", c) == {"r": 3}
    # One over: this insert re-stamps a's chain (shared prefix), so c's leaf is now the oldest.
    index.insert("m", path_of([1, 1, 1, 5]), "r")
    assert index.match("m", c) == {"r": 2}
    assert index.stats().evictions == {"r": 4}
    assert index.evictions_of("r") == 4  # the O(1) accessor agrees
    assert index.evictions_of("unknown") == 0


def test_one_walk_reports_every_replica() -> None:
    index = PrefixIndex()
    index.insert("m", path_of([1, 2, 3, 4]), "a")
    index.insert("m", path_of([1, 2]), "b")
    index.insert("m", path_of([1, 2, 3, 9]), "c")
    index.insert("other-model", path_of([1, 2, 3, 4]), "d")
    assert index.match("m", path_of([1, 2, 3, 4, 5])) == {"a": 4, "b": 2, "c": 3}
    assert index.match("m", path_of([7])) == {}
    assert index.match("nope", path_of([1])) == {}
    assert index.match("m", ()) == {}


def test_capacity_changes_and_defaults() -> None:
    index = PrefixIndex(IndexSettings(default_capacity_blocks=100))
    index.insert("m", path_of(list(range(50))), "r")
    assert index.capacity_of("r") == 100
    index.set_capacity("r", 10)  # shrinking evicts the deepest (least recently used) blocks
    assert index.match("m", path_of(list(range(50)))) == {"r": 10}
    index.set_capacity("r", None)
    assert index.capacity_of("r") == 100
    with pytest.raises(ValueError):
        index.set_capacity("r", -1)


def test_global_cap_bounds_the_whole_index() -> None:
    index = PrefixIndex(IndexSettings(default_capacity_blocks=1000, max_blocks=20))
    for i in range(10):
        index.insert("m", path_of([i] * 8), f"r{i % 3}")
        assert index.blocks <= 20
    # The newest prompts survive; the oldest went.
    assert index.match("m", path_of([9] * 8)) == {"r0": 8}
    assert index.match("m", path_of([0] * 8)) == {}
    assert index.stats().blocks == 20


def test_remove_replica_forgets_it_and_frees_nodes() -> None:
    index = PrefixIndex()
    index.insert("m", path_of([1, 2, 3]), "a")
    index.insert("m", path_of([1, 2]), "b")
    index.remove_replica("a")
    assert index.match("m", path_of([1, 2, 3])) == {"b": 2}
    assert index.blocks == 2
    index.remove_replica("b")
    assert index.blocks == 0
    assert index.stats().blocks_by_model == {}
    # Slots are reused; a re-added replica starts empty.
    index.insert("m", path_of([4]), "a")
    assert index.match("m", path_of([4])) == {"a": 1}
    assert index.replicas == ("a",)


def test_remove_blocks_drops_the_subtree() -> None:
    index = PrefixIndex()
    index.insert("m", path_of([1, 2, 3, 4]), "a")
    index.insert("m", path_of([1, 2, 5]), "a")
    index.insert("m", path_of([1, 2, 3, 4]), "b")
    removed = index.remove_blocks("m", path_of([1, 2]), "a")
    assert removed == 4  # blocks 2, 3, 4 and 5 under it
    assert index.match("m", path_of([1, 2, 3, 4])) == {"a": 1, "b": 4}
    assert index.holds("a") == 1
    # The LRU record of a was cut to what is left, so eviction still works.
    index.set_capacity("a", 0)
    assert index.holds("a") == 0
    assert index.match("m", path_of([1, 2, 3, 4])) == {"b": 4}


def test_clear_replica_keeps_its_capacity() -> None:
    index = PrefixIndex()
    index.set_capacity("a", 7)
    index.insert("m", path_of([1, 2, 3]), "a")
    index.clear_replica("a")
    assert index.holds("a") == 0
    assert index.capacity_of("a") == 7
    assert index.blocks == 0


def test_stats_report_sizes() -> None:
    index = PrefixIndex()
    index.insert("m", path_of([1, 2, 3]), "a")
    index.insert("n", path_of([1]), "b")
    stats = index.stats()
    assert stats.blocks_by_model == {"m": 3, "n": 1}
    assert stats.blocks == 4
    assert stats.approx_bytes > 0
    assert stats.held_blocks == {"a": 3, "b": 1}
