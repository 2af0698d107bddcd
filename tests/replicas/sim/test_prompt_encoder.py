"""Long prompts are tokenized in the replica's tokenizer thread, with the same ids."""

from __future__ import annotations

import threading
from pathlib import Path

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.sim.prompt_encoder import INLINE_MAX_CHARS, PromptEncoder
from replicas.sim.tokenizer import HFTokenizer, SimTokenizer
from tests.replicas.conftest import StartReplica
from tests.replicas.sim.bpe import train_bpe

LONG = ("Routers gather shared prefixes where they are cached. déjà vu 🙂 " * 2500)[:131_072]


@settings(max_examples=30, deadline=None)
@given(st.text(min_size=0, max_size=20_000))
def test_sim_encode_long_equals_encode(text: str) -> None:
    tok = SimTokenizer()
    assert tok.encode_long(text) == tok.encode(text)


def test_hf_encode_long_equals_encode(tmp_path: Path) -> None:
    path = train_bpe(tmp_path / "tokenizer.json", [LONG[:5000]], vocab_size=400, bos="<s>")
    tok = HFTokenizer(path)
    for special in (False, True):
        assert tok.encode_long(LONG, special) == tok.encode(LONG, special)


class _ThreadRecordingTokenizer(SimTokenizer):
    """The simulator's tokenizer, noting which thread did the work."""

    __slots__ = ("threads",)

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[tuple[str, int]] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(("encode", threading.get_ident()))
        return super().encode(text, add_special_tokens)

    def encode_long(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(("encode_long", threading.get_ident()))
        return super().encode_long(text, add_special_tokens)


async def test_short_inline_long_in_the_worker_thread() -> None:
    tok = _ThreadRecordingTokenizer()
    encoder = PromptEncoder(tok)
    loop_thread = threading.get_ident()
    short = LONG[:INLINE_MAX_CHARS]
    assert await encoder.encode(LONG) == SimTokenizer().encode(LONG)  # not open yet: inline
    assert tok.threads[0] == ("encode", loop_thread)
    encoder.open()
    try:
        tok.threads.clear()
        assert await encoder.encode(short) == SimTokenizer().encode(short)
        assert tok.threads == [("encode", loop_thread)]
        tok.threads.clear()
        assert await encoder.encode(LONG) == SimTokenizer().encode(LONG)
        assert tok.threads[0][0] == "encode_long" and tok.threads[0][1] != loop_thread
        assert all(ident != loop_thread for _, ident in tok.threads)  # its slices too
    finally:
        await encoder.close()
    await encoder.close()  # idempotent
    tok.threads.clear()
    await encoder.encode(LONG)
    assert tok.threads[0] == ("encode", loop_thread)  # closed: inline again


async def test_long_prompts_over_http(sim_replica: StartReplica) -> None:
    replica = await sim_replica(num_gpu_blocks=8192)
    expected = len(SimTokenizer().encode(LONG))
    async with aiohttp.ClientSession() as s:
        body = {"prompt": LONG, "max_tokens": 1, "ignore_eos": True}
        async with s.post(f"{replica.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["prompt_tokens"] == expected == 32768
        async with s.post(f"{replica.url}/tokenize", json={"prompt": LONG}) as r:
            assert (await r.json())["count"] == expected
        chat = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1}
        async with s.post(f"{replica.url}/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["prompt_tokens"] > expected
    encoder = replica.state.encoder
    await replica.stop()
    assert encoder._pool is None  # the cleanup context stopped the worker thread
