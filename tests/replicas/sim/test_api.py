"""Request parsing, stop strings, detokenizing and chunk formatting (no server)."""

from __future__ import annotations

import itertools
import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.sim import api
from replicas.sim.api import BadRequest, ChatMessage, StopChecker, StreamFormatter, Usage
from replicas.sim.lengths import OutputLengthDistribution
from replicas.sim.server import plan_output
from replicas.sim.tokenizer import SimTokenizer


def _apply_stop(text: str, stops: list[str], pieces: list[int]) -> tuple[str, str | None]:
    """Feed `text` cut at `pieces` through a StopChecker; return what the client saw."""
    checker = StopChecker(stops)
    seen = []
    cuts = sorted({min(p, len(text)) for p in pieces} | {0, len(text)})
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        released, hit = checker.push(text[a:b], 1, final=i == len(cuts) - 2)
        seen.append(released)
        if hit is not None:
            return "".join(seen), hit
    return "".join(seen), None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    pieces=st.lists(st.integers(0, 40), max_size=12),
)
def test_stop_strings_any_chunking(text: str, stops: list[str], pieces: list[int]) -> None:
    seen, hit = _apply_stop(text, stops, pieces)
    assert text.startswith(seen)
    assert not any(stop in seen for stop in stops)  # a stop string is never released
    if hit is None:
        assert seen == text  # no stop string anywhere: everything is released
        assert not any(stop in text for stop in stops)
    else:
        assert hit in stops and text[len(seen) :].startswith(hit)
    # fed one character at a time (the finest chunking), the first stop string to be
    # completed wins, and the client sees exactly the text before it
    seen1, hit1 = _apply_stop(text, stops, list(range(len(text) + 1)))
    ends = [text.find(s) + len(s) for s in stops if s in text]
    if ends:
        assert hit1 is not None and len(seen1) + len(hit1) == min(ends)
    else:
        assert (seen1, hit1) == (text, None)


def test_stop_strings_wait_for_min_tokens() -> None:
    # as vLLM: stop strings count once more than min_tokens tokens exist
    checker = StopChecker(["x"], min_tokens=2)
    assert checker.push("axb", 1, final=False) == ("axb", None)
    assert checker.push("cxd", 1, final=False) == ("cxd", None)
    assert checker.push("exf", 1, final=False) == ("e", "x")


def test_incremental_detokenizer_matches_full_decode() -> None:
    tok = SimTokenizer()
    ids = list(range(0, 700, 7))
    detok = api.IncrementalDetokenizer(tok.decode)
    out = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3))
    assert out == tok.decode(ids)


def test_render_chat_template() -> None:
    messages = (ChatMessage("system", "S"), ChatMessage("user", "U"))
    assert api.render_chat(messages) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not api.render_chat(messages, add_generation_prompt=False).endswith("\n\n")


def test_parse_chat_accepts_text_parts_and_max_completion_tokens() -> None:
    req = api.parse_chat(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 9,
            "stop": "END",
            "cache_salt": "tenant-1",
            "priority": -1,
        }
    )  # fmt: skip
    assert req.messages == (ChatMessage("user", "a\nb"),)
    assert req.params.max_tokens == 9 and req.params.stop == ("END",)
    assert req.params.cache_salt == "tenant-1" and req.params.priority == -1
    with pytest.raises(BadRequest, match="not supported"):
        api.parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})


def test_parse_completion_prompt_forms() -> None:
    assert api.parse_completion({"prompt": "hi"}).prompt == "hi"
    assert api.parse_completion({"prompt": ["hi"]}).prompt == "hi"
    assert api.parse_completion({"prompt": [1, 2]}).prompt == (1, 2)
    assert api.parse_completion({"prompt": [[1, 2]]}).prompt == (1, 2)
    assert api.parse_completion({"prompt": "x", "max_tokens": 3.0}).params.max_tokens == 3
    with pytest.raises(BadRequest, match="Batched"):
        api.parse_completion({"prompt": ["a", "b"]})
    with pytest.raises(BadRequest) as info:
        api.parse_completion({"prompt": "x", "max_tokens": 2.5})
    assert info.value.param == "max_tokens"


def test_error_body_shape() -> None:
    body = json.loads(api.error_body(BadRequest("nope", param="x")))
    assert body == {"error": {"message": "nope", "type": "BadRequestError", "param": "x",
                              "code": 400}}  # fmt: skip


def test_fast_delta_chunk_equals_generic_encoding() -> None:
    for kind in ("chat", "completion"):
        fmt = StreamFormatter(kind, "id-1", 'model "q"', 123)
        fast = fmt.delta_chunk('te"xt\n\u00e9')
        slow = fmt.delta_chunk('te"xt\n\u00e9', Usage(1, 1, 0))
        fast_obj = orjson.loads(fast[len(b"data: ") : -2])
        slow_obj = orjson.loads(slow[len(b"data: ") : -2])
        del slow_obj["usage"]
        assert fast_obj == slow_obj
        assert fast.startswith(b"data: {") and fast.endswith(b"}\n\n")


def test_plan_output() -> None:
    dist = OutputLengthDistribution(kind="fixed", mean=10)
    prompt = tuple(range(100))

    def plan(**kw: object) -> tuple[int, str, int, int]:
        params = api.GenerationParams(**{"max_tokens": None, **kw})  # type: ignore[arg-type]
        p = plan_output(params=params, prompt_token_ids=prompt, max_model_len=1000,
                        settings_seed=0, dist=dist)  # fmt: skip
        return p.output_tokens, p.finish_reason, p.token_seed, p.max_tokens

    assert plan(max_tokens=50)[:2] == (10, "stop")
    assert plan(max_tokens=5)[:2] == (5, "length")
    assert plan(max_tokens=50, ignore_eos=True)[:2] == (50, "length")
    assert plan(ignore_eos=True)[:2] == (900, "length")  # default: the rest of the context
    assert plan()[3] == 900 and plan(max_tokens=50)[3] == 50
    assert plan(max_tokens=50, min_tokens=20)[:2] == (20, "stop")
    assert plan(max_tokens=50, seed=1)[2] != plan(max_tokens=50, seed=2)[2]
    assert plan(max_tokens=50, seed=1)[2] == plan(max_tokens=50, seed=1)[2]
    with pytest.raises(BadRequest, match="maximum context length"):
        plan(max_tokens=901)
