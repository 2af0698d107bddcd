"""vLLM's OpenAI-compatible wire format: parse and validate requests, format responses.

Nothing here touches a socket or the engine; `replicas.sim.server` calls these functions.

Errors form one small tree, turned into vLLM's error body by `error_body`::

    SimApiError                      {"error": {"message", "type", "param", "code"}}
    ├── BadRequest         400       "BadRequestError"
    ├── ModelNotFound      404       "NotFoundError"
    ├── RouteError         4xx       aiohttp's unknown path / method, e.g. "MethodNotAllowedError"
    └── InjectedFailure    500       "InternalServerError"   (fault injection)

Chat messages are rendered with a fixed Llama-3-style template (`render_chat`)::

    <|begin_of_text|>                                       once
    <|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>   per message
    <|start_header_id|>assistant<|end_header_id|>\\n\\n     when add_generation_prompt

Sampling fields that only matter for a real model (temperature, top_p, penalties, logit_bias, ...)
are accepted and type-checked where vLLM checks them, and have no effect: there is no model.
"""

from __future__ import annotations

import base64
import math
import random
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

__all__ = [
    "DONE_EVENT",
    "BadRequest",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "EmbeddingsRequest",
    "GenerationParams",
    "IncrementalDetokenizer",
    "InjectedFailure",
    "ModelNotFound",
    "RouteError",
    "SimApiError",
    "StopChecker",
    "StreamFormatter",
    "TokenizeRequest",
    "Usage",
    "detokenize_response",
    "embedding_vector",
    "embeddings_response",
    "error_body",
    "models_response",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_embeddings",
    "parse_json_object",
    "parse_tokenize",
    "render_chat",
    "response_body",
    "sse_event",
    "tokenize_response",
]

DONE_EVENT = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------------------- errors


class SimApiError(Exception):
    """An error the client sees as an OpenAI-style JSON body."""

    status = 500
    err_type = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(SimApiError):
    status = 400
    err_type = "BadRequestError"


class ModelNotFound(SimApiError):
    status = 404
    err_type = "NotFoundError"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class InjectedFailure(SimApiError):
    status = 500
    err_type = "InternalServerError"


class RouteError(SimApiError):
    """aiohttp's own 4xx (unknown path, wrong method) in the same body shape."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.err_type = reason.replace(" ", "") + "Error"


def error_body(err: SimApiError) -> bytes:
    """vLLM's `ErrorResponse`: `code` carries the HTTP status as an integer."""
    return orjson.dumps(
        {
            "error": {
                "message": err.message,
                "type": err.err_type,
                "param": err.param,
                "code": err.status,
            }
        }
    )


# ------------------------------------------------------------------------------ field checking


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or `BadRequest`."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _opt_int(body: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int in Python, not in JSON; integral floats are accepted, as pydantic does
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"`{name}` must be an integer, got {_type_name(value)}.", param=name)
    if isinstance(value, float):
        if not value.is_integer():
            raise BadRequest(f"`{name}` must be an integer, got {value}.", param=name)
        value = int(value)
    if minimum is not None and value < minimum:
        raise BadRequest(f"`{name}` must be at least {minimum}, got {value}.", param=name)
    return value


def _opt_float(
    body: Mapping[str, Any],
    name: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"`{name}` must be a number, got {_type_name(value)}.", param=name)
    number = float(value)
    if not math.isfinite(number):
        raise BadRequest(f"`{name}` must be finite.", param=name)
    if minimum is not None and (number < minimum or (exclusive_minimum and number == minimum)):
        bound = "greater than" if exclusive_minimum else "at least"
        raise BadRequest(f"`{name}` must be {bound} {minimum}, got {number}.", param=name)
    if maximum is not None and number > maximum:
        raise BadRequest(f"`{name}` must be at most {maximum}, got {number}.", param=name)
    return number


def _opt_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"`{name}` must be a boolean, got {_type_name(value)}.", param=name)
    return value


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"`{name}` must be a string, got {_type_name(value)}.", param=name)
    return value


def _token_ids(value: object, name: str) -> tuple[int, ...]:
    # set(map(type, ...)) and min() loop in C: a 32k-id prompt costs ~0.5 ms, not ~5 ms.
    # `type is int` also refuses bools (JSON true/false), which isinstance would let through.
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise BadRequest(f"`{name}` must be a list of integers.", param=name)
    if value and min(value) < 0:
        raise BadRequest(f"`{name}` must not contain negative token ids.", param=name)
    return tuple(value)


# ------------------------------------------------------------------------ generation requests


@dataclass(frozen=True)
class GenerationParams:
    """What both generation endpoints honour (after validation)."""

    max_tokens: int | None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    """POST /v1/completions: `prompt` is text or token ids."""

    model: str | None
    prompt: str | tuple[int, ...]
    params: GenerationParams
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's default for completions: the tokenizer's BOS


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ChatRequest:
    """POST /v1/chat/completions."""

    model: str | None
    messages: tuple[ChatMessage, ...]
    params: GenerationParams
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's default for chat: the template has the BOS


def _parse_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise BadRequest("`stop` must be a string or a list of strings.", param="stop")
    if any(s == "" for s in stops):
        raise BadRequest("`stop` cannot contain an empty string.", param="stop")
    return tuple(stops)


def _parse_params(body: Mapping[str, Any], *, max_tokens_names: Sequence[str]) -> GenerationParams:
    max_tokens: int | None = None
    for name in max_tokens_names:  # chat: max_completion_tokens wins over the legacy max_tokens
        value = _opt_int(body, name, minimum=1)
        if value is not None:
            max_tokens = value
            break
    min_tokens = _opt_int(body, "min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )
    n = _opt_int(body, "n", minimum=1)
    if n is not None and n > 1:
        raise BadRequest("The simulated replica supports n=1 only.", param="n")
    best_of = _opt_int(body, "best_of", minimum=1)
    if best_of is not None and best_of > 1:
        raise BadRequest("The simulated replica supports best_of=1 only.", param="best_of")
    # Accepted for compatibility; checked as vLLM's SamplingParams checks them.
    _opt_float(body, "temperature", minimum=0.0)
    _opt_float(body, "top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True)
    _opt_float(body, "presence_penalty", minimum=-2.0, maximum=2.0)
    _opt_float(body, "frequency_penalty", minimum=-2.0, maximum=2.0)
    _opt_int(body, "top_k", minimum=-1)
    seed = _opt_int(body, "seed")
    priority = _opt_int(body, "priority") or 0
    cache_salt = _opt_str(body, "cache_salt")
    if cache_salt == "":
        raise BadRequest("`cache_salt` must be a non-empty string.", param="cache_salt")
    stream = _opt_bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    continuous = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise BadRequest("`stream_options` must be an object.", param="stream_options")
        if not stream:
            raise BadRequest(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        include_usage = _opt_bool(stream_options, "include_usage", False)
        continuous = _opt_bool(stream_options, "continuous_usage_stats", False)
    return GenerationParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=_opt_bool(body, "ignore_eos", False),
        stop=_parse_stop(body),
        seed=seed,
        priority=priority,
        cache_salt=cache_salt,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
    )


def _parse_prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt, as the openai client may send
    if isinstance(value, str):
        if not value:
            raise BadRequest("`prompt` must not be empty.", param="prompt")
        return value
    if isinstance(value, list):
        if value and all(isinstance(p, str | list) for p in value):
            raise BadRequest(
                "Batched prompts are not supported by the simulated replica; send one prompt.",
                param="prompt",
            )
        ids = _token_ids(value, "prompt")
        if not ids:
            raise BadRequest("`prompt` must not be empty.", param="prompt")
        return ids
    if value is None:
        raise BadRequest("`prompt` is required.", param="prompt")
    raise BadRequest(
        f"`prompt` must be a string or a list of token ids, got {_type_name(value)}.",
        param="prompt",
    )


def parse_completion(body: Mapping[str, Any]) -> CompletionRequest:
    """Validate a /v1/completions body."""
    model = _opt_str(body, "model")
    prompt = _parse_prompt(body.get("prompt"))
    params = _parse_params(body, max_tokens_names=("max_tokens",))
    echo = _opt_bool(body, "echo", False)
    if echo and params.stream:
        raise BadRequest("`echo` with `stream` is not supported by the simulated replica.")
    return CompletionRequest(
        model=model,
        prompt=prompt,
        params=params,
        echo=echo,
        add_special_tokens=_opt_bool(body, "add_special_tokens", True),
    )


def _message_content(value: object, index: int) -> str:
    param = f"messages[{index}].content"
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts: list[str] = []
        for part in value:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest("Content parts must be objects with a `type`.", param=param)
            if part["type"] != "text":
                raise BadRequest(
                    f"Content part type {part['type']!r} is not supported by a text-only model.",
                    param=param,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest("A text content part needs a string `text`.", param=param)
            texts.append(text)
        return "\n".join(texts)
    raise BadRequest(
        f"`content` must be a string or a list of parts, got {_type_name(value)}.", param=param
    )


def parse_messages(value: object) -> tuple[ChatMessage, ...]:
    if value is None:
        raise BadRequest("`messages` is required.", param="messages")
    if not isinstance(value, list) or not value:
        raise BadRequest("`messages` must be a non-empty list.", param="messages")
    messages: list[ChatMessage] = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadRequest("Each message must be an object.", param=f"messages[{index}]")
        role = item.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest("Each message needs a string `role`.", param=f"messages[{index}].role")
        messages.append(
            ChatMessage(role=role, content=_message_content(item.get("content"), index))
        )
    return tuple(messages)


def parse_chat(body: Mapping[str, Any]) -> ChatRequest:
    """Validate a /v1/chat/completions body."""
    model = _opt_str(body, "model")
    messages = parse_messages(body.get("messages"))
    params = _parse_params(body, max_tokens_names=("max_completion_tokens", "max_tokens"))
    return ChatRequest(
        model=model,
        messages=messages,
        params=params,
        add_generation_prompt=_opt_bool(body, "add_generation_prompt", True),
        add_special_tokens=_opt_bool(body, "add_special_tokens", False),
    )


def render_chat(messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> str:
    """The prompt text for a chat: a fixed Llama-3-style template (see the module docstring)."""
    parts = ["<|begin_of_text|>"]
    for message in messages:
        parts.append(
            f"<|start_header_id|>{message.role}<|end_header_id|>\n\n{message.content}<|eot_id|>"
        )
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


# ---------------------------------------------------------------------------------- output text


class IncrementalDetokenizer:
    """Text deltas from a growing token list without re-decoding it all each step.

    Decodes a short window (the classic prefix/read offsets of HF and vLLM) so multi-token
    characters of a real tokenizer come out whole; the simulator's tokenizer is exact per token.
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read")

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        if not token_ids and not final:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.endswith("\ufffd") and not final:
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        return delta


# --------------------------------------------------------------------------------- stop strings


class StopChecker:
    """Turns generated text deltas into what the client may see, honouring stop strings.

    vLLM semantics: stop strings are not checked before `min_tokens` tokens exist; the stop string
    itself is not returned; while streaming, text that could still become a stop string is held
    back (at most ``len(longest stop) - 1`` characters).
    """

    __slots__ = ("_emitted", "_min_tokens", "_num_tokens", "_stops", "_tail", "_text")

    def __init__(self, stop: Sequence[str], min_tokens: int = 0) -> None:
        self._stops = tuple(stop)
        self._tail = max((len(s) for s in self._stops), default=1) - 1
        self._min_tokens = min_tokens
        self._text = ""
        self._emitted = 0
        self._num_tokens = 0

    @property
    def text(self) -> str:
        """All text released so far (never contains a stop string)."""
        return self._text[: self._emitted]

    def push(self, delta: str, num_tokens: int, *, final: bool) -> tuple[str, str | None]:
        """Add newly decoded text; returns (text to release now, stop string hit or None)."""
        self._num_tokens += num_tokens
        start = max(0, len(self._text) - self._tail)
        self._text += delta
        if self._stops and self._num_tokens > self._min_tokens:
            hit: tuple[int, str] | None = None
            for stop in self._stops:
                at = self._text.find(stop, start)
                if at != -1 and (hit is None or at < hit[0]):
                    hit = (at, stop)
            if hit is not None:
                released = self._text[self._emitted : hit[0]]
                self._text = self._text[: hit[0]]
                self._emitted = hit[0]
                return released, hit[1]
        end = len(self._text) if final or not self._stops else len(self._text) - self._tail
        end = max(end, self._emitted)
        released = self._text[self._emitted : end]
        self._emitted = end
        return released, None


# -------------------------------------------------------------------------------- response side


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, Any]:
        # field order as vLLM's UsageInfo; prompt_tokens_details as --enable-prompt-tokens-details
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event as vLLM writes it: `data: {json}` and a blank line."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


Kind = Literal["completion", "chat"]


class StreamFormatter:
    """Builds the SSE chunks of one streamed response, byte-compatible with vLLM's shapes.

    The common chunk (a text delta, nothing finished) is assembled from pre-encoded bytes: with
    hundreds of concurrent streams, one `orjson.dumps` of a nested dict per token adds up.
    """

    __slots__ = ("_created", "_head", "_id", "_kind", "_mid", "_model", "_tail")

    def __init__(self, kind: Kind, request_id: str, model: str, created: int) -> None:
        self._kind = kind
        self._id = request_id
        self._model = model
        self._created = created
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = orjson.dumps({"id": request_id, "object": obj, "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":0,'
        if kind == "chat":
            self._mid = b'"delta":{"content":'
            self._tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._mid = b'"text":'
            self._tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'

    def _envelope(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self._kind == "chat" else "text_completion"
        return {"id": self._id, "object": obj, "created": self._created, "model": self._model}

    def role_chunk(self) -> bytes:
        """Chat only: the first chunk announces the assistant role with empty content."""
        payload = self._envelope()
        payload["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return sse_event(payload)

    def delta_chunk(self, text: str, usage: Usage | None = None) -> bytes:
        if usage is None:
            return self._head + self._mid + orjson.dumps(text) + self._tail
        payload = self._envelope()
        payload["choices"] = [self._choice(text, None, None)]
        payload["usage"] = usage.as_dict()
        return sse_event(payload)

    def final_chunk(
        self, text: str, finish_reason: str, stop_reason: str | None, usage: Usage | None = None
    ) -> bytes:
        payload = self._envelope()
        payload["choices"] = [self._choice(text, finish_reason, stop_reason)]
        if usage is not None:
            payload["usage"] = usage.as_dict()
        return sse_event(payload)

    def usage_chunk(self, usage: Usage) -> bytes:
        """`stream_options.include_usage`: the last chunk, `choices: []` plus usage."""
        payload = self._envelope()
        payload["choices"] = []
        payload["usage"] = usage.as_dict()
        return sse_event(payload)

    def _choice(self, text: str, finish: str | None, stop_reason: str | None) -> dict[str, Any]:
        if self._kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            if finish is not None:
                choice["stop_reason"] = stop_reason
            return choice
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }


def response_body(
    kind: Kind,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    stop_reason: str | None,
    usage: Usage,
) -> dict[str, Any]:
    """A non-streamed /v1/completions or /v1/chat/completions body, keys in vLLM's order."""
    choice: dict[str, Any] = {"index": 0}
    if kind == "chat":
        choice["message"] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        }
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason)
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if kind == "chat":
        body.update(service_tier=None, system_fingerprint=None, usage=usage.as_dict())
        body.update(prompt_logprobs=None, kv_transfer_params=None)
    else:
        choice["prompt_logprobs"] = None
        body["usage"] = usage.as_dict()
    return body


def models_response(names: Sequence[str], root: str, max_model_len: int) -> dict[str, Any]:
    """GET /v1/models as vLLM answers it (one card per served name)."""
    created = int(time.time())
    cards = []
    for name in names:
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{name}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        )
    return {"object": "list", "data": cards}


# ---------------------------------------------------------------------- tokenize / detokenize


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    text: str
    return_token_strs: bool
    add_special_tokens: bool = True


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: tuple[int, ...]


def parse_tokenize(body: Mapping[str, Any]) -> TokenizeRequest:
    """POST /tokenize: either `prompt` (completion style) or `messages` (chat style)."""
    model = _opt_str(body, "model")
    strs = _opt_bool(body, "return_token_strs", False)
    if "messages" in body:
        messages = parse_messages(body.get("messages"))
        text = render_chat(
            messages, add_generation_prompt=_opt_bool(body, "add_generation_prompt", True)
        )
        special = _opt_bool(body, "add_special_tokens", False)  # as for chat completions
        return TokenizeRequest(model, text, strs, special)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("`prompt` (a string) or `messages` is required.", param="prompt")
    return TokenizeRequest(model, prompt, strs, _opt_bool(body, "add_special_tokens", True))


def tokenize_response(
    tokens: Sequence[int], max_model_len: int, token_strs: Sequence[str] | None
) -> dict[str, Any]:
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": list(tokens),
        "token_strs": None if token_strs is None else list(token_strs),
    }


def parse_detokenize(body: Mapping[str, Any]) -> DetokenizeRequest:
    if "tokens" not in body:
        raise BadRequest("`tokens` is required.", param="tokens")
    return DetokenizeRequest(
        model=_opt_str(body, "model"), tokens=_token_ids(body["tokens"], "tokens")
    )


def detokenize_response(text: str) -> dict[str, Any]:
    return {"prompt": text}


# ---------------------------------------------------------------------------------- embeddings


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: Literal["float", "base64"]
    dimensions: int | None


def parse_embeddings(body: Mapping[str, Any]) -> EmbeddingsRequest:
    """POST /v1/embeddings: `input` is a string, token ids, or a list of either."""
    model = _opt_str(body, "model")
    raw = body.get("input")
    inputs: list[str | tuple[int, ...]]
    if isinstance(raw, str):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        inputs = list(raw)
    elif isinstance(raw, list) and raw and all(isinstance(x, list) for x in raw):
        inputs = [_token_ids(x, "input") for x in raw]
    elif isinstance(raw, list) and raw:
        inputs = [_token_ids(raw, "input")]
    else:
        raise BadRequest(
            "`input` must be a string, a list of strings, or token ids.", param="input"
        )
    if any(len(x) == 0 for x in inputs):
        raise BadRequest("`input` must not be empty.", param="input")
    fmt = _opt_str(body, "encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise BadRequest("`encoding_format` must be 'float' or 'base64'.", param="encoding_format")
    dimensions = _opt_int(body, "dimensions", minimum=1)
    return EmbeddingsRequest(
        model=model,
        inputs=tuple(inputs),
        encoding_format="base64" if fmt == "base64" else "float",
        dimensions=dimensions,
    )


def embedding_vector(
    token_ids: Sequence[int], dim: int, hash64: Callable[[bytes], int]
) -> list[float]:
    """A deterministic unit vector for a token sequence (no meaning, only reproducibility)."""
    rng = random.Random(hash64(struct.pack(f"<{len(token_ids)}q", *token_ids)))
    values = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def embeddings_response(
    request_id: str,
    model: str,
    vectors: Sequence[Sequence[float]],
    encoding_format: Literal["float", "base64"],
    prompt_tokens: int,
) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(vectors):
        embedding: list[float] | str
        if encoding_format == "base64":  # little-endian float32, as the openai client decodes it
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        else:
            embedding = list(vector)
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
