"""The cost model equals the formula documented in docs/simulator.md, and is calibrated."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replicas.sim.cost_model import (
    DEFAULT_PROFILE,
    PROFILES,
    CostModel,
    GpuProfile,
    profile_with_overrides,
)


def documented_step_time(
    p: GpuProfile, decode_contexts: list[int], prefill_chunks: list[tuple[int, int]]
) -> float:
    """docs/simulator.md, written out independently of the implementation."""
    tokens = len(decode_contexts) + sum(n for n, _ in prefill_chunks)
    if tokens == 0:
        return 0.0
    pairs = sum(decode_contexts) + sum(n * c + n * (n + 1) / 2 for n, c in prefill_chunks)
    kv = sum(decode_contexts) + sum(c + n for n, c in prefill_chunks)
    flops = p.flops_per_token * tokens + p.attention_flops_per_pair * pairs
    nbytes = p.weight_bytes + p.kv_bytes_per_token * kv
    t_mem = nbytes / (p.hbm_bandwidth_bytes_per_s * p.bandwidth_efficiency)
    t_comp = flops / (p.peak_flops * p.compute_efficiency)
    return p.step_overhead_s + max(t_mem, t_comp)


@pytest.mark.parametrize("name", sorted(PROFILES))
@given(
    decodes=st.lists(st.integers(1, 200_000), max_size=64),
    chunks=st.lists(st.tuples(st.integers(1, 16_384), st.integers(0, 100_000)), max_size=4),
)
def test_step_time_equals_documented_formula(
    name: str, decodes: list[int], chunks: list[tuple[int, int]]
) -> None:
    p = PROFILES[name]
    model = CostModel(p)
    expected = documented_step_time(p, decodes, chunks)
    assert model.step_time_s(decodes, chunks) == pytest.approx(expected, rel=1e-12)
    assert model.step_time_totals_s(len(decodes), sum(decodes), chunks) == pytest.approx(
        expected, rel=1e-12
    )


def test_decode_and_prefill_helpers_are_the_formula_with_one_side_empty() -> None:
    p = PROFILES[DEFAULT_PROFILE]
    model = CostModel(p)
    assert model.decode_time_s([1000, 2000]) == pytest.approx(
        documented_step_time(p, [1000, 2000], [])
    )
    assert model.prefill_time_s([(2048, 0), (512, 100)]) == pytest.approx(
        documented_step_time(p, [], [(2048, 0), (512, 100)])
    )
    assert model.step_time_s([], []) == 0.0


def test_h100_calibration_matches_the_reference_numbers() -> None:
    p = PROFILES["h100-llama3-8b"]
    model = CostModel(p)
    # Weights-only floor at full bandwidth: ~4.8 ms.
    assert p.weight_bytes / p.hbm_bandwidth_bytes_per_s == pytest.approx(4.8e-3, rel=0.02)
    # KV per token of Llama-3.1-8B: 128 KiB.
    assert p.kv_bytes_per_token == 128 * 1024
    # Prefill throughput 25-40k tokens/s.
    rate = 8192 / model.prefill_time_s([(8192, 0)])
    assert 25_000 <= rate <= 40_000
    # A decode step of 48 sequences at 2k context lands on the observed ~13 ms ITL.
    assert model.decode_time_s([2048] * 48) == pytest.approx(13e-3, rel=0.05)
    # ~27k blocks of 16 tokens (~430k tokens).
    assert p.default_num_gpu_blocks * 16 == pytest.approx(430_000, rel=0.01)


def test_profiles_rank_as_their_hardware() -> None:
    h100, h200, a100 = (
        CostModel(PROFILES[n]) for n in ("h100-llama3-8b", "h200-llama3-8b", "a100-llama3-8b")
    )
    ctx = [1024] * 32
    assert h200.decode_time_s(ctx) < h100.decode_time_s(ctx) < a100.decode_time_s(ctx)
    assert h100.prefill_time_s([(4096, 0)]) < a100.prefill_time_s([(4096, 0)])
    assert PROFILES["h200-llama3-8b"].default_num_gpu_blocks == 55_000
    assert PROFILES["a100-llama3-8b"].peak_flops == 312e12


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    p = PROFILES[DEFAULT_PROFILE]
    model = CostModel(p)
    mem_only = p.step_overhead_s + p.weight_bytes / (
        p.hbm_bandwidth_bytes_per_s * p.bandwidth_efficiency
    )
    assert model.decode_time_s([1]) == pytest.approx(mem_only, rel=1e-3)
    # A long prefill grows linearly (plus attention), far above the memory floor.
    assert model.prefill_time_s([(8192, 0)]) > 20 * mem_only


def test_profile_with_overrides() -> None:
    p = profile_with_overrides("h100-llama3-8b", step_overhead_s=0.004, default_num_gpu_blocks=100)
    assert p.step_overhead_s == 0.004
    assert p.default_num_gpu_blocks == 100
    assert p.hbm_bandwidth_bytes_per_s == PROFILES["h100-llama3-8b"].hbm_bandwidth_bytes_per_s
    assert dataclasses.replace(p, bandwidth_efficiency=0.5).bandwidth_efficiency == 0.5
    with pytest.raises(ValueError, match="unknown GPU profile"):
        profile_with_overrides("tpu-v9")
    with pytest.raises(ValueError, match="unknown or read-only"):
        profile_with_overrides("h100-llama3-8b", warp_speed=9)
    with pytest.raises(ValueError, match="bandwidth_efficiency"):
        profile_with_overrides("h100-llama3-8b", bandwidth_efficiency=1.5)
