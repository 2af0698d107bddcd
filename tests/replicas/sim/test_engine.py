"""Engine behaviour: the API contract, scheduling modes, prefix caching, abort, determinism."""

from __future__ import annotations

import dataclasses
import random

import pytest

from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.engine import Engine, EngineRequest, RequestOutput, StepResult
from replicas.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from replicas.sim.tokenizer import output_token

MODEL = CostModel(PROFILES[DEFAULT_PROFILE])


def make(events: list[KVEvent] | None = None, **config: object) -> Engine:
    base: dict[str, object] = {
        "num_gpu_blocks": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
    }
    base.update(config)
    return Engine(EngineConfig(**base), MODEL, events.append if events is not None else None)  # type: ignore[arg-type]


def prompt(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def drive(
    engine: Engine, max_steps: int = 100_000
) -> tuple[list[StepResult], dict[str, list[RequestOutput]]]:
    """Step to completion, checking invariants after every step."""
    steps: list[StepResult] = []
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        result = engine.step()
        engine.check_invariants()
        steps.append(result)
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).append(out)
        assert len(steps) < max_steps
    return steps, outputs


# --- contract -----------------------------------------------------------------------------------
def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        EngineConfig(num_gpu_blocks=0)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        EngineConfig(num_gpu_blocks=10, max_num_seqs=512, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="scheduling"):
        EngineConfig(num_gpu_blocks=10, scheduling="eager")  # type: ignore[arg-type]
    config = EngineConfig.for_profile(PROFILES["a100-llama3-8b"], block_size=32)
    assert (config.num_gpu_blocks, config.max_num_batched_tokens, config.block_size) == (
        26_880,
        2048,
        32,
    )


def test_add_request_rejects_bad_requests() -> None:
    engine = make(num_gpu_blocks=4, block_size=16)  # 64 tokens of KV
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request(EngineRequest("a", (), 4))
    with pytest.raises(ValueError, match="output_tokens"):
        engine.add_request(EngineRequest("a", (1,), 0))
    with pytest.raises(ValueError, match="finish_reason"):
        engine.add_request(EngineRequest("a", (1,), 1, finish_reason="eos"))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(EngineRequest("a", (1, -5), 1))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(EngineRequest("a", (1,), 5, max_tokens=4))
    # 60 prompt + 5 output - 1 = 64 tokens fits exactly; one more does not.
    engine.add_request(EngineRequest("fits", prompt(60), 5))
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request(EngineRequest("too-big", prompt(60), 6))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineRequest("fits", prompt(3), 1))
    drive(engine)


def test_idle_step_is_empty() -> None:
    engine = make()
    result = engine.step()
    assert result == StepResult(0.0, (), 0, 0, ())
    assert not engine.has_unfinished()


def test_every_request_gets_exactly_its_tokens_in_order() -> None:
    engine = make()
    for i in range(12):
        engine.add_request(
            EngineRequest(f"r{i}", prompt(50 + i, i), 10 + 3 * i, finish_reason="stop", seed=i)
        )
    _, outputs = drive(engine)
    for i in range(12):
        outs = outputs[f"r{i}"]
        tokens = [t for o in outs for t in o.new_token_ids]
        assert tokens == [output_token(i, k) for k in range(10 + 3 * i)]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "stop"
        assert all(o.finish_reason is None for o in outs[:-1])
        assert all(o.num_prompt_tokens == 50 + i for o in outs)
    stats = engine.stats()
    assert stats.generation_tokens == sum(10 + 3 * i for i in range(12))
    assert stats.prompt_tokens == sum(50 + i for i in range(12))
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
    assert stats.num_free_blocks + stats.num_cached_free_blocks == stats.num_gpu_blocks


def test_same_inputs_same_run() -> None:
    def run() -> list[StepResult]:
        engine = make(num_gpu_blocks=40)
        rng = random.Random(5)
        for i in range(30):
            p = tuple(rng.randrange(100) for _ in range(rng.randint(1, 120)))
            engine.add_request(EngineRequest(f"r{i}", p, rng.randint(1, 60), seed=i))
        return drive(engine)[0]

    first, second = run(), run()
    assert first == second
    assert any(s.preempted for s in first)  # the small cache made it interesting


def test_step_and_step_summary_agree() -> None:
    def load(engine: Engine) -> None:
        for i in range(20):
            engine.add_request(EngineRequest(f"r{i}", prompt(40 + 7 * i, i), 5 + 11 * i % 50))

    a, b = make(num_gpu_blocks=48), make(num_gpu_blocks=48)
    load(a)
    load(b)
    while a.has_unfinished():
        full, summary = a.step(), b.step_summary()
        assert full.duration_s == summary.duration_s
        assert full.num_decode_tokens == summary.num_decode_tokens
        assert full.num_prefill_tokens == summary.num_prefill_tokens
        assert len(full.outputs) == summary.num_decode_tokens + len(summary.first_tokens)
        assert {o.request_id for o in full.outputs if o.finished} == {
            r.request_id for r in summary.finished
        }
    assert not b.has_unfinished()
    assert a.stats() == b.stats()


@pytest.mark.parametrize(
    "config",
    [
        {"num_gpu_blocks": 40},  # preempts: a re-admitted request is not scheduled "again"
        {"enable_chunked_prefill": False},
        {"scheduling": "static", "max_num_seqs": 3},
    ],
)
def test_scheduled_lists_each_request_once_in_its_admission_step(config: dict[str, object]) -> None:
    engine = make(**config)
    rng = random.Random(7)
    for i in range(24):
        p = tuple(rng.randrange(500) for _ in range(rng.randint(1, 150)))
        engine.add_request(EngineRequest(f"r{i}", p, rng.randint(1, 40), seed=i))
    seen: list[str] = []
    first_output: dict[str, int] = {}
    preempted = False
    step_no = 0
    while engine.has_unfinished():
        waiting_before = set(engine.request_ids_waiting())
        result = engine.step()
        step_no += 1
        preempted |= bool(result.preempted)
        for rid in result.scheduled:
            assert rid in waiting_before  # it was queued when the step began
            assert rid in engine.request_ids_running() or any(
                o.request_id == rid and o.finished for o in result.outputs
            )
        seen.extend(result.scheduled)
        for out in result.outputs:
            first_output.setdefault(out.request_id, step_no)
        assert set(first_output) <= set(seen)  # no token before admission
    assert sorted(seen) == sorted(f"r{i}" for i in range(24))  # each exactly once
    assert preempted or "num_gpu_blocks" not in config
    # FCFS: admission order is arrival order (preempted requests do not reappear)
    assert seen == [f"r{i}" for i in range(24)]


def test_step_summary_reports_the_same_admissions() -> None:
    a, b = make(num_gpu_blocks=48), make(num_gpu_blocks=48)
    for engine in (a, b):
        for i in range(20):
            engine.add_request(EngineRequest(f"r{i}", prompt(40 + 7 * i, i), 5 + 11 * i % 50))
    while a.has_unfinished():
        full, summary = a.step(), b.step_summary()
        assert full.scheduled == tuple(r.request_id for r in summary.scheduled)


# --- scheduling ---------------------------------------------------------------------------------
def test_continuous_decodes_first_then_chunks_prefills_within_budget() -> None:
    engine = make(max_num_batched_tokens=100, max_num_seqs=4)
    engine.add_request(EngineRequest("short", prompt(30), 50))
    engine.step()  # prefill "short" whole
    engine.add_request(EngineRequest("long", prompt(250, 1000), 5))
    budgets = []
    while "long" in engine.request_ids_running() or engine.request_ids_waiting():
        result = engine.step()
        budgets.append((result.num_decode_tokens, result.num_prefill_tokens))
        if any(o.request_id == "long" for o in result.outputs):
            break
    # One decode rides along every chunk; chunks fill the rest of the 100-token budget.
    assert budgets == [(1, 99), (1, 99), (1, 52)]


def test_max_num_seqs_caps_the_running_set() -> None:
    engine = make(max_num_seqs=3)
    for i in range(7):
        engine.add_request(EngineRequest(f"r{i}", prompt(10, 100 * i), 20))
    engine.step()
    assert engine.request_ids_running() == ["r0", "r1", "r2"]
    assert engine.stats().num_waiting == 4
    drive(engine)


def test_without_chunking_a_prompt_gets_a_step_of_its_own() -> None:
    engine = make(enable_chunked_prefill=False, max_num_batched_tokens=64)
    engine.add_request(EngineRequest("a", prompt(20), 30))
    engine.step()
    engine.step()
    engine.add_request(EngineRequest("b", prompt(500, 1000), 3))  # longer than the budget
    stall = engine.step()
    assert (stall.num_decode_tokens, stall.num_prefill_tokens) == (0, 500)
    assert [o.request_id for o in stall.outputs] == ["b"]
    assert stall.duration_s == pytest.approx(MODEL.prefill_time_s([(500, 0)]))
    resumed = engine.step()
    assert resumed.num_decode_tokens == 2 and resumed.num_prefill_tokens == 0


def test_static_batch_runs_until_its_longest_member_and_nobody_joins() -> None:
    engine = make(scheduling="static", max_num_seqs=3)
    lengths = {"a": 5, "b": 40, "c": 12, "d": 3, "e": 3}
    for rid, n in lengths.items():
        engine.add_request(EngineRequest(rid, prompt(16, ord(rid) * 100), n))
    running_history = []
    finished_at = {}
    for step_no in range(1, 200):
        result = engine.step()
        running_history.append(tuple(engine.request_ids_running()))
        for o in result.outputs:
            if o.finished:
                finished_at[o.request_id] = step_no
        if not engine.has_unfinished():
            break
    # d and e wait for the whole first batch, although a and c left early.
    assert min(finished_at["d"], finished_at["e"]) > finished_at["b"]
    first_batch = [r for r in running_history if r and r[0] in "abc"]
    assert all(set(r) <= {"a", "b", "c"} for r in first_batch)
    assert ("b",) in running_history  # b decodes alone: the bubble


def test_static_reserves_kv_for_max_tokens() -> None:
    engine = make(scheduling="static", num_gpu_blocks=10, block_size=16, max_num_seqs=8)
    for i in range(4):
        # 16 prompt + 64 max_tokens - 1 = 79 tokens = 5 blocks reserved, though 2 are used.
        engine.add_request(EngineRequest(f"r{i}", prompt(16, 100 * i), 2, max_tokens=64))
    engine.step()
    assert len(engine.request_ids_running()) == 2
    assert engine.stats().num_used_blocks == 10
    drive(engine)


# --- KV cache, prefix caching, preemption --------------------------------------------------------
def test_shared_prefix_hits_block_aligned_and_counts_tokens() -> None:
    engine = make(num_gpu_blocks=64, block_size=16, max_num_batched_tokens=512)
    shared = prompt(100, 5000)
    engine.add_request(EngineRequest("a", shared + prompt(20), 2))
    _, out_a = drive(engine)
    engine.add_request(EngineRequest("b", shared + prompt(20, 7000), 2))
    _, out_b = drive(engine)
    assert out_a["a"][0].num_cached_tokens == 0
    assert out_b["b"][0].num_cached_tokens == 96  # 100 shared tokens, 6 full blocks
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (240, 96)


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    engine = make(block_size=16)
    engine.add_request(EngineRequest("a", prompt(64), 1))
    drive(engine)
    engine.add_request(EngineRequest("b", prompt(64), 1))
    steps, out = drive(engine)
    assert out["b"][0].num_cached_tokens == 48  # the last block is recomputed, like vLLM
    assert steps[0].num_prefill_tokens == 16


def test_cache_salt_separates_tenants() -> None:
    engine = make()
    engine.add_request(EngineRequest("a", prompt(64), 1, cache_salt="tenant-1"))
    drive(engine)
    engine.add_request(EngineRequest("b", prompt(64), 1, cache_salt="tenant-2"))
    engine.add_request(EngineRequest("c", prompt(64), 1, cache_salt="tenant-1"))
    _, out = drive(engine)
    assert out["b"][0].num_cached_tokens == 0
    assert out["c"][0].num_cached_tokens == 48


def test_prefix_caching_off_means_no_reuse_and_no_events() -> None:
    events: list[KVEvent] = []
    engine = make(events, enable_prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, prompt(64), 3))
        drive(engine)
    assert events == []
    stats = engine.stats()
    assert stats.prefix_cache_hits == 0 and stats.num_cached_free_blocks == 0


def test_decode_blocks_are_stored_with_the_generated_tokens() -> None:
    events: list[KVEvent] = []
    engine = make(events, block_size=4)
    engine.add_request(EngineRequest("a", (9, 9, 9, 9, 9, 9), 8, seed=3))
    drive(engine)
    stored = [e for e in events if isinstance(e, BlockStored)]
    tokens = [t for e in stored for t in e.token_ids]
    generated = [output_token(3, k) for k in range(8)]
    # 6 + 8 - 1 = 13 tokens have KV: 3 full blocks.
    assert tokens == ([9] * 6 + generated)[:12]
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == 3 == len(set(hashes))
    for event in stored:
        index = hashes.index(event.block_hashes[0])
        assert event.parent_block_hash == (hashes[index - 1] if index else None)
        assert event.block_size == 4 and event.medium == "GPU"


def test_pressure_evicts_and_preempts_yet_everything_completes() -> None:
    events: list[KVEvent] = []
    engine = make(
        events, num_gpu_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=48
    )
    rng = random.Random(1)
    expected = {}
    system = tuple(rng.randrange(50) for _ in range(12))
    for i in range(40):
        p = system + tuple(rng.randrange(50) for _ in range(rng.randint(1, 30)))
        n = rng.randint(1, 40)
        expected[f"r{i}"] = n
        engine.add_request(EngineRequest(f"r{i}", p, n, seed=i))
    steps, outputs = drive(engine)
    assert {k: sum(len(o.new_token_ids) for o in v) for k, v in outputs.items()} == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert sum(len(s.preempted) for s in steps) == stats.num_preemptions
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert 0 < stats.prefix_cache_hits <= stats.prefix_cache_queries
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_free_blocks == 24
    replayed: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            replayed |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= replayed  # removed only after being stored
            replayed -= set(event.block_hashes)
    assert replayed == engine.cached_block_hashes()


def test_the_newest_running_request_is_preempted() -> None:
    engine = make(num_gpu_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    for i, rid in enumerate(("old", "mid", "new")):
        engine.add_request(EngineRequest(rid, prompt(7, 100 * i), 9))
    first = engine.step()
    assert first.num_prefill_tokens == 21
    preempted: list[str] = []
    while engine.has_unfinished():
        preempted.extend(engine.step().preempted)
        engine.check_invariants()
    assert preempted[0] == "new"


def test_clear_prefix_cache() -> None:
    events: list[KVEvent] = []
    engine = make(events)
    engine.add_request(EngineRequest("a", prompt(64), 1))
    drive(engine)
    assert engine.cached_block_hashes()
    assert engine.clear_prefix_cache()
    assert events[-1] == AllBlocksCleared()
    assert engine.cached_block_hashes() == set()
    engine.add_request(EngineRequest("b", prompt(64), 1))
    _, out = drive(engine)
    assert out["b"][0].num_cached_tokens == 0


# --- abort --------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_abort_frees_blocks_at_any_time(scheduling: str) -> None:
    engine = make(scheduling=scheduling, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        engine.add_request(EngineRequest(f"r{i}", prompt(100, 1000 * i), 50))
    engine.step()  # r0 is being prefilled (chunked) or r0 and r1 hold reservations
    used_before = engine.stats().num_used_blocks
    assert used_before > 0
    assert engine.abort_request("r0") is True
    assert engine.stats().num_used_blocks < used_before
    assert engine.abort_request("r0") is False  # already gone
    assert engine.abort_request("nobody") is False
    assert engine.abort_request("r3") is True  # still waiting
    engine.check_invariants()
    _, outputs = drive(engine)
    assert set(outputs) == {"r1", "r2"}
    assert engine.abort_request("r1") is False  # finished
    stats = engine.stats()
    assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)


def test_abort_a_decoding_request_mid_stream() -> None:
    engine = make()
    engine.add_request(EngineRequest("a", prompt(40), 100))
    engine.add_request(EngineRequest("b", prompt(40, 500), 100))
    for _ in range(30):
        engine.step()
    assert engine.abort_request("a")
    engine.check_invariants()
    steps, outputs = drive(engine)
    assert "a" not in outputs
    assert sum(len(o.new_token_ids) for o in outputs["b"]) == 100 - 30
    assert all(s.num_decode_tokens <= 1 for s in steps)


def test_output_dataclasses_are_frozen() -> None:
    out = RequestOutput("a", (1,), 3, 0, False, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.finished = True  # type: ignore[misc]


def test_block_hashes_depend_on_the_hash_seed_only() -> None:
    def stored(seed: int) -> list[int]:
        events: list[KVEvent] = []
        engine = make(events, hash_seed=seed)
        engine.add_request(EngineRequest("a", prompt(64), 1))
        drive(engine)
        return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]

    assert stored(1) == stored(1)
    assert stored(1) != stored(2)
    assert all(0 <= h < 2**64 for h in stored(1))
