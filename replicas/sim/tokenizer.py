"""Tokenizers: a deterministic stand-in (`SimTokenizer`) or a real local ``tokenizer.json``.

`SimTokenizer` cuts text into 4-character pieces, so two texts sharing a prefix of ``L``
characters share their first ``L // 4`` tokens, and roughly 4 characters make a token like
real BPE vocabularies on English. Pieces from a fixed table of pronounceable 4-character
syllables (``" bal"``, ``" kor"``...) get ids ``0 .. NUM_OUTPUT_TOKENS-1`` and decode back exactly;
any other piece gets a stable hashed id above the table. Generated text is drawn from the table
(`output_token`), so it is readable-ish and round-trips through encode/decode.

A real tokenizer (`HFTokenizer`) has no such table: `output_token` still draws an index in
``0 .. NUM_OUTPUT_TOKENS-1`` and the tokenizer's `output_ids` maps it to an ordinary token of its
vocabulary (a word piece that decodes on its own and re-encodes to itself; never a special
token), so generated ids are inside the vocabulary and decode to words.
"""

from __future__ import annotations

import re
import time
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
_SIM_OUTPUT_IDS = tuple(range(NUM_OUTPUT_TOKENS))
_SLICE_CHARS = 4 * 1024  # a multiple of 4: slicing never splits a piece


@runtime_checkable
class Tokenizer(Protocol):
    """What the simulator needs from a tokenizer.

    ``add_special_tokens`` and ``skip_special_tokens`` mean what they mean in vLLM (completion
    prompts get the tokenizer's BOS, chat prompts do not: the template has it; generated text
    skips special tokens, /detokenize keeps them). ``output_ids[i]`` is the token that generated
    index ``i`` (`output_token`) stands for.
    """

    vocab_size: int
    output_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def encode_long(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`encode` for a worker thread: lets other threads take the GIL while it works."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...


class SimTokenizer:
    """Deterministic, prefix-stable, ~4 characters per token; no files needed."""

    __slots__ = ("_hashed", "output_ids", "vocab_size")

    def __init__(self, vocab_size: int = _DEFAULT_VOCAB) -> None:
        if vocab_size <= NUM_OUTPUT_TOKENS:
            raise ValueError(f"vocab_size must be > {NUM_OUTPUT_TOKENS}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.output_ids = _SIM_OUTPUT_IDS  # generated index i is table id i
        self._hashed = vocab_size - NUM_OUTPUT_TOKENS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """4-character pieces: table ids when the piece is a syllable, hashed ids otherwise.

        There are no special tokens: ``add_special_tokens`` changes nothing."""
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

    def encode_long(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`encode` in slices of whole pieces (same ids), releasing the GIL between slices so
        the event-loop thread is never kept waiting for more than one slice (~0.2 ms)."""
        out: list[int] = []
        step = _SLICE_CHARS
        for i in range(0, len(text), step):
            out.extend(self.encode(text[i : i + step]))
            time.sleep(0)  # releases the GIL: a waiting thread gets it now, not in 5 ms
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Table ids decode exactly; hashed ids (one-way) decode to a placeholder syllable."""
        table = _TABLE
        n = NUM_OUTPUT_TOKENS
        return "".join(table[i % n] for i in ids)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.decode([i]) for i in ids]


# A token that reads as a word: letters, optionally after one leading space.
_WORD = re.compile(r" ?[^\W\d_]+")


class HFTokenizer:
    """A real tokenizer loaded from a local ``tokenizer.json`` (the `tokenizers` package)."""

    __slots__ = ("_tok", "output_ids", "vocab_size")

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HF  # optional dependency, imported on use

        self._tok: Any = _HF.from_file(path)
        self.vocab_size = int(self._tok.get_vocab_size())
        self.output_ids = self._pick_output_ids()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_long(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch runs in Rust without the GIL (encode keeps it); same ids as `encode`
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        to_token = self._tok.id_to_token
        return [str(to_token(i)) for i in ids]

    def _pick_output_ids(self) -> tuple[int, ...]:
        """Up to NUM_OUTPUT_TOKENS ordinary tokens, lowest ids first: space-led words (they
        read as text and a sequence of them re-encodes to itself), then other words, then any
        printable token that survives a decode/encode round trip."""
        tok = self._tok
        added = set(tok.get_added_tokens_decoder())
        spaced: list[int] = []
        words: list[int] = []
        other: list[int] = []
        for i in range(self.vocab_size):
            if i in added:
                continue
            text = tok.decode([i], skip_special_tokens=False)
            if not text.strip() or not text.isprintable():
                continue  # whitespace, control or partial UTF-8 ("\ufffd" is printable: below)
            if "\ufffd" in text or tok.encode(text, add_special_tokens=False).ids != [i]:
                continue
            if _WORD.fullmatch(text):
                (spaced if text.startswith(" ") else words).append(i)
                if len(spaced) >= NUM_OUTPUT_TOKENS:
                    break
            else:
                other.append(i)
        picked = (spaced + words + other)[:NUM_OUTPUT_TOKENS]
        if not picked:
            raise ValueError("the tokenizer has no ordinary token to generate text with")
        return tuple(picked)


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
