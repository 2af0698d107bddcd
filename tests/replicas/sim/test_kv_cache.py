"""The block pool: three-state accounting, LRU eviction of cached blocks, events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.sim.kv_cache import BlockPool, hash_block, root_hash
from replicas.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def _tokens(first: int, last: int) -> list[int]:
    """Token ids of blocks first..last-1 for a block size of 2 (each block's index twice)."""
    return [i for b in range(first, last) for i in (b, b)]


def _tokens1(first: int, last: int) -> list[int]:
    """The same for a block size of 1."""
    return list(range(first, last))


def test_allocate_free_and_counts() -> None:
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3
    assert (pool.num_used, pool.num_free, pool.num_cached_free) == (3, 1, 0)
    assert pool.allocate(2) is None  # all-or-nothing
    assert pool.num_used == 3
    pool.free(a)
    assert (pool.num_used, pool.num_free, pool.num_cached_free) == (0, 4, 0)
    pool.check()


def test_hashed_blocks_stay_cached_and_are_evicted_least_recently_freed_first() -> None:
    events: list[KVEvent] = []
    pool = BlockPool(4, 2, sink=events.append)
    first = pool.allocate(2)
    second = pool.allocate(2)
    assert first is not None and second is not None
    pool.store(first, [11, 12], 0, 2, _tokens)
    pool.store(second, [21, 22], 0, 2, _tokens)
    assert events == [
        BlockStored([11, 12], None, [0, 0, 1, 1], 2),
        BlockStored([21, 22], None, [0, 0, 1, 1], 2),
    ]
    pool.free(first)  # tail block 12 first, then 11
    pool.free(second)
    assert (pool.num_used, pool.num_free, pool.num_cached_free) == (0, 0, 4)
    assert pool.match_prefix([11, 12, 99], 3) == first
    # Reusing a cached block takes it out of the free list without an event.
    pool.take(pool.match_prefix([21], 1))
    assert (pool.num_used, pool.num_cached_free) == (1, 3)
    # Allocation evicts in the order the blocks were freed: 12, then 11.
    events.clear()
    pool.allocate(2)
    assert events == [BlockRemoved([12, 11])]
    assert pool.match_prefix([11], 1) == []
    pool.check()


def test_plain_free_blocks_go_before_cached_ones() -> None:
    pool = BlockPool(3, 1)
    a = pool.allocate(1)
    assert a is not None
    pool.store(a, [7], 0, 1, _tokens1)
    pool.free(a)
    pool.allocate(2)
    assert pool.match_prefix([7], 1) == a  # still cached: two plain blocks were free


def test_a_hash_maps_to_one_block() -> None:
    events: list[KVEvent] = []
    pool = BlockPool(4, 1, sink=events.append)
    a, b = pool.allocate(2), pool.allocate(2)
    assert a is not None and b is not None
    pool.store(a, [1, 2], 0, 2, _tokens1)
    pool.store(b, [1, 3], 0, 2, _tokens1)  # block 0 duplicates hash 1: stays plain
    assert events[-1] == BlockStored([3], 1, [1], 1)
    pool.free(b)
    assert pool.num_cached_free == 1 and pool.num_free == 1
    pool.check()


def test_clear_cache_emits_all_blocks_cleared() -> None:
    events: list[KVEvent] = []
    pool = BlockPool(2, 1, sink=events.append)
    a = pool.allocate(2)
    assert a is not None
    pool.store(a, [5, 6], 0, 2, _tokens1)
    pool.free(a[1:])
    pool.clear_cache()
    assert events[-1] == AllBlocksCleared()
    assert pool.cached_hashes() == set()
    assert (pool.num_used, pool.num_free, pool.num_cached_free) == (1, 1, 0)
    pool.check()


def test_chain_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    root = root_hash(0)
    h = hash_block(root, [1, 2, 3], b"", 0)
    assert h == hash_block(root, [1, 2, 3], b"", 0)
    assert 0 <= h < 2**64
    assert h != hash_block(root, [1, 2, 4], b"", 0)
    assert h != hash_block(root, [1, 2, 3], b"salt", 0)
    assert h != hash_block(root_hash(1), [1, 2, 3], b"", 0)
    assert h != hash_block(h, [1, 2, 3], b"", 0)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "store", "hit"]), st.integers(0, 5)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12))
def test_random_operations_keep_the_accounting_exact(
    ops: list[tuple[str, int]], num_blocks: int
) -> None:
    events: list[KVEvent] = []
    pool = BlockPool(num_blocks, 1, sink=events.append)
    owners: list[list[int]] = []
    next_hash = 1
    for op, arg in ops:
        if op == "alloc":
            got = pool.allocate(arg)
            if got is not None:
                owners.append(got)
        elif op == "free" and owners:
            pool.free(owners.pop(arg % len(owners)))
        elif op == "store" and owners:
            blocks = owners[arg % len(owners)]
            pool.store(
                blocks, list(range(next_hash, next_hash + len(blocks))), 0, len(blocks), _tokens1
            )
            next_hash += len(blocks)
        elif op == "hit":
            hashes = sorted(pool.cached_hashes())[arg : arg + 2]
            found = pool.match_prefix(hashes, len(hashes))
            pool.take(found)
            owners.append(found)
        pool.check()
        assert pool.num_used <= num_blocks
    # Replaying the events reproduces the set of cached hashes.
    cached: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            assert not cached & set(event.block_hashes)
            cached |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= cached
            cached -= set(event.block_hashes)
        else:
            cached.clear()
    assert cached == pool.cached_hashes()
