"""Engine configuration: the scheduler and KV-cache knobs of one simulated replica.

These mirror vLLM's flags (`--num-gpu-blocks-override`, `--block-size`, `--max-num-seqs`,
`--max-num-batched-tokens`, `--enable-chunked-prefill`, `--enable-prefix-caching`) plus the
`scheduling` mode of the simulator ("static" is the pre-vLLM batching baseline).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from replicas.sim.cost_model import GpuProfile

__all__ = ["EngineConfig", "SchedulingMode"]

SchedulingMode = Literal["continuous", "static"]


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and paged-KV settings, validated on construction (``ValueError``)."""

    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling: SchedulingMode = "continuous"
    # Seed of the block-hash chain; like vLLM's PYTHONHASHSEED it only changes hash values.
    hash_seed: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(
            isinstance(self.num_gpu_blocks, int) and self.num_gpu_blocks >= 1,
            f"num_gpu_blocks must be an integer >= 1, got {self.num_gpu_blocks!r}",
        )
        need(
            isinstance(self.block_size, int) and self.block_size >= 1,
            f"block_size must be an integer >= 1, got {self.block_size!r}",
        )
        need(
            isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
            f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}",
        )
        need(
            isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}",
        )
        # vLLM refuses this too: every running sequence must be able to decode in each step.
        need(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
            f"max_num_seqs ({self.max_num_seqs})",
        )
        need(
            self.scheduling in ("continuous", "static"),
            f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}",
        )
        need(
            isinstance(self.hash_seed, int), f"hash_seed must be an integer, got {self.hash_seed!r}"
        )

    @property
    def capacity_tokens(self) -> int:
        """KV capacity in tokens."""
        return self.num_gpu_blocks * self.block_size

    @classmethod
    def for_profile(cls, profile: GpuProfile, **overrides: object) -> EngineConfig:
        """The profile's default capacity and limits, with some fields overridden."""
        base = cls(
            num_gpu_blocks=profile.default_num_gpu_blocks,
            max_num_seqs=profile.default_max_num_seqs,
            max_num_batched_tokens=profile.default_max_num_batched_tokens,
        )
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
