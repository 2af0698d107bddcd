"""PrefixIndex.holdings(): replaying it into an empty index rebuilds the same index."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.prefix.index import Holding, IndexSettings, PrefixIndex
from router.prefix.keys import chain_seed, hash_token_blocks

SEEDS = {"m": chain_seed("m"), "n": chain_seed("n")}
REPLICAS = ("r0", "r1", "r2")


def path_of(model: str, tokens: list[int]) -> tuple[int, ...]:
    return tuple(hash_token_blocks(tokens, SEEDS[model], 1))


# (operation, model, replica, tokens): inserts mostly, some exact-mode removals
Op = tuple[str, str, str, list[int]]
op = st.tuples(
    st.sampled_from(["insert"] * 4 + ["remove"]),
    st.sampled_from(["m", "n"]),
    st.sampled_from(REPLICAS),
    st.lists(st.integers(0, 2), min_size=1, max_size=7),
)


def apply(index: PrefixIndex, ops: list[Op]) -> None:
    for kind, model, replica, tokens in ops:
        if kind == "insert":
            index.insert(model, path_of(model, tokens), replica)
        else:
            index.remove_blocks(model, path_of(model, tokens), replica)


def assert_same(a: PrefixIndex, b: PrefixIndex, probes: list[Op]) -> None:
    assert a.blocks == b.blocks
    assert a.stats().blocks_by_model == b.stats().blocks_by_model
    for replica in REPLICAS:
        assert a.holds(replica) == b.holds(replica), replica
    for _kind, model, _replica, tokens in probes:
        assert a.match(model, path_of(model, tokens)) == b.match(model, path_of(model, tokens))


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(op, max_size=40),
    after=st.lists(op, max_size=25),
    capacity=st.integers(1, 12),
    max_blocks=st.integers(4, 40),
)
def test_replaying_holdings_rebuilds_holdings_and_lru_order(
    before: list[Op], after: list[Op], capacity: int, max_blocks: int
) -> None:
    config = IndexSettings(default_capacity_blocks=capacity, max_blocks=max_blocks)
    original = PrefixIndex(config)
    apply(original, before)
    rebuilt = PrefixIndex(config)
    for model, replica, path in original.holdings():
        rebuilt.insert(model, path, replica)
    # Nothing the original holds overflows on replay: no evictions in the copy.
    assert all(rebuilt.evictions_of(r) == 0 for r in REPLICAS)
    assert_same(original, rebuilt, before + after)
    # Same LRU order: the same further traffic evicts the same blocks in both (per-replica
    # capacity and the global cap alike).
    apply(original, after)
    apply(rebuilt, after)
    assert_same(original, rebuilt, before + after)


def test_holdings_are_oldest_first_over_the_whole_index_and_cut_to_what_is_held() -> None:
    index = PrefixIndex(IndexSettings(default_capacity_blocks=5))
    a, b, c = path_of("m", [1, 1, 1]), path_of("m", [2, 2]), path_of("n", [1, 2, 3])
    index.insert("m", a, "r0")
    index.insert("n", c, "r1")
    index.insert("m", b, "r0")  # r0 over capacity by 0: nothing evicted yet
    index.insert("m", a[:2], "r1")
    index.refresh("m", b, "r0")
    assert list(index.holdings()) == [
        Holding("m", "r0", a),
        Holding("n", "r1", c),
        Holding("m", "r1", a[:2]),
        Holding("m", "r0", b),
    ]
    index.insert("m", path_of("m", [3]), "r0")  # one over: a's deepest block (LRU leaf) goes
    index.remove_blocks("n", c[:2], "r1")  # exact mode: c's last two blocks are gone
    assert list(index.holdings()) == [
        Holding("m", "r0", a[:2]),
        Holding("n", "r1", c[:1]),
        Holding("m", "r1", a[:2]),
        Holding("m", "r0", b),
        Holding("m", "r0", path_of("m", [3])),
    ]
    assert list(PrefixIndex().holdings()) == []


def test_holdings_tolerate_changes_between_items() -> None:
    """A consumer reading a slice per event-loop turn sees the index change under it."""
    index = PrefixIndex()
    p0, p1, p2 = path_of("m", [1, 2]), path_of("m", [3, 4]), path_of("m", [5])
    index.insert("m", p0, "r0")
    index.insert("m", p1, "r1")
    index.insert("m", p2, "r2")
    items = index.holdings()
    assert next(items) == Holding("m", "r0", p0)
    index.remove_replica("r1")  # gone before its path is read
    index.insert("m", path_of("m", [9]), "r3")  # takes r1's freed slot: must not be reported
    index.remove_blocks("m", p2, "r2")  # r2 holds nothing any more: skipped, not empty
    assert list(items) == []
