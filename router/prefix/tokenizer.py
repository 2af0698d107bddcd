"""The tokenizer of token mode: prompts cut into blocks of the replicas' `block_size` tokens.

Token mode makes the router's blocks coincide with the engine's, which exact mode needs (its
hashes of KV-event token ids must equal the prompts' hashes).  The tokenizer must be the one the
replicas use: a local `tokenizer.json` (the model's, never downloaded at run time), or `sim` for
the simulated replica's deterministic tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.errors import ConfigError
from router.prefix.keys import Tokenizer

__all__ = ["load_routing_tokenizer"]


class _HFTokenizer:
    """A `tokenizers.Tokenizer` from a local file; special tokens added as vLLM does."""

    __slots__ = ("_tok",)

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tok  # optional extra: tokenizer

        self._tok = _Tok.from_file(path)

    def encode(self, text: str) -> Sequence[int]:
        ids: list[int] = self._tok.encode(text).ids
        return ids


def load_routing_tokenizer(spec: str) -> Tokenizer:
    """`sim` → the sim replica's tokenizer; anything else → a local tokenizer.json path."""
    if spec == "sim":
        from replicas.sim.tokenizer import SimTokenizer

        return SimTokenizer()
    try:
        return _HFTokenizer(spec)
    except ImportError as exc:
        raise ConfigError("--tokenizer needs the `tokenizers` package (extra: tokenizer)") from exc
    except Exception as exc:  # tokenizers raises its own exception type on a bad file
        raise ConfigError(f"--tokenizer {spec!r}: cannot load tokenizer.json: {exc}") from exc
