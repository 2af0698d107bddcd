"""The official openai SDK, sync and async, streaming and not, through the router."""

from __future__ import annotations

import asyncio

import openai

from tests.router.conftest import StartGateway, StartSim, fast_config

MODEL = "sdk-model"


async def test_async_sdk(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sims = [await start_sim(model=MODEL, seed=i) for i in range(2)]
    gw = await start_gateway(fast_config([s.url for s in sims]))
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-test",
                                  max_retries=0) as client:  # fmt: skip
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None and chat.usage.completion_tokens >= 1

        done = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=4)
        assert done.choices[0].text

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(pieces)
        assert usage is not None and usage.completion_tokens == 8

        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt="x", max_tokens=1
        )
        assert raw.headers["x-fleet-replica"] in {s.url for s in sims}

        try:
            await client.completions.create(model="missing", prompt="x")
        except openai.NotFoundError as exc:
            assert exc.status_code == 404
        else:
            raise AssertionError("unknown model must be a 404")


async def test_sync_sdk(start_sim: StartSim, start_gateway: StartGateway) -> None:
    sim = await start_sim(model=MODEL)
    gw = await start_gateway(fast_config([sim.url]))

    def use_sync_client() -> tuple[str, str, int]:
        with openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0) as client:
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            streamed = "".join(
                chunk.choices[0].text
                for chunk in client.completions.create(
                    model=MODEL,
                    prompt="abc",
                    max_tokens=6,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                if chunk.choices
            )
            try:
                client.chat.completions.create(model=MODEL, messages=[])
            except openai.BadRequestError as exc:
                status = exc.status_code
            return chat.choices[0].message.content or "", streamed, status

    # The sync client blocks: run it off the event loop that serves the gateway.
    content, streamed, status = await asyncio.to_thread(use_sync_client)
    assert content and streamed and status == 400
