"""Hypothesis: invariants of the engine on small caches, in every mode."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.engine import Engine, EngineRequest
from replicas.sim.kv_events import BlockRemoved, BlockStored, KVEvent
from replicas.sim.tokenizer import output_token

MODEL = CostModel(PROFILES[DEFAULT_PROFILE])

configs = st.builds(
    EngineConfig,
    num_gpu_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(6, 80),
    enable_chunked_prefill=st.booleans(),
    enable_prefix_caching=st.booleans(),
    scheduling=st.sampled_from(["continuous", "static"]),
)
# (prompt tokens drawn from a small alphabet so prefixes repeat, output length, abort after step)
requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, 3), min_size=1, max_size=50),
        st.integers(1, 30),
        st.one_of(st.none(), st.integers(0, 40)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, reqs=requests)
def test_invariants_hold_and_every_admitted_request_completes(
    config: EngineConfig, reqs: list[tuple[list[int], int, int | None]]
) -> None:
    events: list[KVEvent] = []
    engine = Engine(config, MODEL, events.append)
    expected: dict[str, int] = {}
    abort_at: dict[int, list[str]] = {}
    for i, (tokens, n, abort_step) in enumerate(reqs):
        rid = f"r{i}"
        try:
            engine.add_request(EngineRequest(rid, tuple(tokens), n, seed=i))
        except ValueError:
            # Only ever because it can never fit the cache.
            assert -(-(len(tokens) + n - 1) // config.block_size) > config.num_gpu_blocks
            continue
        expected[rid] = n
        if abort_step is not None:
            abort_at.setdefault(abort_step, []).append(rid)
    produced: dict[str, list[int]] = {rid: [] for rid in expected}
    finished: set[str] = set()
    aborted: set[str] = set()
    steps = 0
    while engine.has_unfinished():
        for rid in abort_at.get(steps, []):
            if engine.abort_request(rid):
                aborted.add(rid)
        result = engine.step()
        steps += 1
        assert steps < 20_000
        engine.check_invariants()
        stats = engine.stats()
        assert stats.num_used_blocks <= config.num_gpu_blocks
        assert (
            stats.num_free_blocks + stats.num_cached_free_blocks + stats.num_used_blocks
            == config.num_gpu_blocks
        )
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries
        for out in result.outputs:
            assert out.request_id not in finished
            produced[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
    for rid, n in expected.items():
        if rid in aborted:
            continue
        seed = int(rid[1:])
        assert produced[rid] == [output_token(seed, k) for k in range(n)]
    assert finished | aborted == set(expected)
    assert engine.stats().num_used_blocks == 0
    # Events: every removed hash was stored before; replay gives the cached set.
    cached: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            assert not cached & set(event.block_hashes)
            assert len(event.token_ids) == len(event.block_hashes) * config.block_size
            cached |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= cached
            cached -= set(event.block_hashes)
        else:
            cached.clear()
    assert cached == engine.cached_block_hashes()
    if not config.enable_prefix_caching:
        assert events == []
