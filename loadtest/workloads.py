"""Seeded, reproducible workloads.

A workload is an endless, seeded stream of :class:`Session` s.  A session is one request, or a
multi-turn conversation whose next turn is built only once the previous answer has arrived
(the answer text joins the history).  The driver takes as many requests as it needs from the
stream; the same name, parameters and seed always give the same requests.

Lengths are in sim tokens (see :mod:`loadtest.text`), and fixed output lengths are asked for with
``max_tokens`` plus vLLM's ``ignore_eos``.

========================  ===================================================================
``shared-prefix``          SGLang's generated-shared-prefix: groups sharing a system prompt,
                           a question per prompt, shuffled
``multi-turn``             chat conversations whose history grows turn by turn, with think time
``random``                 vLLM's random: lengths in ``[x(1-r), x(1+r)]``, optional shared prefix
``output-variance``        512-token prompts, exponential output lengths (mean 128) capped
``long-prompt-mix``        mostly short prompts with a fraction of very long ones
``prefix-repetition``      vLLM's: a few prefixes repeated, each with its own suffix
``trace``                  replay of a JSONL trace (see :mod:`loadtest.trace`)
========================  ===================================================================
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.text import estimate_tokens, filler

__all__ = [
    "WORKLOADS",
    "LongPromptMixParams",
    "Message",
    "MultiTurnParams",
    "OutputVarianceParams",
    "PrefixRepetitionParams",
    "RandomParams",
    "RequestSpec",
    "Session",
    "SharedPrefixParams",
    "TraceParams",
    "Turn",
    "Workload",
    "WorkloadError",
    "make_workload",
    "take_requests",
]

Message = tuple[str, str]  # (role, content)


class WorkloadError(ValueError):
    """A workload name or parameter is wrong."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as it will be sent, plus what the workload knows about it."""

    request_id: str
    prompt: str | None = None  # completions
    messages: tuple[Message, ...] | None = None  # chat completions
    max_tokens: int = 128
    ignore_eos: bool = True
    prompt_tokens: int = 0  # expected prompt length in sim tokens
    group: int | None = None  # index of the shared prefix it carries, if any
    session: str | None = None  # conversation id (multi-turn / traces that name one)
    turn: int = 0


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn: the user's text (or, for a completion, the prompt's own part)."""

    user: str
    max_tokens: int
    ignore_eos: bool = True
    think_time_s: float = 0.0  # pause after the previous answer before this turn is sent
    messages: tuple[Message, ...] | None = None  # verbatim chat messages (trace replay)


@dataclass(frozen=True, slots=True)
class Session:
    """A unit of work.  Single-turn completions use ``system + user`` as the prompt."""

    session_id: str
    turns: tuple[Turn, ...]
    system: str = ""
    chat: bool = False
    group: int | None = None
    at_s: float | None = None  # trace timestamp (seconds from the trace start)
    session_key: str | None = None  # sent as the OpenAI `user` field (conversations)

    def request(self, turn: int, answers: Sequence[str] = ()) -> RequestSpec:
        """The request for ``turn``; ``answers`` are the assistant's answers to earlier turns."""
        t = self.turns[turn]
        request_id = f"{self.session_id}-t{turn}" if len(self.turns) > 1 else self.session_id
        session = self.session_key
        if t.messages is not None:
            text = "".join(content for _, content in t.messages)
            return RequestSpec(
                request_id=request_id,
                messages=t.messages,
                max_tokens=t.max_tokens,
                ignore_eos=t.ignore_eos,
                prompt_tokens=estimate_tokens(text),
                group=self.group,
                session=session,
                turn=turn,
            )
        if not self.chat:
            prompt = self.system + t.user
            return RequestSpec(
                request_id=request_id,
                prompt=prompt,
                max_tokens=t.max_tokens,
                ignore_eos=t.ignore_eos,
                prompt_tokens=estimate_tokens(prompt),
                group=self.group,
                session=session,
                turn=turn,
            )
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
        messages: list[Message] = [("system", self.system)] if self.system else []
        for earlier, answer in zip(self.turns[:turn], answers, strict=False):
            messages += [("user", earlier.user), ("assistant", answer)]
        messages.append(("user", t.user))
        return RequestSpec(
            request_id=request_id,
            messages=tuple(messages),
            max_tokens=t.max_tokens,
            ignore_eos=t.ignore_eos,
            prompt_tokens=sum(estimate_tokens(content) for _, content in messages),
            group=self.group,
            session=session,
            turn=turn,
        )


# --------------------------------------------------------------------------- parameters


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise WorkloadError(f"{name} must be > 0, got {value}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise WorkloadError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class SharedPrefixParams:
    """SGLang bench_serving ``generated-shared-prefix`` (its defaults)."""

    num_groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256

    def __post_init__(self) -> None:
        for name in ("num_groups", "prompts_per_group", "question_len", "output_len"):
            _positive(name, getattr(self, name))
        _non_negative("system_prompt_len", self.system_prompt_len)


@dataclass(frozen=True, slots=True)
class MultiTurnParams:
    """Chat conversations: each turn resends the whole history plus a new user message."""

    num_conversations: int = 32
    turns: int = 4
    num_system_prompts: int = 4  # conversations share one of these system prompts
    system_prompt_len: int = 512
    user_len: int = 64
    output_len: int = 128
    think_time_s: float = 1.0  # mean of an exponential pause between an answer and the next turn

    def __post_init__(self) -> None:
        for name in ("num_conversations", "turns", "num_system_prompts", "user_len", "output_len"):
            _positive(name, getattr(self, name))
        _non_negative("system_prompt_len", self.system_prompt_len)
        _non_negative("think_time_s", self.think_time_s)


@dataclass(frozen=True, slots=True)
class RandomParams:
    """vLLM bench ``random``: uniform lengths in ``[len*(1-r), len*(1+r)]``, optional prefix."""

    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0  # one prefix shared by every request

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            _positive(name, getattr(self, name))
        _non_negative("prefix_len", self.prefix_len)
        if not 0 <= self.range_ratio < 1:
            raise WorkloadError(f"range_ratio must be in [0, 1), got {self.range_ratio}")


@dataclass(frozen=True, slots=True)
class OutputVarianceParams:
    """Anyscale's continuous-batching study: fixed prompts, exponential outputs, capped."""

    num_prompts: int = 1000
    input_len: int = 512
    output_mean: float = 128.0
    cap: int = 512  # the study used 32 / 128 / 512 / 1536

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_mean", "cap"):
            _positive(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class LongPromptMixParams:
    """Mostly short prompts with a fraction of very long ones (the chunked-prefill case)."""

    num_prompts: int = 200
    short_len: int = 128
    long_len: int = 8192
    long_fraction: float = 0.1
    output_len: int = 128

    def __post_init__(self) -> None:
        for name in ("num_prompts", "short_len", "long_len", "output_len"):
            _positive(name, getattr(self, name))
        if not 0 <= self.long_fraction <= 1:
            raise WorkloadError(f"long_fraction must be in [0, 1], got {self.long_fraction}")


@dataclass(frozen=True, slots=True)
class PrefixRepetitionParams:
    """vLLM bench ``prefix_repetition``: ``num_prefixes`` prefixes, each request its own suffix."""

    num_prompts: int = 1000
    num_prefixes: int = 10
    prefix_len: int = 256
    suffix_len: int = 256
    output_len: int = 128

    def __post_init__(self) -> None:
        for name in ("num_prompts", "num_prefixes", "prefix_len", "suffix_len", "output_len"):
            _positive(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class TraceParams:
    """Replay of a JSONL trace file (see :mod:`loadtest.trace`)."""

    path: str = ""
    time_scale: float = 1.0  # multiply trace timestamps (0.5 = twice as fast)

    def __post_init__(self) -> None:
        if not self.path:
            raise WorkloadError("the trace workload needs a file: --trace FILE")
        _positive("time_scale", self.time_scale)


# --------------------------------------------------------------------------- generators


def _grouped(
    rng: random.Random,
    tag: str,
    groups: int,
    per_group: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
) -> Iterator[Session]:
    """``groups`` shared prefixes, ``per_group`` questions each; every pass shuffled anew."""
    prefixes = [filler(rng, prefix_len) for _ in range(groups)]
    for epoch in itertools.count():
        batch = [
            Session(
                session_id=f"{tag}-e{epoch}-g{g}-p{i}",
                turns=(Turn(user=filler(rng, question_len), max_tokens=output_len),),
                system=prefixes[g],
                group=g,
            )
            for g in range(groups)
            for i in range(per_group)
        ]
        rng.shuffle(batch)
        yield from batch


def _shared_prefix(p: SharedPrefixParams, rng: random.Random) -> Iterator[Session]:
    return _grouped(
        rng, "sp", p.num_groups, p.prompts_per_group, p.system_prompt_len, p.question_len,
        p.output_len,
    )  # fmt: skip


def _multi_turn(p: MultiTurnParams, rng: random.Random) -> Iterator[Session]:
    systems = [filler(rng, p.system_prompt_len) for _ in range(p.num_system_prompts)]
    for c in itertools.count():
        g = rng.randrange(p.num_system_prompts)
        turns = tuple(
            Turn(
                user=filler(rng, p.user_len),
                max_tokens=p.output_len,
                think_time_s=0.0
                if t == 0 or p.think_time_s == 0
                else rng.expovariate(1.0 / p.think_time_s),
            )
            for t in range(p.turns)
        )
        yield Session(
            session_id=f"conv-{c}",
            turns=turns,
            system=systems[g],
            chat=True,
            group=g,
            session_key=f"conv-{c}",
        )


def _random(p: RandomParams, rng: random.Random) -> Iterator[Session]:
    prefix = filler(rng, p.prefix_len)

    def length(mean: int) -> int:
        low = max(1, int(mean * (1 - p.range_ratio)))
        high = max(low, int(mean * (1 + p.range_ratio)))
        return rng.randint(low, high)

    for i in itertools.count():
        yield Session(
            session_id=f"rnd-{i}",
            turns=(Turn(user=filler(rng, length(p.input_len)), max_tokens=length(p.output_len)),),
            system=prefix,
            group=0 if p.prefix_len else None,
        )


def _output_variance(p: OutputVarianceParams, rng: random.Random) -> Iterator[Session]:
    for i in itertools.count():
        out = min(p.cap, max(1, round(rng.expovariate(1.0 / p.output_mean))))
        yield Session(
            session_id=f"ov-{i}",
            turns=(Turn(user=filler(rng, p.input_len), max_tokens=out),),
        )


def _long_prompt_mix(p: LongPromptMixParams, rng: random.Random) -> Iterator[Session]:
    for i in itertools.count():
        n = p.long_len if rng.random() < p.long_fraction else p.short_len
        yield Session(
            session_id=f"lpm-{i}", turns=(Turn(user=filler(rng, n), max_tokens=p.output_len),)
        )


def _prefix_repetition(p: PrefixRepetitionParams, rng: random.Random) -> Iterator[Session]:
    per_prefix = -(-p.num_prompts // p.num_prefixes)
    return _grouped(rng, "pr", p.num_prefixes, per_prefix, p.prefix_len, p.suffix_len, p.output_len)


def _trace(p: TraceParams, rng: random.Random) -> Iterator[Session]:
    from loadtest.trace import load_trace  # local: trace imports this module

    yield from load_trace(p.path, time_scale=p.time_scale)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True, slots=True)
class Workload:
    """A named workload with its parameters and seed; iterate it for its sessions."""

    name: str
    params: Any
    seed: int
    natural_size: int  # requests in one pass (the default --num-requests)
    all_at_once: bool  # the workload's own arrival: everything at t=0 (output-variance)
    self_timed: bool  # sessions carry their own send times (trace replay)
    _generate: Callable[[Any, random.Random], Iterator[Session]]

    def sessions(self) -> Iterator[Session]:
        """The endless seeded session stream (a fresh iterator each call)."""
        return self._generate(self.params, random.Random(self.seed))


@dataclass(frozen=True, slots=True)
class _Def:
    params_type: type[Any]
    generate: Callable[[Any, random.Random], Iterator[Session]]
    natural_size: Callable[[Any], int]
    all_at_once: bool = False
    self_timed: bool = False


def _trace_size(p: TraceParams) -> int:
    from loadtest.trace import count_trace

    return count_trace(p.path)


WORKLOADS: Mapping[str, _Def] = {
    "shared-prefix": _Def(
        SharedPrefixParams, _shared_prefix, lambda p: p.num_groups * p.prompts_per_group
    ),
    "multi-turn": _Def(MultiTurnParams, _multi_turn, lambda p: p.num_conversations * p.turns),
    "random": _Def(RandomParams, _random, lambda p: p.num_prompts),
    "output-variance": _Def(
        OutputVarianceParams, _output_variance, lambda p: p.num_prompts, all_at_once=True
    ),
    "long-prompt-mix": _Def(LongPromptMixParams, _long_prompt_mix, lambda p: p.num_prompts),
    "prefix-repetition": _Def(PrefixRepetitionParams, _prefix_repetition, lambda p: p.num_prompts),
    "trace": _Def(TraceParams, _trace, _trace_size, self_timed=True),
}


def _convert(name: str, raw: str | int | float | bool, kind: Any) -> Any:
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return str(raw)
    except ValueError:
        raise WorkloadError(f"parameter {name}: cannot read {raw!r} as {kind.__name__}") from None


def make_workload(
    name: str, overrides: Mapping[str, str | int | float | bool] | None = None, seed: int = 0
) -> Workload:
    """Build workload ``name`` with its defaults, some of them overridden (values may be text)."""
    try:
        definition = WORKLOADS[name]
    except KeyError:
        raise WorkloadError(
            f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}"
        ) from None
    hints = typing.get_type_hints(definition.params_type)
    known = {f.name for f in dataclasses.fields(definition.params_type)}
    values: dict[str, Any] = {}
    for key, raw in (overrides or {}).items():
        field_name = key.replace("-", "_")
        if field_name not in known:
            raise WorkloadError(
                f"workload {name!r} has no parameter {key!r}; it has {', '.join(sorted(known))}"
            )
        values[field_name] = _convert(key, raw, hints[field_name])
    params = definition.params_type(**values)
    return Workload(
        name=name,
        params=params,
        seed=seed,
        natural_size=definition.natural_size(params),
        all_at_once=definition.all_at_once,
        self_timed=definition.self_timed,
        _generate=definition.generate,
    )


def take_requests(workload: Workload, count: int) -> list[RequestSpec]:
    """The first ``count`` requests of single-turn sessions, or first turns of conversations.

    For looking at a workload without a server (tests, ``--dry-run``); conversations need the
    answers, so only their first turn is built here.
    """
    return [s.request(0) for s in itertools.islice(workload.sessions(), count)]
