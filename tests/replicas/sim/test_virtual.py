"""The virtual-time driver: timings follow the cost model exactly; idle gaps are skipped."""

from __future__ import annotations

import pytest

from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES, CostModel
from replicas.sim.engine import Engine, EngineRequest
from replicas.sim.virtual import percentile, run_virtual

MODEL = CostModel(PROFILES[DEFAULT_PROFILE])


def engine(**config: object) -> Engine:
    base: dict[str, object] = {"num_gpu_blocks": 1024, "max_num_seqs": 16}
    base.update(config)
    return Engine(EngineConfig(**base), MODEL)  # type: ignore[arg-type]


def test_single_request_timeline_is_the_formula() -> None:
    run = run_virtual(engine(), [(2.0, EngineRequest("a", tuple(range(100)), 5))])
    a = run.requests["a"]
    prefill = MODEL.prefill_time_s([(100, 0)])
    assert a.arrival_s == 2.0
    assert a.ttft_s == pytest.approx(prefill)
    # Decode k attends to the 100 prompt tokens plus k generated ones.
    decodes = [MODEL.decode_time_s([101 + k]) for k in range(4)]
    assert a.itls() == pytest.approx(decodes)
    assert a.e2e_s == pytest.approx(prefill + sum(decodes))
    assert a.num_output_tokens == 5 == len(a.token_times)
    assert a.tpot_s == pytest.approx(sum(decodes) / 4)
    assert run.duration_s == pytest.approx(a.e2e_s)


def test_idle_gaps_jump_to_the_next_arrival() -> None:
    arrivals = [
        (0.0, EngineRequest("a", (1, 2, 3), 2)),
        (100.0, EngineRequest("b", (4, 5, 6), 2)),
    ]
    run = run_virtual(engine(), arrivals)
    assert run.requests["b"].first_token_s == pytest.approx(100.0 + MODEL.prefill_time_s([(3, 0)]))
    assert run.requests["a"].finish_s is not None and run.requests["a"].finish_s < 1.0
    assert run.num_steps == 4


def test_token_times_survive_preemption_and_count_every_token() -> None:
    eng = engine(num_gpu_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    arrivals = [(0.001 * i, EngineRequest(f"r{i}", tuple(range(i, i + 9)), 20)) for i in range(6)]
    run = run_virtual(eng, arrivals)
    assert sum(r.num_preemptions for r in run.requests.values()) > 0
    for r in run.requests.values():
        times = r.token_times
        assert len(times) == r.num_output_tokens == 20
        assert times == sorted(times)
        assert times[0] == r.first_token_s and times[-1] == r.finish_s
    assert run.output_tokens == 120
    assert run.output_throughput_tok_s == pytest.approx(120 / run.duration_s)


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    with pytest.raises(ValueError):
        percentile([], 50)
