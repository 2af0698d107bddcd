"""Exact mode's indexer on plain event batches: engine hashes → own hashes → the index."""

from __future__ import annotations

from router.prefix.exact import ExactIndexer
from router.prefix.index import PrefixIndex
from router.prefix.keys import chain_seed, hash_token_blocks
from router.prefix.kv_decode import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4 tokens


def own_path(tokens: list[int], model: str = "m") -> tuple[int, ...]:
    return tuple(hash_token_blocks(tokens, chain_seed(model), BS))


def batch(*events: object) -> KvEventBatch:
    return KvEventBatch(0.0, tuple(events))  # type: ignore[arg-type]


def stored(engine: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(tuple(engine), parent, tuple(tokens), BS)


def make() -> tuple[PrefixIndex, ExactIndexer]:
    index = PrefixIndex()
    indexer = ExactIndexer(index)
    indexer.add_replica("r", "m")
    return index, indexer


def test_stored_blocks_chained_across_events_match_the_routing_key() -> None:
    index, indexer = make()
    # Engine hashes are arbitrary (its own seed); the parent link is by engine hash.
    counts = indexer.apply("r", batch(stored([901, 902], None, TOKENS[:8])))
    indexer.apply("r", batch(stored([903, 904, 905], 902, TOKENS[8:20])))
    assert counts == {"BlockStored": 1}
    assert index.match("m", own_path(TOKENS)) == {"r": 5}
    # A different prompt sharing two blocks.
    assert index.match("m", own_path(TOKENS[:8] + [1] * 8)) == {"r": 2}


def test_removed_blocks_go_with_what_hangs_below_them() -> None:
    index, indexer = make()
    indexer.apply("r", batch(stored([1, 2, 3, 4], None, TOKENS[:16])))
    indexer.apply("r", batch(BlockRemoved((4,))))
    assert index.match("m", own_path(TOKENS)) == {"r": 3}
    indexer.apply("r", batch(BlockRemoved((2,))))  # block 3 is unreachable without 2
    assert index.match("m", own_path(TOKENS)) == {"r": 1}
    indexer.apply("r", batch(BlockRemoved((99,))))  # unknown hashes are ignored
    assert index.match("m", own_path(TOKENS)) == {"r": 1}


def test_all_blocks_cleared_and_unknown_parents() -> None:
    index, indexer = make()
    indexer.apply("r", batch(stored([1, 2], None, TOKENS[:8])))
    indexer.apply("r", batch(AllBlocksCleared()))
    assert index.match("m", own_path(TOKENS)) == {}
    # A parent never announced (a missed event): counted, not guessed.
    indexer.apply("r", batch(stored([5], 77, TOKENS[8:12])))
    assert indexer.unresolved["r"] == 1
    assert index.blocks == 0


def test_replicas_are_tracked_apart_and_offloaded_copies_ignored() -> None:
    index, indexer = make()
    indexer.add_replica("s", "m")
    indexer.apply("r", batch(stored([1, 2], None, TOKENS[:8])))
    indexer.apply("s", batch(stored([1, 2, 3], None, TOKENS[:12])))  # same engine hashes
    indexer.apply("s", batch(BlockStored((7,), 3, tuple(TOKENS[12:16]), BS, None, "CPU")))
    assert index.match("m", own_path(TOKENS)) == {"r": 2, "s": 3}
    indexer.remove_replica("s")
    assert index.match("m", own_path(TOKENS)) == {"r": 2}
    assert indexer.apply("s", batch(AllBlocksCleared())) == {}  # no longer tracked


def test_lora_blocks_live_under_the_adapter_name() -> None:
    index, indexer = make()
    indexer.apply("r", batch(BlockStored((1,), None, tuple(TOKENS[:4]), BS, "ad", "GPU")))
    assert index.match("ad", own_path(TOKENS, "ad")) == {"r": 1}
    assert index.match("m", own_path(TOKENS)) == {}
