"""The official `openai` client, sync and async, streaming and not, against a real sim replica."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.replicas.conftest import StartReplica

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def _sync_calls(base_url: str, model: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    try:
        completion = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=5, extra_body={"ignore_eos": True}
        )
        chat = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True}
        )
        stream = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        models = client.models.list()
        return {"completion": completion, "chat": chat, "chunks": chunks, "models": models}
    finally:
        client.close()


async def test_sync_client(sim_replica: StartReplica) -> None:
    replica = await sim_replica()
    model = replica.settings.model
    # the sync client blocks: run it in a thread while the replica serves on this loop
    got = await asyncio.to_thread(_sync_calls, f"{replica.url}/v1", model)

    completion = got["completion"]
    assert isinstance(completion, openai.types.Completion)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0

    chat = got["chat"]
    assert isinstance(chat, openai.types.chat.ChatCompletion)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 4

    chunks = got["chunks"]
    assert isinstance(chunks, list)
    assert chunks[0].choices[0].delta.role == "assistant"
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text_chunks) == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    models = got["models"]
    assert [m.id for m in models.data] == [model]


async def test_async_client(sim_replica: StartReplica) -> None:
    replica = await sim_replica()
    model = replica.settings.model
    client = openai.AsyncOpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.completions.create(
            model=model,
            prompt="Stream me",
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces = []
        usage = None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(pieces) == 7 and all(pieces)
        assert usage is not None and usage.completion_tokens == 7

        # the same request without streaming yields the same text (same seed, same prompt)
        whole = await client.completions.create(
            model=model, prompt="Stream me", max_tokens=7, extra_body={"ignore_eos": True}
        )
        assert whole.choices[0].text == "".join(pieces)
        assert whole.usage is not None and whole.usage.prompt_tokens_details is not None

        chat = await client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=3, stop=["zzzz"], seed=1
        )
        assert chat.choices[0].finish_reason in ("stop", "length")

        emb = await client.embeddings.create(model=model, input=["alpha", "beta"])
        assert len(emb.data) == 2 and len(emb.data[0].embedding) == 1024

        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="messages"):
            await client.chat.completions.create(model=model, messages=[], max_tokens=1)
    finally:
        await client.close()
