"""The request-path buffers: bounded, counted drops, evictions become counters and records."""

from __future__ import annotations

from router.state import ChangeKind, IndexChange
from router.state.pending import PendingUpdates


def _pending(
    max_changes: int = 3, max_hot: int = 2, max_evictions: int = 2
) -> tuple[PendingUpdates, list[int]]:
    wakes: list[int] = []
    p = PendingUpdates(
        max_changes=max_changes,
        max_hot_prefixes=max_hot,
        max_evictions=max_evictions,
        on_ready=lambda: wakes.append(1),
    )
    return p, wakes


def _insert(i: int) -> IndexChange:
    return IndexChange(ChangeKind.INSERT, "m", (i,), "r1")


def test_queue_is_bounded_and_drops_are_counted() -> None:
    p, wakes = _pending()
    for i in range(5):
        p.add_change(_insert(i), "me")
    assert len(p) == 3
    assert p.dropped == 2
    assert len(wakes) == 3  # the flusher is woken only for accepted changes
    batch = p.drain(2)
    assert [c.block_hashes for c in batch.changes] == [(0,), (1,)]
    assert len(p) == 1


def test_evict_counts_blocks_and_keeps_a_record() -> None:
    p, _ = _pending()
    p.add_change(IndexChange(ChangeKind.EVICT, "m", (1, 2, 3), "r1"), "me")
    batch = p.drain(10)
    assert batch.counters[("r1", "evicted_blocks")] == 3
    assert [(e.replica_id, e.model, e.blocks, e.origin) for e in batch.evictions] == [
        ("r1", "m", 3, "me")
    ]
    assert not p.has_work()


def test_counters_accumulate_and_hot_set_is_bounded() -> None:
    p, _ = _pending(max_hot=2)
    p.add_counter("r1", "requests", 1)
    p.add_counter("r1", "requests", 2)
    p.add_counter("r1", "prompt_tokens", 0)  # zero increments are not written
    for pid in ("a", "b", "a", "c"):
        p.add_hot("m", pid)
    batch = p.drain(10)
    assert dict(batch.counters) == {("r1", "requests"): 3}
    assert dict(batch.hot) == {("m", "a"): 2, ("m", "b"): 1}
    assert p.dropped == 1
    assert p.drain(10).is_empty()
