"""The tokenizer stand-in: deterministic, prefix-stable, ~4 characters per token."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from replicas.sim.tokenizer import (
    NUM_OUTPUT_TOKENS,
    SimTokenizer,
    Tokenizer,
    load_tokenizer,
    output_token,
    output_tokens,
)


@given(st.text(max_size=200), st.text(max_size=200), st.text(max_size=200))
def test_shared_text_prefix_gives_shared_token_prefix(prefix: str, a: str, b: str) -> None:
    tok = SimTokenizer()
    ta, tb = tok.encode(prefix + a), tok.encode(prefix + b)
    shared = len(prefix) // 4
    assert ta[:shared] == tb[:shared]


def test_about_four_characters_per_token_and_deterministic() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 50
    ids = SimTokenizer().encode(text)
    assert len(ids) == -(-len(text) // 4)
    assert ids == SimTokenizer().encode(text)  # a fresh instance, same ids
    assert all(0 <= i < SimTokenizer().vocab_size for i in ids)
    # Different text, different ids (almost surely).
    assert SimTokenizer().encode("abcdefgh") != SimTokenizer().encode("abcdefgX")


@given(st.integers(0, 2**64 - 1), st.integers(0, 10_000), st.integers(1, 64))
def test_output_tokens_are_reproducible_and_round_trip(seed: int, start: int, count: int) -> None:
    ids = output_tokens(seed, start, count)
    assert ids == [output_token(seed, start + i) for i in range(count)]
    assert all(0 <= i < NUM_OUTPUT_TOKENS for i in ids)
    tok = SimTokenizer()
    text = tok.decode(ids)
    assert len(text) == 4 * count
    assert tok.encode(text) == ids


def test_different_seeds_give_different_outputs() -> None:
    assert output_tokens(1, 0, 32) != output_tokens(2, 0, 32)


def test_load_tokenizer_default_and_local_file(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), SimTokenizer)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = load_tokenizer(str(path))
    assert isinstance(tok, Tokenizer)
    assert tok.encode("hello world hello") == [1, 2, 1]
    assert tok.vocab_size == 3
    assert "hello" in tok.decode([1, 2])
    # The tokenizers package raises a bare Exception; the message says what is wrong.
    with pytest.raises(Exception, match="No such file"):
        load_tokenizer(str(tmp_path / "missing.json"))
