"""GPU cost model: how long one engine step takes on a named GPU profile.

One step processes ``D`` decode tokens (one per running sequence, each attending to ``ctx_j``
tokens including itself) and prefill chunks ``(n_i, c_i)`` (``n_i`` new prompt tokens after ``c_i``
tokens already in the KV cache). With ``T = D + sum(n_i)``::

    pairs  = sum_j ctx_j + sum_i (n_i * c_i + n_i * (n_i + 1) / 2)      # causal attention pairs
    kv     = sum_j ctx_j + sum_i (c_i + n_i)                            # KV tokens read/written
    flops  = flops_per_token * T + attention_flops_per_pair * pairs
    bytes  = weight_bytes + kv_bytes_per_token * kv
    t_mem  = bytes / (hbm_bandwidth_bytes_per_s * bandwidth_efficiency)
    t_comp = flops / (peak_flops * compute_efficiency)
    step   = step_overhead_s + max(t_mem, t_comp)        (0 when T == 0)

The max is the roofline: a step is bound either by streaming the weights and KV cache from HBM
(decode) or by matrix-multiply throughput (prefill). docs/simulator.md explains the calibration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "DEFAULT_PROFILE",
    "PROFILES",
    "CostModel",
    "GpuProfile",
    "profile_with_overrides",
]


@dataclass(frozen=True)
class GpuProfile:
    """A GPU + model pair: the constants of the roofline and the replica's default limits."""

    name: str
    weight_bytes: float
    kv_bytes_per_token: float
    hbm_bandwidth_bytes_per_s: float
    bandwidth_efficiency: float
    peak_flops: float
    compute_efficiency: float
    flops_per_token: float
    attention_flops_per_pair: float
    step_overhead_s: float
    default_num_gpu_blocks: int
    default_max_num_batched_tokens: int
    default_max_num_seqs: int
    gpu_memory_bytes: float = 0.0  # informational: the memory the KV capacity was derived from

    def __post_init__(self) -> None:
        positive = (
            "weight_bytes",
            "kv_bytes_per_token",
            "hbm_bandwidth_bytes_per_s",
            "peak_flops",
            "flops_per_token",
        )
        for field in positive:
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)!r}")
        for field in ("bandwidth_efficiency", "compute_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"{field} must be in (0, 1], got {value!r}")
        if self.attention_flops_per_pair < 0:
            raise ValueError("attention_flops_per_pair must be >= 0")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")
        for field in (
            "default_num_gpu_blocks",
            "default_max_num_batched_tokens",
            "default_max_num_seqs",
        ):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{field} must be >= 1")


# Llama-3.1-8B in bf16: 8.03e9 parameters, 32 layers, 32 query heads and 8 KV heads of dim 128.
_LLAMA3_8B_PARAMS = 8.03e9
_LLAMA3_8B = {
    "weight_bytes": 2 * _LLAMA3_8B_PARAMS,  # 16.06 GB
    "kv_bytes_per_token": 2 * 32 * 8 * 128 * 2,  # K and V, 32 layers, 8 KV heads, dim 128: 128 KiB
    "flops_per_token": 2 * _LLAMA3_8B_PARAMS,  # one multiply-add per parameter
    # QK^T and AV: 2 matmuls x 2 FLOPs x 32 layers x 32 heads x 128 dims per (query, key) pair.
    "attention_flops_per_pair": 4 * 32 * 32 * 128,
}

PROFILES: Mapping[str, GpuProfile] = MappingProxyType(
    {
        "h100-llama3-8b": GpuProfile(
            name="h100-llama3-8b",
            hbm_bandwidth_bytes_per_s=3.35e12,
            bandwidth_efficiency=0.7,
            peak_flops=989e12,  # bf16 dense, SXM
            compute_efficiency=0.5,  # ~31k prefill tokens/s
            step_overhead_s=0.001,
            default_num_gpu_blocks=26_880,  # ~430k tokens at 90% of 80 GB
            default_max_num_batched_tokens=8192,
            default_max_num_seqs=1024,
            gpu_memory_bytes=80e9,
            **_LLAMA3_8B,
        ),
        "h200-llama3-8b": GpuProfile(
            name="h200-llama3-8b",
            hbm_bandwidth_bytes_per_s=4.8e12,
            bandwidth_efficiency=0.7,
            peak_flops=989e12,  # same GH100 compute as the H100
            compute_efficiency=0.5,
            step_overhead_s=0.001,
            default_num_gpu_blocks=55_000,  # ~880k tokens at 90% of 141 GB
            default_max_num_batched_tokens=8192,
            default_max_num_seqs=1024,
            gpu_memory_bytes=141e9,
            **_LLAMA3_8B,
        ),
        "a100-llama3-8b": GpuProfile(
            name="a100-llama3-8b",
            hbm_bandwidth_bytes_per_s=2.0e12,  # A100 80 GB SXM
            bandwidth_efficiency=0.7,
            peak_flops=312e12,
            compute_efficiency=0.5,
            step_overhead_s=0.001,
            default_num_gpu_blocks=26_880,  # the 80 GB part: same memory as the H100
            default_max_num_batched_tokens=2048,
            default_max_num_seqs=256,
            gpu_memory_bytes=80e9,
            **_LLAMA3_8B,
        ),
    }
)
DEFAULT_PROFILE = "h100-llama3-8b"


def profile_with_overrides(name: str, **overrides: float) -> GpuProfile:
    """The named profile with some parameters replaced (``KeyError``-free: ``ValueError``)."""
    try:
        base = PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown GPU profile {name!r}; known: {known}") from None
    fields = {f.name: f.type for f in dataclasses.fields(GpuProfile)}
    changes: dict[str, object] = {}
    for key, value in overrides.items():
        if key not in fields or key == "name":
            raise ValueError(f"unknown or read-only profile parameter {key!r}")
        changes[key] = int(value) if key.startswith("default_") else float(value)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


class CostModel:
    """Step durations under a `GpuProfile` (the formula is in the module docstring)."""

    __slots__ = (
        "_attn",
        "_comp_rate",
        "_fpt",
        "_kvb",
        "_mem_rate",
        "_overhead",
        "_weights",
        "profile",
    )

    def __init__(self, profile: GpuProfile) -> None:
        self.profile = profile
        self._weights = float(profile.weight_bytes)
        self._kvb = float(profile.kv_bytes_per_token)
        self._fpt = float(profile.flops_per_token)
        self._attn = float(profile.attention_flops_per_pair)
        self._mem_rate = profile.hbm_bandwidth_bytes_per_s * profile.bandwidth_efficiency
        self._comp_rate = profile.peak_flops * profile.compute_efficiency
        self._overhead = float(profile.step_overhead_s)

    def step_time_s(
        self, decode_contexts: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]
    ) -> float:
        """Duration of one step; ``prefill_chunks`` holds ``(new_tokens, context_before)``."""
        return self.step_time_totals_s(len(decode_contexts), sum(decode_contexts), prefill_chunks)

    def step_time_totals_s(
        self,
        num_decode: int,
        decode_context_sum: int,
        prefill_chunks: Sequence[tuple[int, int]],
    ) -> float:
        """`step_time_s` from the number of decodes and the sum of their contexts (the engine's
        fast path: the formula is linear in the decode contexts)."""
        tokens = num_decode
        pairs = decode_context_sum
        kv = decode_context_sum
        for new, before in prefill_chunks:
            tokens += new
            pairs += new * before + new * (new + 1) // 2
            kv += before + new
        if tokens <= 0:
            return 0.0
        t_mem = (self._weights + self._kvb * kv) / self._mem_rate
        t_comp = (self._fpt * tokens + self._attn * pairs) / self._comp_rate
        return self._overhead + (t_mem if t_mem > t_comp else t_comp)

    def decode_time_s(self, decode_contexts: Sequence[int]) -> float:
        """A decode-only step."""
        return self.step_time_s(decode_contexts, ())

    def prefill_time_s(self, prefill_chunks: Sequence[tuple[int, int]]) -> float:
        """A prefill-only step."""
        return self.step_time_s((), prefill_chunks)
