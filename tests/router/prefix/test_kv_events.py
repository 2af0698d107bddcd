"""Exact mode end to end against real publishers: the sim replica (vLLM's wire format) and, for
gaps and replay, a raw ZMQ PUB + ROUTER speaking vLLM's protocol."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from replicas.sim import SimSettings, running_replica
from replicas.sim.tokenizer import SimTokenizer
from router.prefix.exact import ExactIndexer
from router.prefix.index import PrefixIndex
from router.prefix.keys import routing_key_hashes
from router.prefix.kv_events import KvEventConsumer, KvEventSource
from tests.router.state.support import eventually

MODEL = "sim-model"
BLOCK = 16


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_index_mirrors_the_sim_replica(tmp_path: Path, encoding: str) -> None:
    settings = SimSettings(
        port=0,
        model=MODEL,
        time_scale=0.01,
        num_gpu_blocks=64,  # 1,024 tokens: the third prompt evicts part of the first
        kv_events_endpoint=f"ipc://{tmp_path}/kv",
        kv_events_replay_endpoint=f"ipc://{tmp_path}/replay",
        kv_events_encoding=encoding,  # type: ignore[arg-type]
    )
    tokenizer = SimTokenizer()
    gaps: list[int] = []
    events: dict[str, int] = {}
    index = PrefixIndex()
    prompts = [f"prompt {i} " + "lorem ipsum dolor sit amet " * 60 for i in range(3)]
    keys = [
        routing_key_hashes("completions", {"prompt": p}, MODEL, BLOCK, tokenizer=tokenizer)[0]
        for p in prompts
    ]
    async with (
        running_replica(settings) as replica,
        KvEventConsumer(
            ExactIndexer(index),
            on_events=lambda r, k, n: events.__setitem__(k, events.get(k, 0) + n),
            on_gap=lambda r, n: gaps.append(n),
        ) as consumer,
        aiohttp.ClientSession() as http,
    ):
        consumer.add(
            KvEventSource(
                "r0",
                f"ipc://{tmp_path}/kv",
                MODEL,
                replay_endpoint=f"ipc://{tmp_path}/replay",
            )
        )
        for i, prompt in enumerate(prompts[:2]):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
            key = keys[i]
            await eventually(lambda key=key: index.match(MODEL, key).get("r0") == len(key))
        assert index.match(MODEL, keys[0]) == {"r0": len(keys[0])}
        # The third prompt does not fit beside the others: the engine evicts, the index follows.
        body = {"model": MODEL, "prompt": prompts[2], "max_tokens": 4, "ignore_eos": True}
        async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        await eventually(lambda: index.match(MODEL, keys[2]).get("r0") == len(keys[2]))
        await eventually(lambda: events.get("BlockRemoved", 0) > 0)
        assert index.match(MODEL, keys[0]).get("r0", 0) < len(keys[0])
        # Block for block, the index holds what the engine holds.
        engine = replica.engine
        await eventually(lambda: index.holds("r0") == len(engine.cached_block_hashes()))
        assert index.holds("r0") <= 64
        # AllBlocksCleared (published with the next engine step's batch), then a new prompt.
        engine.clear_prefix_cache()
        body = {"model": MODEL, "prompt": prompts[1], "max_tokens": 4, "ignore_eos": True}
        async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
            await resp.read()
        await eventually(lambda: events.get("AllBlocksCleared") == 1)
        await eventually(lambda: index.holds("r0") == len(engine.cached_block_hashes()))
        assert index.match(MODEL, keys[1]) == {"r0": len(keys[1])}
        assert index.match(MODEL, keys[2]) == {}
    assert events["BlockStored"] >= 3
    assert events["AllBlocksCleared"] == 1
    assert gaps == []


class _FakeVllmPublisher:
    """vLLM's publisher side, by hand: PUB for live batches, ROUTER serving replays."""

    def __init__(self, ctx: zmq.asyncio.Context, base: Path) -> None:
        self.endpoint = f"ipc://{base}/pub"
        self.replay_endpoint = f"ipc://{base}/replay"
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(self.endpoint)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(self.replay_endpoint)
        self.sent: dict[int, bytes] = {}
        self.replay_requests: list[int] = []

    @staticmethod
    def payload(engine_hash: int, parent: int | None, tokens: list[int]) -> bytes:
        event = {
            "type": "BlockStored",
            "block_hashes": [engine_hash],
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": len(tokens),
        }
        return bytes(msgpack.packb({"ts": 0.0, "events": [event]}))

    async def publish(self, seq: int, payload: bytes, *, drop: bool = False) -> None:
        self.sent[seq] = payload
        if not drop:
            await self.pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))

    async def serve_replays(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq in sorted(s for s in self.sent if s >= first):
                await self.router.send_multipart(
                    (ident, b"", seq.to_bytes(8, "big"), self.sent[seq])
                )
            await self.router.send_multipart(
                (ident, b"", (-1).to_bytes(8, "big", signed=True), b"")
            )

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.mark.parametrize("replay", [True, False])
async def test_gaps_are_counted_and_replayed(tmp_path: Path, replay: bool) -> None:
    ctx = zmq.asyncio.Context()
    fake = _FakeVllmPublisher(ctx, tmp_path)
    server = asyncio.get_running_loop().create_task(fake.serve_replays())
    index = PrefixIndex()
    gaps: list[int] = []
    tokens = [list(range(i * 4, i * 4 + 4)) for i in range(6)]
    full_key = routing_key_hashes("completions", {"prompt": list(range(24))}, "m", 4)[0]
    try:
        async with KvEventConsumer(ExactIndexer(index), on_gap=lambda r, n: gaps.append(n)) as c:
            c.add(
                KvEventSource(
                    "r",
                    fake.endpoint,
                    "m",
                    replay_endpoint=fake.replay_endpoint if replay else None,
                )
            )
            # Keep publishing batch 0 until the subscription is up (ZMQ's slow joiner).
            await fake.publish(0, fake.payload(100, None, tokens[0]))
            while not await c.wait_for_seq("r", 0, timeout_s=0.05):
                await fake.publish(0, fake.payload(100, None, tokens[0]))
            await fake.publish(1, fake.payload(101, 100, tokens[1]))
            await fake.publish(2, fake.payload(102, 101, tokens[2]), drop=True)  # lost
            await fake.publish(3, fake.payload(103, 102, tokens[3]), drop=True)  # lost
            await fake.publish(4, fake.payload(104, 103, tokens[4]))
            assert await c.wait_for_seq("r", 4, timeout_s=5.0)
            stats = c.stats["r"]
            assert gaps == [2]
            assert (stats.gaps, stats.missed_batches) == (1, 2)
            if replay:
                assert stats.replayed_batches == 2
                assert 2 in fake.replay_requests
                assert index.match("m", full_key) == {"r": 5}
            else:
                # Without replay, block 104's parent was never announced: counted, not guessed.
                assert index.match("m", full_key) == {"r": 2}
                assert c.indexer.unresolved["r"] == 1
            # The engine restarts: sequence numbers start again, its old cache is gone.
            await fake.publish(0, fake.payload(200, None, tokens[0]))
            await eventually(lambda: c.stats["r"].restarts == 1)
            await eventually(lambda: index.match("m", full_key) == {"r": 1})
    finally:
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server
        fake.close()
        ctx.term()


async def test_a_late_subscriber_catches_up_from_a_quiet_replica(tmp_path: Path) -> None:
    # Everything is published before the consumer exists and nothing after: only a catch-up
    # from the replay endpoint on joining can tell the index what the replica holds.
    settings = SimSettings(
        port=0,
        model=MODEL,
        time_scale=0.01,
        num_gpu_blocks=256,
        kv_events_endpoint=f"ipc://{tmp_path}/kv",
        kv_events_replay_endpoint=f"ipc://{tmp_path}/replay",
    )
    prompt = "a quiet replica " + "lorem ipsum dolor sit amet " * 40
    key = routing_key_hashes(
        "completions", {"prompt": prompt}, MODEL, BLOCK, tokenizer=SimTokenizer()
    )[0]
    index = PrefixIndex()
    async with running_replica(settings) as replica, aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        async with http.post(f"{replica.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        async with KvEventConsumer(ExactIndexer(index)) as consumer:
            consumer.add(
                KvEventSource(
                    "r0", f"ipc://{tmp_path}/kv", MODEL, replay_endpoint=f"ipc://{tmp_path}/replay"
                )
            )
            await eventually(lambda: index.match(MODEL, key).get("r0") == len(key))
            stats = consumer.stats["r0"]
            assert stats.caught_up_batches >= 1
            assert (stats.gaps, stats.replayed_batches) == (0, 0)
