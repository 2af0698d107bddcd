"""KV-cache events over ZMQ PUB, in vLLM's exact wire format (vllm/distributed/kv_events.py).

Each published message is multipart ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian
counter starting at 0, ``payload`` a msgpack ``EventBatch`` of the events of one engine step. Two
encodings, as vLLM's msgspec structs produce them:

- ``"array"`` (vLLM before 2026, ``array_like=True``): the batch is ``[ts, events, dp_rank]`` and
  each event a positional array whose first element is its type name, e.g.
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.
- ``"map"`` (current vLLM): the batch is ``{"ts", "events", "data_parallel_rank"}`` and each
  event a map whose first key is ``"type"``.

The endpoint follows vLLM's rule: bind when it contains ``*`` / ``::`` or is ipc:// / inproc://,
otherwise connect. A PUB socket never blocks (messages beyond the high-water mark are dropped), so
publishing from the event loop is safe. With a replay endpoint, a ROUTER socket answers
``[identity, b"", start_seq]`` with every buffered ``(seq, payload)`` from ``start_seq`` on, then
``(-1, b"")``, like vLLM's publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal

from replicas.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "END_SEQ",
    "KVEventPublisher",
    "encode_batch",
    "encode_event",
    "should_bind",
]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
Encoding = Literal["array", "map"]


def encode_event(event: KVEvent, encoding: Encoding) -> list[Any] | dict[str, Any]:
    """One event as msgspec would serialise vLLM's tagged struct (before msgpack)."""
    if isinstance(event, BlockStored):
        fields: list[tuple[str, Any]] = [
            ("block_hashes", list(event.block_hashes)),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", event.lora_id),
            ("medium", event.medium),
            ("lora_name", event.lora_name),
        ]
        tag = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = [("block_hashes", list(event.block_hashes)), ("medium", event.medium)]
        tag = "BlockRemoved"
    elif isinstance(event, AllBlocksCleared):
        fields = []
        tag = "AllBlocksCleared"
    else:  # pragma: no cover - the union is closed
        raise TypeError(f"not a KV event: {event!r}")
    if encoding == "array":
        return [tag, *(value for _, value in fields)]
    return {"type": tag, **dict(fields)}


def encode_batch(
    ts: float, events: Iterable[KVEvent], encoding: Encoding, data_parallel_rank: int = 0
) -> bytes:
    """The msgpack payload of one `EventBatch`."""
    import msgpack  # optional extra: kv-events

    encoded = [encode_event(e, encoding) for e in events]
    batch: list[Any] | dict[str, Any]
    if encoding == "array":
        batch = [ts, encoded, data_parallel_rank]
    else:
        batch = {"ts": ts, "events": encoded, "data_parallel_rank": data_parallel_rank}
    return bytes(msgpack.packb(batch, use_bin_type=True))


def should_bind(endpoint: str) -> bool:
    """vLLM's heuristic: wildcard or local transports bind, anything else connects."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class KVEventPublisher:
    """Collects the engine's events (it is the engine's `kv_event_sink`) and publishes one batch
    per `flush()` (the runtime calls it after every step)."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "kv-events",
        encoding: Encoding = "map",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.encoding: Encoding = encoding
        self._topic = topic.encode("utf-8")
        self._hwm = hwm
        self._rank = data_parallel_rank
        self._pending: list[KVEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._replay_task: asyncio.Task[None] | None = None
        self.num_dropped_batches = 0

    def __call__(self, event: KVEvent) -> None:
        """The engine's sink: queue one event for the next batch."""
        self._pending.append(event)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def open(self) -> None:
        """Create the sockets (and the replay server task, if configured)."""
        import zmq
        import zmq.asyncio

        # PUB is a plain socket: a non-blocking send from the event loop needs no future.
        # The replay ROUTER is an asyncio socket on a shadow of the same context.
        self._ctx = zmq.Context()
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if should_bind(self.endpoint):
            pub.bind(self.endpoint)
        else:
            pub.connect(self.endpoint)
        self._pub = pub
        if self.replay_endpoint is not None:
            replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.replay_endpoint)
            self._replay = replay
            self._replay_task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name="sim-kv-replay"
            )

    async def close(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def flush(self) -> None:
        """Publish the pending events as one batch (nothing when there are none)."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        payload = encode_batch(time.time(), events, self.encoding, self._rank)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if self._pub is None:
            return
        import zmq

        try:
            # PUB never waits for peers: beyond the high-water mark it drops, it does not block
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped_batches += 1

    async def _serve_replay(self) -> None:
        replay = self._replay
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV replay request with %d frames", len(frames))
                continue
            client_id, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
            await replay.send_multipart((client_id, b"", END_SEQ, b""))
