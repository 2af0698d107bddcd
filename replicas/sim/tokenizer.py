"""Tokenizers: a deterministic stand-in (`SimTokenizer`) or a real local ``tokenizer.json``.

`SimTokenizer` cuts text into 4-character pieces, so two texts sharing a prefix of ``L``
characters share their first ``L // 4`` tokens, and roughly 4 characters make a token like
real BPE vocabularies on English. Pieces from a fixed table of pronounceable 4-character
syllables (``" bal"``, ``" kor"``...) get ids ``0 .. NUM_OUTPUT_TOKENS-1`` and decode back exactly;
any other piece gets a stable hashed id above the table. Generated text is drawn from the table
(`output_token`), so it is readable-ish and round-trips through encode/decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import xxhash

__all__ = [
    "NUM_OUTPUT_TOKENS",
    "HFTokenizer",
    "SimTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "output_token",
    "output_tokens",
]

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"
_ENDINGS = "bdklmnrst"
# " " + consonant + vowel + ending: 18 * 5 * 9 = 810 four-character syllables.
_TABLE: tuple[str, ...] = tuple(
    " " + c + v + e for c in _CONSONANTS for v in _VOWELS for e in _ENDINGS
)
NUM_OUTPUT_TOKENS = len(_TABLE)
_PIECE_TO_ID = {piece: i for i, piece in enumerate(_TABLE)}
_DEFAULT_VOCAB = 128_256  # Llama-3's vocabulary size
_MASK64 = (1 << 64) - 1


@runtime_checkable
class Tokenizer(Protocol):
    """What the simulator needs from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class SimTokenizer:
    """Deterministic, prefix-stable, ~4 characters per token; no files needed."""

    __slots__ = ("_hashed", "vocab_size")

    def __init__(self, vocab_size: int = _DEFAULT_VOCAB) -> None:
        if vocab_size <= NUM_OUTPUT_TOKENS:
            raise ValueError(f"vocab_size must be > {NUM_OUTPUT_TOKENS}, got {vocab_size}")
        self.vocab_size = vocab_size
        self._hashed = vocab_size - NUM_OUTPUT_TOKENS

    def encode(self, text: str) -> list[int]:
        """4-character pieces: table ids when the piece is a syllable, hashed ids otherwise."""
        lookup = _PIECE_TO_ID.get
        hashed = self._hashed
        h = xxhash.xxh3_64_intdigest
        out = []
        for i in range(0, len(text), 4):
            piece = text[i : i + 4]
            tid = lookup(piece)
            if tid is None:
                tid = NUM_OUTPUT_TOKENS + h(piece.encode("utf-8", "surrogatepass")) % hashed
            out.append(tid)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Table ids decode exactly; hashed ids (one-way) decode to a placeholder syllable."""
        table = _TABLE
        n = NUM_OUTPUT_TOKENS
        return "".join(table[i % n] for i in ids)


class HFTokenizer:
    """A real tokenizer loaded from a local ``tokenizer.json`` (the `tokenizers` package)."""

    __slots__ = ("_tok", "vocab_size")

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HF  # optional dependency, imported on use

        self._tok: Any = _HF.from_file(path)
        self.vocab_size = int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


def load_tokenizer(path: str | None) -> Tokenizer:
    """`SimTokenizer` for ``None``; otherwise a local ``tokenizer.json`` (never a hub download)."""
    if path is None:
        return SimTokenizer()
    return HFTokenizer(path)


def _mix(x: int) -> int:
    # splitmix64 finaliser: a cheap, well-distributed 64-bit mix.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def output_token(request_seed: int, index: int) -> int:
    """The ``index``-th generated token of a request seeded ``request_seed`` (a table id)."""
    return _mix((_mix(request_seed & _MASK64) + index) & _MASK64) % NUM_OUTPUT_TOKENS


def output_tokens(request_seed: int, start: int, count: int) -> list[int]:
    """Generated tokens ``start .. start+count-1`` of a request (same as `output_token`)."""
    base = _mix(request_seed & _MASK64)
    mix = _mix
    n = NUM_OUTPUT_TOKENS
    return [mix((base + i) & _MASK64) % n for i in range(start, start + count)]
