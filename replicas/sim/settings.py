"""Every knob of one simulated replica, validated in one place.

`SimSettings` mirrors the CLI flag for flag (see `replicas.sim.cli`). Values that vLLM derives from
the GPU (KV capacity, step budget, max running sequences) default to ``None`` here and are resolved
from the GPU profile when the engine is built (`replicas.sim.runtime.build_engine`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_CONTEXT_TOKENS",
    "KVEventsEncoding",
    "Scheduling",
    "SettingsError",
    "SimSettings",
]

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# Llama-3.1's native context; vLLM caps max_model_len by the model config and refuses to start
# when the KV cache cannot hold one full-length sequence, so we cap by KV capacity too.
MODEL_CONTEXT_TOKENS = 131_072

Scheduling = Literal["continuous", "static"]
KVEventsEncoding = Literal["array", "map"]
OutputLengthKind = Literal["exponential", "uniform", "fixed"]


class SettingsError(ValueError):
    """A setting is out of range or inconsistent with another one."""


@dataclass(frozen=True)
class SimSettings:
    """Configuration of one simulated vLLM replica (units in names, ``None`` = derive a default)."""

    # --- HTTP ---------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = DEFAULT_MODEL
    # Extra names the replica answers to, like several `--served-model-name`s in vLLM.
    model_aliases: tuple[str, ...] = ()
    max_model_len: int | None = None

    # --- engine -------------------------------------------------------------------------------
    profile: str = "h100-llama3-8b"
    # Cost-model parameters to override, as (name, value) pairs (`--profile-override k=v`).
    profile_overrides: tuple[tuple[str, float], ...] = ()
    num_gpu_blocks: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling: Scheduling = "continuous"
    # Multiplies every modelled step duration: 0.05 runs twenty times faster than the GPU would.
    time_scale: float = 1.0

    # --- outputs ------------------------------------------------------------------------------
    seed: int = 0
    # Output length when the request does not set ignore_eos: drawn reproducibly, capped at
    # max_tokens. "exponential" uses the mean; "uniform" draws in [low, high]; "fixed" = mean.
    output_len_kind: OutputLengthKind = "exponential"
    output_len_mean: float = 128.0
    output_len_low: int = 1
    output_len_high: int = 256
    tokenizer_path: str | None = None
    embedding_dim: int = 1024

    # --- KV cache events ----------------------------------------------------------------------
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    kv_events_encoding: KVEventsEncoding = "map"
    kv_events_buffer_steps: int = 10_000
    kv_events_hwm: int = 100_000

    # --- faults -------------------------------------------------------------------------------
    failure_rate: float = 0.0
    stall_before_first_byte_s: float = 0.0
    crash_after_requests: int | None = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every model name this replica answers to, the canonical one first."""
        return (self.model, *tuple(a for a in self.model_aliases if a != self.model))

    def replace(self, **changes: object) -> SimSettings:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _validate(s: SimSettings) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SettingsError(message)

    need(0 <= s.port <= 65535, f"port must be in 0..65535, got {s.port}")
    need(bool(s.host), "host must not be empty")
    need(bool(s.model), "model must not be empty")
    need(all(bool(a) for a in s.model_aliases), "model aliases must not be empty")
    need(s.max_model_len is None or s.max_model_len >= 1, "max_model_len must be >= 1")
    need(s.num_gpu_blocks is None or s.num_gpu_blocks >= 1, "num_gpu_blocks must be >= 1")
    need(s.block_size >= 1, f"block_size must be >= 1, got {s.block_size}")
    need(s.max_num_seqs is None or s.max_num_seqs >= 1, "max_num_seqs must be >= 1")
    need(
        s.max_num_batched_tokens is None or s.max_num_batched_tokens >= 1,
        "max_num_batched_tokens must be >= 1",
    )
    need(s.scheduling in ("continuous", "static"), f"unknown scheduling {s.scheduling!r}")
    need(s.time_scale >= 0.0, f"time_scale must be >= 0, got {s.time_scale}")
    need(s.output_len_kind in ("exponential", "uniform", "fixed"), "unknown output_len_kind")
    need(s.output_len_mean > 0, "output_len_mean must be > 0")
    need(
        1 <= s.output_len_low <= s.output_len_high,
        f"need 1 <= output_len_low <= output_len_high, got {s.output_len_low}, {s.output_len_high}",
    )
    need(s.embedding_dim >= 1, "embedding_dim must be >= 1")
    need(
        s.tokenizer_path is None or os.path.isfile(s.tokenizer_path),
        f"tokenizer_path {s.tokenizer_path!r} is not a file (a local tokenizer.json)",
    )
    need(s.kv_events_encoding in ("array", "map"), "kv_events_encoding must be array or map")
    need(s.kv_events_buffer_steps >= 1, "kv_events_buffer_steps must be >= 1")
    need(s.kv_events_hwm >= 1, "kv_events_hwm must be >= 1")
    for endpoint in (s.kv_events_endpoint, s.kv_events_replay_endpoint):
        need(
            endpoint is None or endpoint.startswith(("tcp://", "ipc://", "inproc://")),
            f"KV events endpoints are ZMQ addresses (tcp://, ipc://, inproc://), got {endpoint!r}",
        )
    need(
        s.kv_events_replay_endpoint is None or s.kv_events_endpoint is not None,
        "kv_events_replay_endpoint needs kv_events_endpoint",
    )
    need(0.0 <= s.failure_rate <= 1.0, f"failure_rate must be in [0, 1], got {s.failure_rate}")
    need(s.stall_before_first_byte_s >= 0.0, "stall_before_first_byte_s must be >= 0")
    need(
        s.crash_after_requests is None or s.crash_after_requests >= 0,
        "crash_after_requests must be >= 0",
    )
    from replicas.sim import cost_model  # local: keeps `settings` importable on its own

    need(
        s.profile in cost_model.PROFILES,
        f"unknown profile {s.profile!r}; known: {', '.join(sorted(cost_model.PROFILES))}",
    )
