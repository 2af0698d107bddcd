"""The routing key of a request and its chained block hashes.

The routing key is what the prefix index matches on: the chat messages rendered canonically (tools
first, then role and content of each message in order, so a conversation's later turns extend the
key of its earlier ones), the completions prompt text, or a prompt given as token ids used as is.
The key is cut into fixed blocks (`block_units` characters, or tokens in token mode) and only full
blocks are hashed, like vLLM's prefix cache.  Block *i*'s hash is xxhash64 of its bytes seeded with
block *i-1*'s hash, the first seeded by the model name and `cache_salt`; so one hash names a whole
prefix, and equal hashes at position *i* mean equal prompts up to the end of block *i*.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import orjson
import xxhash

from router.errors import BadRequest
from router.prefix.units import KeyUnits

__all__ = [
    "DEFAULT_BLOCK_UNITS",
    "Endpoint",
    "PromptKey",
    "Tokenizer",
    "chain_seed",
    "hash_text_blocks",
    "hash_token_blocks",
    "prompt_key",
    "render_chat",
    "routing_key",
    "routing_key_hashes",
]

DEFAULT_BLOCK_UNITS: Final = 64

Endpoint = Literal["completions", "chat"]

_xxh64 = xxhash.xxh64_intdigest
# Token ids are hashed as little-endian signed 64-bit integers: wide enough for any vocabulary and
# for ids a client might send out of range (the replica rejects those; we only must not crash).
_TOKEN_TYPECODE: Final = "q"
_TOKEN_BYTES: Final = 8


class Tokenizer(Protocol):
    """What token mode needs of a tokenizer (e.g. a `tokenizers.Tokenizer` wrapper)."""

    def encode(self, text: str) -> Sequence[int]: ...


def chain_seed(model: str, cache_salt: str | None = None) -> int:
    """The seed of a model's hash chain: requests with different salts never share blocks."""
    return _xxh64(f"{model}\x00{cache_salt or ''}".encode())


def hash_text_blocks(text: str, seed: int, block_chars: int = DEFAULT_BLOCK_UNITS) -> list[int]:
    """Chained hashes of the full `block_chars`-character blocks of `text`."""
    n_full = len(text) // block_chars
    out: list[int] = []
    append = out.append
    h = seed
    if text.isascii():
        # One encode, then byte slices: characters and bytes coincide for ASCII (the common case).
        data = text.encode()
        for start in range(0, n_full * block_chars, block_chars):
            h = _xxh64(data[start : start + block_chars], h)
            append(h)
    else:
        for start in range(0, n_full * block_chars, block_chars):
            h = _xxh64(text[start : start + block_chars].encode(), h)
            append(h)
    return out


def hash_token_blocks(tokens: Sequence[int], seed: int, block_tokens: int) -> list[int]:
    """Chained hashes of the full `block_tokens`-token blocks of `tokens`, starting from `seed`.

    `seed` is the chain seed for a prompt's first block, or the hash of the block before the first
    one given (how KV events extend a cached parent block).
    """
    n_full = len(tokens) // block_tokens
    if n_full == 0:
        return []
    data = array(_TOKEN_TYPECODE, tokens[: n_full * block_tokens]).tobytes()
    step = block_tokens * _TOKEN_BYTES
    out: list[int] = []
    append = out.append
    h = seed
    for start in range(0, n_full * step, step):
        h = _xxh64(data[start : start + step], h)
        append(h)
    return out


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        kind = part.get("type")
        if kind == "text" or "text" in part:
            text = part.get("text")
            return text if isinstance(text, str) else ""
        # Images, audio, files: their reference distinguishes prompts that differ only there.
        for field in ("image_url", "input_audio", "file", "video_url"):
            if field in part:
                return (
                    f"<{field}:{orjson.dumps(part[field], option=orjson.OPT_SORT_KEYS).decode()}>"
                )
    return ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable):
        return "".join(_part_text(part) for part in content)
    return str(content)


def _canonical_json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # not JSON-serialisable (cannot come from a parsed body); still stable
        return repr(value)


def render_chat(messages: Any, tools: Any = None) -> str:
    """Render chat messages (and tools) canonically; a prefix of messages renders to a prefix.

    Tools come first because chat templates put them in the system part of the prompt; each
    message is `<|role|>content` plus its tool calls, so turn *n+1* extends turn *n*'s key.
    """
    pieces: list[str] = []
    if tools:
        pieces.append(f"<|tools|>{_canonical_json(tools)}\n")
    if isinstance(messages, Iterable) and not isinstance(messages, str | bytes | Mapping):
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            role = message.get("role", "")
            name = message.get("name")
            head = f"<|{role}|>" if not name else f"<|{role}:{name}|>"
            pieces.append(head)
            pieces.append(_content_text(message.get("content")))
            tool_calls = message.get("tool_calls")
            if tool_calls:
                pieces.append(f"<|tool_calls|>{_canonical_json(tool_calls)}")
            pieces.append("\n")
    return "".join(pieces)


def routing_key(endpoint: str, body: Mapping[str, Any]) -> str | list[int]:
    """The routing key of a request body: text, or token ids when the prompt is given as ids.

    Batched completions prompts (a list of prompts) are keyed by their first prompt.
    """
    if endpoint == "chat":
        return render_chat(body.get("messages"), body.get("tools"))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return [t for t in prompt if isinstance(t, int)]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return [t for t in first if isinstance(t, int)]
    return ""


def routing_key_hashes(
    endpoint: str,
    body: Mapping[str, Any],
    model: str,
    block_units: int = DEFAULT_BLOCK_UNITS,
    *,
    tokenizer: Tokenizer | None = None,
) -> tuple[tuple[int, ...], int]:
    """(chained block hashes, prompt length in units) of one request.

    `prompt_key` with one unit per token: text is cut into `block_units` characters (tokens in
    token mode, `tokenizer` given) and a prompt of token ids into `block_units` tokens.  Only full
    blocks are hashed.
    """
    key = prompt_key(
        endpoint, body, model, KeyUnits(block_units, units_per_token=1.0), tokenizer=tokenizer
    )
    return key.block_hashes, key.prompt_units


@dataclass(frozen=True, slots=True)
class PromptKey:
    """One request's routing key as the prefix index and the policies see it."""

    block_hashes: tuple[int, ...]
    # Length in routing-key units, the unit `block_units` counts (characters; tokens in token
    # mode; for token ids in character mode, characters the tokens stand for).
    prompt_units: int
    # Model tokens: exact for token ids and in token mode, estimated from characters otherwise.
    prompt_tokens: int
    # Hash of the whole key, partial last block included: tells apart prompts too short to fill
    # a block (tie-breaks), while equal keys hash alike.
    key_hash: int


def prompt_key(
    endpoint: str,
    body: Mapping[str, Any],
    model: str,
    units: KeyUnits,
    *,
    tokenizer: Tokenizer | None = None,
) -> PromptKey:
    """The routing key of one request in `units`, computed once at the edge.

    Text is cut into blocks of `units.block_units` characters, or tokenized first in token mode
    (`tokenizer` given).  A prompt given as token ids is cut into `units.tokens_per_block`
    tokens per block (`block_units` in token mode; `block_units / chars_per_token` in character
    mode), so its blocks hold as much KV as a text prompt's and `prompt_tokens` is its true
    length, not its length divided by `chars_per_token`.
    """
    salt = body.get("cache_salt")
    seed = chain_seed(model, salt if isinstance(salt, str) else None)
    key = routing_key(endpoint, body)
    if isinstance(key, str) and tokenizer is None:
        block = units.block_units
        hashes = hash_text_blocks(key, seed, block)
        tail = key[len(hashes) * block :]
        last = hashes[-1] if hashes else seed
        key_hash = _xxh64(tail.encode(), last) if tail else last
        return PromptKey(tuple(hashes), len(key), units.units_to_tokens(len(key)), key_hash)
    tokens = list(tokenizer.encode(key)) if isinstance(key, str) and tokenizer else key
    assert not isinstance(tokens, str)
    per_block = units.tokens_per_block
    try:
        hashes = hash_token_blocks(tokens, seed, per_block)
        tail_ids = tokens[len(hashes) * per_block :]
        last = hashes[-1] if hashes else seed
        key_hash = _xxh64(array(_TOKEN_TYPECODE, tail_ids).tobytes(), last) if tail_ids else last
    except OverflowError:
        param = "messages" if endpoint == "chat" else "prompt"
        raise BadRequest(f"`{param}` has a token id outside 0..2^63-1", param=param) from None
    n = len(tokens)
    return PromptKey(tuple(hashes), n * units.block_units // per_block, n, key_hash)
