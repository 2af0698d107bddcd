"""Workload generators: lengths in sim tokens, sharing structure, determinism."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict

import pytest

from loadtest.text import filler
from loadtest.workloads import (
    SharedPrefixParams,
    WorkloadError,
    make_workload,
    take_requests,
)
from replicas.sim.tokenizer import SimTokenizer

TOK = SimTokenizer()


def ntokens(text: str) -> int:
    return len(TOK.encode(text))


def test_filler_is_exactly_one_sim_token_per_word() -> None:
    import random

    for n in (0, 1, 7, 300):
        assert ntokens(filler(random.Random(n), n)) == n


def test_shared_prefix_defaults_are_sglangs() -> None:
    p = SharedPrefixParams()
    assert (p.num_groups, p.prompts_per_group) == (64, 16)
    assert (p.system_prompt_len, p.question_len, p.output_len) == (2048, 128, 256)
    w = make_workload("shared-prefix")
    assert w.natural_size == 1024
    for spec in take_requests(w, 5):
        assert spec.prompt is not None
        assert ntokens(spec.prompt) == 2048 + 128 == spec.prompt_tokens
        assert spec.max_tokens == 256 and spec.ignore_eos


def test_shared_prefix_sharing_structure() -> None:
    w = make_workload(
        "shared-prefix",
        {"num_groups": 4, "prompts_per_group": 5, "system_prompt_len": 64, "question_len": 16},
        seed=3,
    )
    specs = take_requests(w, w.natural_size)
    assert len(specs) == 20
    by_group: dict[int, list[list[int]]] = defaultdict(list)
    for spec in specs:
        assert spec.prompt is not None and spec.group is not None
        ids = TOK.encode(spec.prompt)
        assert len(ids) == 80
        by_group[spec.group].append(ids)
    assert sorted(len(v) for v in by_group.values()) == [5, 5, 5, 5]
    for prompts in by_group.values():
        # the 64-token system prompt is shared within a group, the questions differ
        assert all(p[:64] == prompts[0][:64] for p in prompts)
        assert len({tuple(p[64:]) for p in prompts}) == 5
    firsts = {tuple(prompts[0][:64]) for prompts in by_group.values()}
    assert len(firsts) == 4  # groups do not share their prefixes
    starts = {prompts[0][0] for prompts in by_group.values()}
    assert len(starts) >= 3  # they differ from the very first token (at most a chance collision)
    order = [s.group for s in specs]
    assert order != sorted(order)  # shuffled


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    for name in ("shared-prefix", "random", "output-variance", "long-prompt-mix", "multi-turn"):
        params = {"num_prompts": 50} if name not in ("shared-prefix", "multi-turn") else {}
        a = take_requests(make_workload(name, params, seed=7), 30)
        b = take_requests(make_workload(name, params, seed=7), 30)
        c = take_requests(make_workload(name, params, seed=8), 30)
        assert a == b, name
        assert a != c, name


def test_shared_prefix_second_pass_keeps_the_prefixes() -> None:
    w = make_workload(
        "shared-prefix",
        {"num_groups": 2, "prompts_per_group": 2, "system_prompt_len": 32, "question_len": 8},
    )
    specs = take_requests(w, 8)  # two passes of 4
    prefixes = Counter((s.group, s.prompt[:128]) for s in specs if s.prompt)
    assert sorted(prefixes.values()) == [4, 4]
    assert len({s.prompt for s in specs}) == 8  # new questions on the second pass


def test_multi_turn_history_grows_with_the_answers() -> None:
    w = make_workload(
        "multi-turn",
        {"num_conversations": 3, "turns": 3, "system_prompt_len": 40, "user_len": 10},
        seed=1,
    )
    session = next(w.sessions())
    assert session.session_key == session.session_id
    first = session.request(0)
    assert first.messages is not None and [r for r, _ in first.messages] == ["system", "user"]
    assert ntokens(first.messages[0][1]) == 40 and ntokens(first.messages[1][1]) == 10
    third = session.request(2, ["answer one", "answer two"])
    assert third.messages is not None
    assert [r for r, _ in third.messages] == [
        "system", "user", "assistant", "user", "assistant", "user",
    ]  # fmt: skip
    assert third.messages[2][1] == "answer one" and third.messages[4][1] == "answer two"
    assert third.messages[:2] == first.messages[:2]
    assert third.session == session.session_id and third.turn == 2
    assert session.turns[0].think_time_s == 0.0
    assert all(t.think_time_s > 0 for t in session.turns[1:])
    with pytest.raises(ValueError):
        session.request(2, ["only one"])
    assert w.natural_size == 9


def test_random_lengths_respect_the_range_ratio_and_prefix() -> None:
    w = make_workload(
        "random",
        {"num_prompts": 100, "input_len": 100, "output_len": 20, "range_ratio": 0.5,
         "prefix_len": 32},
    )  # fmt: skip
    specs = take_requests(w, 100)
    for spec in specs:
        assert spec.prompt is not None
        n = ntokens(spec.prompt) - 32
        assert 50 <= n <= 150
        assert 10 <= spec.max_tokens <= 30
        assert spec.prompt[:128] == specs[0].prompt[:128]  # type: ignore[index]
    assert len({ntokens(s.prompt or "") for s in specs}) > 10
    exact = take_requests(make_workload("random", {"input_len": 64, "output_len": 5}), 10)
    assert {ntokens(s.prompt or "") for s in exact} == {64}
    assert {s.max_tokens for s in exact} == {5}


def test_output_variance_is_exponential_and_capped() -> None:
    w = make_workload("output-variance", {"cap": 1536}, seed=2)
    assert w.all_at_once
    specs = take_requests(w, 2000)
    outs = [s.max_tokens for s in specs]
    assert min(outs) >= 1 and max(outs) <= 1536
    assert 115 <= statistics.mean(outs) <= 141  # mean 128 within ~10%
    assert all(ntokens(s.prompt or "") == 512 for s in specs[:20])
    capped = [
        s.max_tokens for s in take_requests(make_workload("output-variance", {"cap": 32}), 500)
    ]
    assert max(capped) == 32 and capped.count(32) > 250  # P(X >= 32) = e^-0.25 ~ 78%


def test_long_prompt_mix_fraction() -> None:
    w = make_workload(
        "long-prompt-mix", {"short_len": 16, "long_len": 400, "long_fraction": 0.1}, seed=4
    )
    lengths = [ntokens(s.prompt or "") for s in take_requests(w, 600)]
    assert set(lengths) == {16, 400}
    assert 0.06 <= lengths.count(400) / 600 <= 0.14


def test_prefix_repetition_is_vllms() -> None:
    w = make_workload("prefix-repetition", {"num_prompts": 100})
    specs = take_requests(w, 100)
    groups = Counter(s.group for s in specs)
    assert len(groups) == 10 and set(groups.values()) == {10}
    for spec in specs:
        assert ntokens(spec.prompt or "") == 512 and spec.max_tokens == 128
    by_group = defaultdict(set)
    for s in specs:
        by_group[s.group].add((s.prompt or "")[: 256 * 4])
    assert all(len(v) == 1 for v in by_group.values())


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("nope", {}, "unknown workload"),
        ("shared-prefix", {"groups": 3}, "no parameter"),
        ("shared-prefix", {"num_groups": "x"}, "cannot read"),
        ("shared-prefix", {"num_groups": 0}, "must be > 0"),
        ("random", {"range_ratio": 1.5}, "range_ratio"),
        ("trace", {}, "--trace"),
    ],
)
def test_bad_workload_parameters(name: str, params: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        make_workload(name, params)  # type: ignore[arg-type]


def test_sessions_are_endless_for_generated_workloads() -> None:
    w = make_workload("shared-prefix", {"num_groups": 1, "prompts_per_group": 1})
    assert len(list(itertools.islice(w.sessions(), 5))) == 5
