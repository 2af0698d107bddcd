"""Units of the routing key, and vLLM KV capacity converted into them.

The index counts blocks of the routing key: `block_units` characters (approximate mode, about
`chars_per_token` characters per model token) or `block_units` tokens (token mode).  A vLLM replica
reports its KV capacity as `num_gpu_blocks` blocks of `block_size` tokens
(`vllm:cache_config_info`); this module turns one into the other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KeyUnits"]


@dataclass(frozen=True, slots=True)
class KeyUnits:
    """How routing-key units relate to model tokens."""

    block_units: int = 64
    # Characters per model token in approximate (text) mode; 1.0 in token mode.
    units_per_token: float = 4.0

    def __post_init__(self) -> None:
        if self.block_units <= 0:
            raise ValueError("block_units must be positive")
        if self.units_per_token <= 0:
            raise ValueError("units_per_token must be positive")

    @classmethod
    def token_mode(cls, block_size: int) -> KeyUnits:
        """Units for token mode: blocks of the replicas' `block_size` tokens."""
        return cls(block_units=block_size, units_per_token=1.0)

    def capacity_blocks(self, num_gpu_blocks: int, block_size: int) -> int:
        """A replica's KV capacity (num_gpu_blocks * block_size tokens) in index blocks."""
        if num_gpu_blocks < 0 or block_size <= 0:
            raise ValueError("num_gpu_blocks must be >= 0 and block_size > 0")
        return int(num_gpu_blocks * block_size * self.units_per_token) // self.block_units

    @property
    def tokens_per_block(self) -> int:
        """Tokens per index block when a prompt comes as token ids: as many as `block_units`
        units stand for, so one block means the same KV size whatever form the prompt takes
        (and `capacity_blocks` converts a replica's capacity right for both)."""
        return max(1, round(self.block_units / self.units_per_token))

    def units_to_tokens(self, units: int) -> int:
        """Estimated model tokens in `units` units of the routing key (rounded to nearest)."""
        return round(units / self.units_per_token)

    def blocks_to_tokens(self, blocks: int) -> int:
        """Estimated model tokens in `blocks` index blocks."""
        return round(blocks * self.block_units / self.units_per_token)
