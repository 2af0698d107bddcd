"""A replica with a real tokenizer.json: prompts, generated text, /tokenize, prefix caching.

The tokenizer is trained here, in a temporary directory (tests.replicas.sim.bpe): a byte-level BPE
like Llama-3's, with Llama-3's chat special tokens and ``<|begin_of_text|>`` added to every
encoding (nothing is downloaded).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
import tokenizers

from replicas.sim import api
from replicas.sim.api import ChatMessage, GenerationParams
from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.engine import Engine, EngineRequest
from replicas.sim.kv_events import BlockStored
from replicas.sim.server import plan_output
from replicas.sim.tokenizer import HFTokenizer, output_token
from tests.replicas.conftest import StartReplica
from tests.replicas.sim.bpe import train_bpe

SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A router sends each request to the replica that already holds its prefix in cache.",
    "Continuous batching lets new sequences join the batch at every decode step.",
    "Chunked prefill slices long prompts into pieces that ride along with decodes.",
    "Hello world, hello router, hello replica. Café naïve déjà vu 東京 🙂",
]
DOC = " ".join(CORPUS)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(path, CORPUS * 5, vocab_size=600, bos=SPECIAL[0], special=SPECIAL)


@pytest.fixture(scope="module")
def hf(tokenizer_path: str) -> Any:
    return tokenizers.Tokenizer.from_file(tokenizer_path)


async def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        result: dict[str, Any] = await r.json()
        return result


async def _stream_text(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    events = [e.removeprefix(b"data: ") for e in raw.strip().split(b"\n\n")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def test_output_ids_are_ordinary_tokens_of_the_vocabulary(tokenizer_path: str, hf: Any) -> None:
    tok = HFTokenizer(tokenizer_path)
    special = set(hf.get_added_tokens_decoder())
    assert tok.output_ids and len(set(tok.output_ids)) == len(tok.output_ids)
    for i in tok.output_ids:
        assert 0 <= i < hf.get_vocab_size() and i not in special
        text = hf.decode([i])
        assert text.strip() and "\ufffd" not in text
        assert hf.encode(text, add_special_tokens=False).ids == [i]
    # space-led words come first: generated text reads as words
    assert hf.decode([tok.output_ids[0]]).startswith(" ")


def test_engine_generates_from_the_output_vocabulary(tokenizer_path: str) -> None:
    tok = HFTokenizer(tokenizer_path)
    config = EngineConfig(num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    events: list[Any] = []
    engine = Engine(config, CostModel(PROFILES[DEFAULT_PROFILE]), events.append, tok.output_ids)
    prompt = tok.encode(DOC, True)
    engine.add_request(EngineRequest("r", tuple(prompt), 100, seed=3))
    generated: list[int] = []
    while engine.has_unfinished():
        for out in engine.step().outputs:
            generated.extend(out.new_token_ids)
    n = len(tok.output_ids)
    assert generated == [tok.output_ids[output_token(3, k) % n] for k in range(100)]
    # the full blocks offered to the prefix cache (KV events) hold the same ids, decode too
    stored = [t for e in events if isinstance(e, BlockStored) for t in e.token_ids]
    assert len(stored) > len(prompt) + 64
    assert stored == (prompt + generated)[: len(stored)]


async def test_prompts_tokenize_with_the_real_tokenizer(
    sim_replica: StartReplica, tokenizer_path: str, hf: Any
) -> None:
    replica = await sim_replica(tokenizer_path=tokenizer_path)
    url = replica.url
    # completions: the tokenizer's BOS is added (vLLM's add_special_tokens=True default)
    body = {"prompt": DOC, "max_tokens": 3, "ignore_eos": True}
    usage = (await _post(f"{url}/v1/completions", body))["usage"]
    assert (
        usage["prompt_tokens"]
        == len(hf.encode(DOC).ids)
        == len(hf.encode(DOC, add_special_tokens=False).ids) + 1
    )
    usage = (await _post(f"{url}/v1/completions", {**body, "add_special_tokens": False}))["usage"]
    assert usage["prompt_tokens"] == len(hf.encode(DOC, add_special_tokens=False).ids)
    # chat: the template carries <|begin_of_text|>; special tokens are single ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": DOC}]
    chat = {"messages": messages, "max_tokens": 3, "ignore_eos": True}
    usage = (await _post(f"{url}/v1/chat/completions", chat))["usage"]
    rendered = api.render_chat([ChatMessage(m["role"], m["content"]) for m in messages])
    ids = hf.encode(rendered, add_special_tokens=False).ids
    assert usage["prompt_tokens"] == len(ids)
    assert ids[0] == hf.token_to_id("<|begin_of_text|>")
    assert ids.count(hf.token_to_id("<|eot_id|>")) == 2
    # token-id prompts must be inside the vocabulary
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/completions", json={"prompt": [1, hf.get_vocab_size()]}) as r,
    ):
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "prompt"


async def test_generated_text_decodes_the_same_streamed_or_not(
    sim_replica: StartReplica, tokenizer_path: str, hf: Any
) -> None:
    replica = await sim_replica(tokenizer_path=tokenizer_path)
    url = f"{replica.url}/v1/completions"
    body = {"prompt": DOC, "max_tokens": 40, "ignore_eos": True, "seed": 11}
    whole = (await _post(url, body))["choices"][0]["text"]
    streamed, usage = await _stream_text(url, body)
    assert usage["completion_tokens"] == 40
    # exactly the decoding of the generated ids (index -> output_ids, as documented)
    tok = replica.state.tokenizer
    plan = plan_output(
        params=GenerationParams(max_tokens=40, ignore_eos=True, seed=11),
        prompt_token_ids=tuple(tok.encode(DOC, True)),
        max_model_len=replica.state.max_model_len,
        settings_seed=replica.settings.seed,
        dist=replica.state.length_dist,
    )
    n = len(tok.output_ids)
    ids = [tok.output_ids[output_token(plan.token_seed, k) % n] for k in range(40)]
    assert whole == streamed == hf.decode(ids)
    assert whole.strip() and "\ufffd" not in whole and whole.isprintable()


async def test_tokenize_and_detokenize_agree_with_the_tokenizer(
    sim_replica: StartReplica, tokenizer_path: str, hf: Any
) -> None:
    replica = await sim_replica(tokenizer_path=tokenizer_path)
    url = replica.url
    text = "Hello router, déjà vu 🙂"
    got = await _post(f"{url}/tokenize", {"prompt": text, "return_token_strs": True})
    enc = hf.encode(text)
    assert got["tokens"] == enc.ids and got["count"] == len(enc.ids)
    assert got["token_strs"] == enc.tokens  # raw vocabulary strings, as vLLM returns them
    plain = await _post(f"{url}/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain["tokens"] == hf.encode(text, add_special_tokens=False).ids
    messages = [{"role": "user", "content": text}]
    chat = await _post(f"{url}/tokenize", {"messages": messages})
    rendered = api.render_chat([ChatMessage("user", text)])
    assert chat["tokens"] == hf.encode(rendered, add_special_tokens=False).ids
    # /detokenize keeps special tokens (vLLM decodes with the HF default)
    back = await _post(f"{url}/detokenize", {"tokens": enc.ids})
    assert back["prompt"] == hf.decode(enc.ids, skip_special_tokens=False)
    assert back["prompt"] == "<|begin_of_text|>" + text
    back = await _post(f"{url}/detokenize", {"tokens": chat["tokens"]})
    assert back["prompt"] == rendered


async def test_prefix_caching_reports_block_aligned_cached_tokens(
    sim_replica: StartReplica, tokenizer_path: str, hf: Any
) -> None:
    replica = await sim_replica(tokenizer_path=tokenizer_path)
    url = f"{replica.url}/v1/completions"
    shared = DOC * 6
    first, second = shared + " The lazy dog.", shared + " Hello world!"
    a, b = hf.encode(first).ids, hf.encode(second).ids
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common > 64  # the shared text is a shared token prefix of several blocks
    body = {"max_tokens": 2, "ignore_eos": True}
    u1 = (await _post(url, {**body, "prompt": first}))["usage"]
    u2 = (await _post(url, {**body, "prompt": second}))["usage"]
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u2["prompt_tokens"] == len(b)
    assert u2["prompt_tokens_details"]["cached_tokens"] == common // 16 * 16
