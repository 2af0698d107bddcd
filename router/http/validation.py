"""Parse and check request bodies once, at the edge.

The body is parsed with orjson only to read what routing needs (model, stream, user, the
prompt) and to reject what no replica could serve; it is forwarded as the client's bytes.
Value ranges stay the replica's business (its 400 reaches the client unchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import orjson

from router.errors import BadRequest

__all__ = ["ParsedRequest", "parse_json_object", "validate"]

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "min_tokens", "logprobs", "seed")
_NUMBER_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


class ParsedRequest(NamedTuple):
    """What the router reads from a body (a NamedTuple: built per request, cheaply)."""

    model: str | None
    stream: bool
    user: str | None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or BadRequest."""
    if not raw:
        raise BadRequest("the request body is empty: expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, not {_kind(body)}")
    return body


def _kind(value: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }.get(type(value), "null")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(v) for v in value)


def _expect(ok: bool, param: str, expected: str, value: Any) -> None:
    if not ok:
        raise BadRequest(f"`{param}` must be {expected}, got {_kind(value)}", param=param)


def _check_prompt(value: Any, param: str = "prompt") -> None:
    ok = isinstance(value, str) or (
        isinstance(value, list)
        and bool(value)
        and (
            all(isinstance(v, str) for v in value)
            or all(_is_int(v) for v in value)
            or all(_is_int_list(v) for v in value)
        )
    )
    _expect(
        ok,
        param,
        "a string, a non-empty array of strings, of token ids or of token id arrays",
        value,
    )


def _check_messages(value: Any) -> None:
    _expect(isinstance(value, list) and bool(value), "messages", "a non-empty array", value)
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        _expect(isinstance(message, dict), param, "an object", message)
        role = message.get("role")
        _expect(isinstance(role, str) and bool(role), f"{param}.role", "a string", role)
        content = message.get("content")
        _expect(
            content is None or isinstance(content, str | list),
            f"{param}.content",
            "a string or an array of content parts",
            content,
        )


def _require(body: Mapping[str, Any], field: str, endpoint: str) -> Any:
    value = body.get(field)
    if value is None:
        raise BadRequest(f"`{field}` is required for {endpoint}", param=field)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Typed optional fields: (check, what it must be).  Null is always allowed.
_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model": (lambda v: isinstance(v, str) and bool(v), "a string"),
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    **{name: (_is_int, "an integer") for name in _INT_FIELDS},
    **{name: (_is_number, "a number") for name in _NUMBER_FIELDS},
}


def validate(endpoint: str, body: Mapping[str, Any]) -> ParsedRequest:
    """Check the fields the router relies on and those any replica would reject as malformed."""
    # Only the fields present are checked (a body carries a few of the dozen typed ones);
    # sorted, so the error names the same field whatever the body's key order.
    for name in sorted(_FIELD_CHECKS.keys() & body.keys()):
        value = body[name]
        check, expected = _FIELD_CHECKS[name]
        if value is not None and not check(value):
            _expect(False, name, expected, value)
    model = body.get("model")
    stream = body.get("stream")
    user = body.get("user")

    if endpoint == "completions":
        _check_prompt(_require(body, "prompt", "/v1/completions"))
    elif endpoint == "chat":
        _check_messages(_require(body, "messages", "/v1/chat/completions"))
    elif endpoint == "embeddings":
        _check_prompt(_require(body, "input", "/v1/embeddings"), "input")
    elif endpoint == "tokenize":
        if body.get("messages") is not None:
            _check_messages(body["messages"])
        else:
            _check_prompt(_require(body, "prompt", "/tokenize"))
    elif endpoint == "detokenize":
        tokens = _require(body, "tokens", "/detokenize")
        _expect(isinstance(tokens, list) and all(_is_int(t) for t in tokens), "tokens",
                "an array of token ids", tokens)  # fmt: skip
    return ParsedRequest(model=model, stream=bool(stream), user=user)
