"""vLLM KV event batches decode the same from both encodings (the sim publishes vLLM's format)."""

from __future__ import annotations

import msgpack
import pytest

from replicas.sim import kv_events as sim
from replicas.sim.kv_publisher import encode_batch
from router.prefix.kv_decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDecodeError,
    decode_batch,
    decode_seq,
)

SIM_EVENTS = [
    sim.BlockStored([11, 12], None, list(range(32)), 16, medium="GPU"),
    sim.BlockStored([13], 12, list(range(32, 48)), 16, lora_name="adapter"),
    sim.BlockRemoved([11], medium="GPU"),
    sim.AllBlocksCleared(),
]
EXPECTED = (
    BlockStored((11, 12), None, tuple(range(32)), 16, None, "GPU"),
    BlockStored((13,), 12, tuple(range(32, 48)), 16, "adapter", "GPU"),
    BlockRemoved((11,), "GPU"),
    AllBlocksCleared(),
)


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_both_encodings_decode_alike(encoding: str) -> None:
    batch = decode_batch(encode_batch(12.5, SIM_EVENTS, encoding, 3))  # type: ignore[arg-type]
    assert batch.events == EXPECTED
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == 3


def test_unknown_event_types_are_skipped() -> None:
    payload = msgpack.packb(
        {"ts": 1.0, "events": [{"type": "BlockPinned", "x": 1}, {"type": "AllBlocksCleared"}]}
    )
    assert decode_batch(payload).events == (AllBlocksCleared(),)


def test_bytes_hashes_are_accepted() -> None:
    payload = msgpack.packb([0.0, [["BlockRemoved", [b"\x01" * 32], None]]], use_bin_type=True)
    assert decode_batch(payload).events == (BlockRemoved((b"\x01" * 32,), None),)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",
        msgpack.packb(42),
        msgpack.packb({"events": 3}),
        msgpack.packb({"events": [7]}),
        msgpack.packb({"events": [{"type": "BlockStored", "block_hashes": [1]}]}),
        msgpack.packb({"events": [{"type": "BlockRemoved", "block_hashes": 5}]}),
    ],
)
def test_malformed_payloads_raise_one_error(payload: bytes) -> None:
    with pytest.raises(KvDecodeError):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_seq((7).to_bytes(8, "big")) == 7
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(KvDecodeError):
        decode_seq(b"\x00")
