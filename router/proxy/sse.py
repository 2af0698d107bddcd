"""What the proxy reads of a replica's SSE stream: only whether prefill is over.

vLLM sends a chat stream's first chunk, the assistant-role announcement
(`{"choices": [{"delta": {"role": "assistant", "content": ""}, ...}]}`, one per choice), from
the loop over engine outputs, i.e. once the engine has produced the first token: its prefill is
over (vllm/entrypoints/openai/serving_chat.py, `first_iteration`; the V1 engine emits an output
only with new tokens).  Other OpenAI-compatible servers may announce the role as soon as they
accept the request, before prefill.  The router therefore takes the end of prefill to be the
first chunk that is *not* only role announcements: on vLLM the token's own chunk follows the
role chunk at once, elsewhere it waits for the token.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["announces_role_only"]

_DATA = b"data: "
_ROLE_ONLY_KEYS = frozenset({"role", "content"})


def announces_role_only(chunk: bytes) -> bool:
    """True when `chunk` is complete SSE events that only announce a role (no token yet).

    Anything else, including a chunk that ends mid-event or does not parse, is False: the
    caller then treats the chunk as the first token, as it did before this check existed.
    """
    if not chunk.startswith(_DATA) or not chunk.endswith(b"\n\n"):
        return False
    for event in chunk.split(b"\n\n"):
        if not event:
            continue
        if not event.startswith(_DATA):
            return False
        try:
            data = orjson.loads(event[len(_DATA) :])
        except orjson.JSONDecodeError:
            return False
        if not _role_only(data):
            return False
    return True


def _role_only(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") or choice.get("logprobs"):
            return False
        delta = choice.get("delta")
        if (
            not isinstance(delta, dict)
            or "role" not in delta
            or delta.get("content")
            or not delta.keys() <= _ROLE_ONLY_KEYS
        ):
            return False
    return True
