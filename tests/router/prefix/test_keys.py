"""Routing keys and chained block hashes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.prefix.keys import (
    chain_seed,
    hash_text_blocks,
    hash_token_blocks,
    render_chat,
    routing_key,
    routing_key_hashes,
)


def test_only_full_blocks_are_hashed() -> None:
    hashes, units = routing_key_hashes("completions", {"prompt": "a" * 130}, "m", 64)
    assert units == 130
    assert len(hashes) == 2
    assert routing_key_hashes("completions", {"prompt": "a" * 63}, "m", 64) == ((), 63)


def test_chain_names_the_whole_prefix() -> None:
    a = routing_key_hashes("completions", {"prompt": "x" * 64 + "y" * 64}, "m")[0]
    b = routing_key_hashes("completions", {"prompt": "z" * 64 + "y" * 64}, "m")[0]
    # Same second block, different first block: the second hashes differ too.
    assert a[1] != b[1]
    assert len({a[0], a[1], b[0], b[1]}) == 4


def test_model_and_salt_seed_the_chain() -> None:
    body = {"prompt": "q" * 128}
    plain = routing_key_hashes("completions", body, "m")[0]
    assert routing_key_hashes("completions", body, "other")[0] != plain
    salted = routing_key_hashes("completions", {**body, "cache_salt": "s"}, "m")[0]
    assert salted != plain
    assert chain_seed("m") != chain_seed("m", "s")


@given(st.text(min_size=0, max_size=600), st.text(min_size=0, max_size=300))
def test_a_prefix_keeps_its_hashes(prefix: str, suffix: str) -> None:
    seed = chain_seed("m")
    whole = hash_text_blocks(prefix + suffix, seed, 16)
    head = hash_text_blocks(prefix, seed, 16)
    assert whole[: len(head)] == head


def test_non_ascii_text_is_cut_in_characters() -> None:
    text = "é" * 64 + "ü" * 64
    assert len(hash_text_blocks(text, 1, 64)) == 2
    assert hash_text_blocks(text, 1, 64)[0] != hash_text_blocks("e" * 64, 1, 64)[0]


def test_chat_turns_extend_the_key() -> None:
    turn1 = [{"role": "system", "content": "S" * 200}, {"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    k1 = routing_key("chat", {"messages": turn1})
    k2 = routing_key("chat", {"messages": turn2})
    assert isinstance(k1, str) and isinstance(k2, str)
    assert k2.startswith(k1)
    h1 = routing_key_hashes("chat", {"messages": turn1}, "m", 16)[0]
    h2 = routing_key_hashes("chat", {"messages": turn2}, "m", 16)[0]
    assert h2[: len(h1)] == h1


def test_chat_roles_parts_and_tools_matter() -> None:
    user = render_chat([{"role": "user", "content": "abc"}])
    system = render_chat([{"role": "system", "content": "abc"}])
    assert user != system
    parts = render_chat([{"role": "user", "content": [{"type": "text", "text": "abc"}]}])
    assert parts == user
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert render_chat([{"role": "user", "content": "abc"}], tools) != user


def test_token_prompts_are_used_as_is() -> None:
    tokens = list(range(100))
    hashes, units = routing_key_hashes("completions", {"prompt": tokens}, "m", 16)
    assert units == 100
    assert list(hashes) == hash_token_blocks(tokens, chain_seed("m"), 16)
    # A batch of token prompts is keyed by the first one.
    assert routing_key_hashes("completions", {"prompt": [tokens, [1, 2]]}, "m", 16)[0] == hashes


class _CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_token_mode_tokenizes_text_keys() -> None:
    body = {"prompt": "abcd" * 10}
    hashes, units = routing_key_hashes("completions", body, "m", 8, tokenizer=_CharTokenizer())
    assert units == 40
    assert list(hashes) == hash_token_blocks([ord(c) for c in "abcd" * 10], chain_seed("m"), 8)


def test_odd_bodies_do_not_crash() -> None:
    for body in (
        {},
        {"prompt": None},
        {"prompt": []},
        {"prompt": [None, 3]},
        {"prompt": 42},
        {"messages": "nope"},
        {"messages": [1, None, {"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": 3}], "cache_salt": 7},
    ):
        for endpoint in ("chat", "completions"):
            hashes, units = routing_key_hashes(endpoint, body, "m")
            assert units >= 0
            assert isinstance(hashes, tuple)
