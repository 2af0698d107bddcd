"""KV events over a real ZMQ SUB: vLLM's multipart frames, both encodings, consistent contents."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from replicas.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from replicas.sim.kv_publisher import END_SEQ, encode_batch, encode_event, should_bind
from tests.conftest import free_port
from tests.replicas.conftest import StartReplica


def test_event_encodings_match_vllm_structs() -> None:
    stored = BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=[1] * 32,
                         block_size=16)  # fmt: skip
    assert encode_event(stored, "array") == [
        "BlockStored", [11, 12], None, [1] * 32, 16, None, "GPU", None,
    ]  # fmt: skip
    assert encode_event(stored, "map") == {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": [1] * 32,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert next(iter(encode_event(stored, "map"))) == "type"  # msgspec writes the tag first
    assert encode_event(BlockRemoved(block_hashes=[11]), "array") == ["BlockRemoved", [11], "GPU"]
    assert encode_event(BlockRemoved(block_hashes=[11]), "map") == {
        "type": "BlockRemoved", "block_hashes": [11], "medium": "GPU",
    }  # fmt: skip
    assert encode_event(AllBlocksCleared(), "array") == ["AllBlocksCleared"]
    assert encode_event(AllBlocksCleared(), "map") == {"type": "AllBlocksCleared"}
    assert msgpack.unpackb(encode_batch(1.5, [AllBlocksCleared()], "array")) == [
        1.5, [["AllBlocksCleared"]], 0,
    ]  # fmt: skip
    assert msgpack.unpackb(encode_batch(1.5, [], "map")) == {
        "ts": 1.5, "events": [], "data_parallel_rank": 0,
    }  # fmt: skip
    # hashes are unsigned 64-bit integers: msgpack must carry the full range
    big = BlockRemoved(block_hashes=[2**64 - 1])
    assert msgpack.unpackb(encode_batch(0.0, [big], "array"))[1][0][1] == [2**64 - 1]


def test_bind_or_connect_like_vllm() -> None:
    assert should_bind("tcp://*:5557")
    assert should_bind("ipc:///tmp/kv")
    assert not should_bind("tcp://127.0.0.1:5557")


def _normalise(event: Any) -> tuple[str, dict[str, Any]]:
    """Either encoding → (type, fields)."""
    if isinstance(event, dict):
        fields = dict(event)
        return fields.pop("type"), fields
    tag, *values = event
    names = {
        "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size",
                        "lora_id", "medium", "lora_name"],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    }[tag]  # fmt: skip
    assert len(values) == len(names), event
    return tag, dict(zip(names, values, strict=True))


async def _drain(sub: zmq.asyncio.Socket, quiet_s: float) -> list[list[bytes]]:
    messages = []
    while True:
        try:
            messages.append(await asyncio.wait_for(sub.recv_multipart(), quiet_s))
        except TimeoutError:
            return messages


async def _receive_through(
    sub: zmq.asyncio.Socket, last_seq: int, timeout_s: float = 30.0
) -> list[list[bytes]]:
    """Messages up to and including sequence number ``last_seq`` (a bounded wait)."""
    messages: list[list[bytes]] = []
    async with asyncio.timeout(timeout_s):
        while not messages or int.from_bytes(messages[-1][1], "big") < last_seq:
            messages.append(await sub.recv_multipart())
    return messages


async def _replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Fetch buffered batches from `start` on, as vLLM's replay clients do (a DEALER socket)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[list[bytes]] = []
        async with asyncio.timeout(5):
            while True:
                _, seq, payload = await dealer.recv_multipart()
                if seq == END_SEQ:
                    assert payload == b""
                    return out
                out.append([b"kv-events", seq, payload])
    finally:
        dealer.close(linger=0)


async def _post_prompt(url: str, prompt: list[int], max_tokens: int = 20) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_sub_receives_consistent_events(sim_replica: StartReplica, encoding: str) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    port, replay_port = free_port(), free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")  # the replica connects (vLLM's rule for a host address)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    try:
        # 40 blocks: distinct 200-token prompts (13 blocks each) force evictions
        replica = await sim_replica(
            num_gpu_blocks=40,
            kv_events_endpoint=f"tcp://127.0.0.1:{port}",
            kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            kv_events_encoding=encoding,
        )
        # PUB drops what it publishes before the subscription has travelled (ZMQ's slow
        # joiner): warm up until one batch arrives, then fetch the missed ones by replay.
        live: list[list[bytes]] = []
        for i in range(100):
            await _post_prompt(replica.url, [50_000 + i * 16 + j for j in range(16)], 1)
            live = await _drain(sub, quiet_s=0.05)
            if live:
                break
        assert live, "the SUB never received a batch"
        first_live = int.from_bytes(live[0][1], "big")
        for i in range(5):
            await _post_prompt(replica.url, [(i * 1000 + j) + 1000 for j in range(200)])
        # Every batch is published before its response ends: receive through the last one
        # (a quiet period would cut a slow delivery short on a busy machine).
        publisher = replica.state.publisher
        assert publisher is not None
        live += await _receive_through(sub, publisher.next_seq - 1)
        missed = await _replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)
    finally:
        sub.close(linger=0)
        ctx.term()

    assert [int.from_bytes(m[1], "big") for m in missed][:first_live] == list(range(first_live))
    messages = missed[:first_live] + live
    cached: set[int] = set()
    kinds = set()
    for expected_seq, (topic, seq, payload) in enumerate(messages):
        assert topic == b"kv-events"
        assert len(seq) == 8 and int.from_bytes(seq, "big") == expected_seq
        batch = msgpack.unpackb(payload)
        if encoding == "array":
            assert isinstance(batch, list) and len(batch) == 3
            ts, events, rank = batch
        else:
            assert set(batch) == {"ts", "events", "data_parallel_rank"}
            ts, events, rank = batch["ts"], batch["events"], batch["data_parallel_rank"]
        assert isinstance(ts, float) and rank == 0 and events
        for raw in events:
            assert isinstance(raw, dict if encoding == "map" else list)
            kind, fields = _normalise(raw)
            kinds.add(kind)
            if kind == "BlockStored":
                hashes = fields["block_hashes"]
                assert fields["block_size"] == 16 and fields["medium"] == "GPU"
                assert len(fields["token_ids"]) == 16 * len(hashes)
                parent = fields["parent_block_hash"]
                assert parent is None or parent in cached  # a child's parent is still cached
                assert not cached & set(hashes)
                cached |= set(hashes)
            elif kind == "BlockRemoved":
                assert set(fields["block_hashes"]) <= cached
                cached -= set(fields["block_hashes"])
    assert kinds == {"BlockStored", "BlockRemoved"}
    assert len(cached) <= 40
    assert cached == replica.engine.cached_block_hashes()  # the events replay the cache exactly
    # the replay buffer holds exactly what was published
    assert [m[2] for m in missed] == [m[2] for m in messages[: len(missed)]]


async def test_replay_endpoint_serves_missed_batches(sim_replica: StartReplica) -> None:
    pub_port, replay_port = free_port(), free_port()
    replica = await sim_replica(
        kv_events_endpoint=f"tcp://127.0.0.1:{pub_port}",  # nobody listens: all batches "missed"
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        kv_events_encoding="array",
    )
    for i in range(3):
        await _post_prompt(replica.url, list(range(i * 100, i * 100 + 64)), 2)
    publisher = replica.state.publisher
    assert publisher is not None and publisher.next_seq >= 3
    ctx = zmq.asyncio.Context()
    try:
        replies = await _replay(ctx, f"tcp://127.0.0.1:{replay_port}", 1)  # from seq 1 on
        past_end = await _replay(ctx, f"tcp://127.0.0.1:{replay_port}", publisher.next_seq)
    finally:
        ctx.term()
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in replies]
    assert seqs == list(range(1, publisher.next_seq))
    assert all(msgpack.unpackb(payload)[1] for _, _, payload in replies)  # [ts, events, rank]
    assert past_end == []  # only the end marker
