"""Wire encoding of change batches and snapshots: round trips and rejection of garbage."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.state import (
    ChangeKind,
    IndexChange,
    IndexSnapshot,
    RegistryChange,
    RegistryKind,
    SnapshotBuilder,
)
from router.state.codec import CodecError, decode_batch, encode_batch

u64 = st.integers(min_value=0, max_value=2**64 - 1)
index_changes = st.builds(
    IndexChange,
    kind=st.sampled_from(list(ChangeKind)),
    model=st.text(max_size=20),
    block_hashes=st.lists(u64, max_size=40).map(tuple),
    replica_id=st.text(min_size=1, max_size=20),
)
registry_changes = st.builds(
    RegistryChange,
    kind=st.sampled_from(list(RegistryKind)),
    replica_id=st.text(min_size=1, max_size=20),
    url=st.text(max_size=30),
    models=st.lists(st.text(max_size=10), max_size=3).map(tuple),
)


@given(st.lists(st.one_of(index_changes, registry_changes), max_size=20))
def test_batch_round_trip_stamps_origin(changes: list[IndexChange | RegistryChange]) -> None:
    decoded = decode_batch(encode_batch(changes), "inst-a")
    assert len(decoded) == len(changes)
    for before, after in zip(changes, decoded, strict=True):
        assert after.origin == "inst-a"
        assert type(after) is type(before)
        if isinstance(before, IndexChange):
            assert isinstance(after, IndexChange)
            assert (after.kind, after.model, after.block_hashes, after.replica_id) == (
                before.kind,
                before.model,
                before.block_hashes,
                before.replica_id,
            )
        else:
            assert isinstance(after, RegistryChange)
            assert (after.kind, after.replica_id, after.url, after.models) == (
                before.kind,
                before.replica_id,
                before.url,
                before.models,
            )


def test_block_hashes_cost_eight_bytes_each() -> None:
    change = IndexChange(ChangeKind.INSERT, "m", tuple(range(2**63, 2**63 + 1000)), "r1")
    assert len(encode_batch([change])) < 1000 * 8 + 64


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([[99, "m", b"", "r"]]),  # unknown kind
        msgpack.packb([[1, "m", b"\x00\x01\x02", "r"]]),  # hashes not a multiple of 8 bytes
        msgpack.packb([[1]]),  # truncated record
        msgpack.packb({"not": "a list"}),
    ],
)
def test_garbage_batches_raise_codec_error(payload: bytes) -> None:
    with pytest.raises(CodecError):
        decode_batch(payload, "x")


def test_snapshot_stores_shared_prefixes_once_and_replays_in_order() -> None:
    builder = SnapshotBuilder()
    system = (1, 2, 3)
    builder.add("m", "r1", (*system, 10))
    builder.add("m", "r2", (*system, 20))
    builder.add("m", "r1", (*system, 11))
    builder.add("other", "r1", (7,))
    snap = IndexSnapshot.decode(builder.build("5-1", "inst").encode())
    assert snap.stream_id == "5-1"
    assert snap.origin == "inst"
    assert snap.blocks == 3 + 3 + 1  # the shared system prompt once
    replayed = [(c.model, c.replica_id, c.block_hashes) for c in snap.changes()]
    assert replayed == [
        ("m", "r1", (1, 2, 3, 10)),
        ("m", "r1", (1, 2, 3, 11)),
        ("m", "r2", (1, 2, 3, 20)),
        ("other", "r1", (7,)),
    ]
    assert all(c.kind is ChangeKind.INSERT for c in snap.changes())


@given(st.lists(st.tuples(st.sampled_from(["r1", "r2"]), st.lists(u64, min_size=1, max_size=6))))
def test_snapshot_round_trip_keeps_every_holding(holdings: list[tuple[str, list[int]]]) -> None:
    builder = SnapshotBuilder()
    for replica, path in holdings:
        builder.add("m", replica, path)
    snap = IndexSnapshot.decode(builder.build("0-0", "i").encode())
    got = [(c.replica_id, list(c.block_hashes)) for c in snap.changes()]
    for replica in ("r1", "r2"):
        assert [p for r, p in got if r == replica] == [p for r, p in holdings if r == replica]


@pytest.mark.parametrize(
    "payload",
    [b"", msgpack.packb({"v": 99}), msgpack.packb({"v": 1, "id": "0-0"}), b"\x93\x01"],
)
def test_garbage_snapshots_raise_codec_error(payload: bytes) -> None:
    with pytest.raises(CodecError):
        IndexSnapshot.decode(payload)
