"""Routing keys and chained block hashes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.errors import BadRequest
from router.policies.base import RoutingRequest
from router.policies.kv_aware import matched_tokens
from router.prefix.keys import (
    chain_seed,
    hash_text_blocks,
    hash_token_blocks,
    prompt_key,
    render_chat,
    routing_key,
    routing_key_hashes,
)
from router.prefix.units import KeyUnits


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
            # Every odd body keys to less than one block (at most a short rendered header).
            assert hashes == () and 0 <= units < 64
            key = prompt_key(endpoint, body, "m", KeyUnits())
            assert key.block_hashes == () and key.prompt_units == units
            assert key.prompt_tokens == KeyUnits().units_to_tokens(units)


def test_prompt_key_of_text_matches_routing_key_hashes() -> None:
    units = KeyUnits()  # 64 characters per block, 4 characters per token
    body = {"prompt": "The quick brown fox. " * 20}  # 420 characters
    key = prompt_key("completions", body, "m", units)
    assert (key.block_hashes, key.prompt_units) == routing_key_hashes("completions", body, "m")
    assert key.prompt_tokens == 105
    body = {"prompt": "abcd" * 10}
    tokenized = prompt_key(
        "completions", body, "m", KeyUnits.token_mode(8), tokenizer=_CharTokenizer()
    )
    expected = routing_key_hashes("completions", body, "m", 8, tokenizer=_CharTokenizer())
    assert (tokenized.block_hashes, tokenized.prompt_units) == expected
    assert tokenized.prompt_tokens == 40


def test_token_id_prompts_in_character_mode_count_true_tokens() -> None:
    """Not len / chars_per_token (a 4x undercount), and blocks of as many tokens as a block of
    characters stands for, so KV capacity converts alike for both kinds of prompt."""
    units = KeyUnits(block_units=64, units_per_token=4.0)
    assert units.tokens_per_block == 16
    tokens = list(range(1000, 2000))  # 1,000 token ids
    key = prompt_key("completions", {"prompt": tokens}, "m", units)
    assert key.prompt_tokens == 1000
    assert len(key.block_hashes) == 1000 // 16
    assert list(key.block_hashes) == hash_token_blocks(tokens, chain_seed("m"), 16)
    # Matched blocks convert back to the tokens they hold; units stay in the block's unit.
    assert units.blocks_to_tokens(len(key.block_hashes)) == 16 * len(key.block_hashes)
    assert key.prompt_units == 4000
    request = RoutingRequest(
        model="m",
        block_hashes=key.block_hashes,
        prompt_units=key.prompt_units,
        prompt_tokens=key.prompt_tokens,
        block_units=units.block_units,
    )
    assert matched_tokens(request, 10) == 160
    assert matched_tokens(request, len(key.block_hashes)) == 992
    # A replica of 100 KV blocks of 16 tokens holds 100 index blocks of either kind of prompt.
    assert units.capacity_blocks(100, 16) == 100
    # Uneven ratios round to whole tokens per block.
    assert KeyUnits(block_units=64, units_per_token=3.5).tokens_per_block == 18
    assert KeyUnits(block_units=2, units_per_token=4.0).tokens_per_block == 1


def test_key_hash_tells_short_prompts_apart() -> None:
    units = KeyUnits()
    short = [prompt_key("completions", {"prompt": f"q{i}"}, "m", units) for i in range(10)]
    assert all(k.block_hashes == () for k in short)
    assert len({k.key_hash for k in short}) == 10
    again = prompt_key("completions", {"prompt": "q3"}, "m", units)
    assert again.key_hash == short[3].key_hash
    ids = [prompt_key("completions", {"prompt": [i, 7]}, "m", units).key_hash for i in range(5)]
    assert len(set(ids)) == 5
    # With full blocks and no tail, the key hash is the last block's (the chain's end).
    full = prompt_key("completions", {"prompt": "x" * 128}, "m", units)
    assert full.key_hash == full.block_hashes[-1]


def test_out_of_range_token_ids_are_a_bad_request() -> None:
    with pytest.raises(BadRequest) as info:
        prompt_key("completions", {"prompt": [2**64] * 40}, "m", KeyUnits())
    assert info.value.param == "prompt"
