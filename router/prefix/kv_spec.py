"""The `--kv-events` setting: which replica publishes its KV events where."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["KvEventSource", "kv_event_sources", "parse_kv_events_spec"]


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """Where one replica publishes its KV events (vLLM's `--kv-events-config`)."""

    replica_id: str
    endpoint: str  # e.g. tcp://10.0.0.5:5557 (the router connects its SUB socket there)
    model: str  # the model name requests use for this replica
    replay_endpoint: str | None = None
    topic: str = "kv-events"


_SCHEMES = ("tcp://", "ipc://", "inproc://")


def parse_kv_events_spec(text: str) -> tuple[str, str, str | None]:
    """`REPLICA=ENDPOINT[,REPLAY_ENDPOINT]` → (replica id, endpoint, replay endpoint or None).

    Endpoints are ZMQ addresses the router connects to, e.g. `tcp://10.0.0.5:5557` for a vLLM
    started with `--kv-events-config '{"endpoint": "tcp://*:5557", ...}'`.  Raises ValueError.
    """
    replica, sep, rest = text.partition("=")
    replica = replica.strip()
    if not sep or not replica or not rest.strip():
        raise ValueError(f"kv_events {text!r}: expected REPLICA=ENDPOINT[,REPLAY_ENDPOINT]")
    parts = [p.strip() for p in rest.split(",")]
    if len(parts) > 2:
        raise ValueError(f"kv_events {text!r}: at most one replay endpoint")
    for endpoint in parts:
        if not endpoint.startswith(_SCHEMES) or "*" in endpoint:
            raise ValueError(
                f"kv_events {text!r}: {endpoint!r} is not a ZMQ address to connect to "
                "(tcp://host:port, ipc://path)"
            )
    return replica, parts[0], parts[1] if len(parts) > 1 else None


def kv_event_sources(
    specs: Iterable[str], model_of: Callable[[str], str | None]
) -> tuple[list[KvEventSource], list[str]]:
    """Sources for the `--kv-events` specs; `model_of(replica_id)` names the model its engine
    serves (None when unknown yet).  Returns (sources, replica ids skipped for lack of a model)."""
    sources: list[KvEventSource] = []
    skipped: list[str] = []
    for text in specs:
        replica_id, endpoint, replay = parse_kv_events_spec(text)
        model = model_of(replica_id)
        if model is None:
            skipped.append(replica_id)
            continue
        sources.append(KvEventSource(replica_id, endpoint, model, replay_endpoint=replay))
    return sources, skipped
