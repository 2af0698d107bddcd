"""Units, the --kv-events spec, the token-mode tokenizer loader and the prefix metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.errors import ConfigError
from router.metrics import PrefixMetrics
from router.prefix.index import PrefixIndex
from router.prefix.keys import chain_seed, hash_token_blocks, routing_key_hashes
from router.prefix.kv_spec import kv_event_sources, parse_kv_events_spec
from router.prefix.tokenizer import load_routing_tokenizer
from router.prefix.units import KeyUnits


def test_vllm_capacity_in_index_blocks() -> None:
    # 26,880 blocks of 16 tokens = 430,080 tokens = 1,720,320 characters = 26,880 blocks of 64.
    assert KeyUnits().capacity_blocks(26_880, 16) == 26_880
    assert KeyUnits(block_units=64, units_per_token=3.0).capacity_blocks(100, 16) == 75
    assert KeyUnits.token_mode(16).capacity_blocks(26_880, 16) == 26_880
    assert KeyUnits.token_mode(32).capacity_blocks(100, 16) == 50
    assert KeyUnits().units_to_tokens(4_000) == 1_000
    assert KeyUnits().blocks_to_tokens(10) == 160
    with pytest.raises(ValueError):
        KeyUnits(block_units=0)
    with pytest.raises(ValueError):
        KeyUnits().capacity_blocks(10, 0)


def test_kv_events_spec() -> None:
    assert parse_kv_events_spec("r0=tcp://10.0.0.5:5557") == ("r0", "tcp://10.0.0.5:5557", None)
    assert parse_kv_events_spec("r0 = ipc:///a, ipc:///b") == ("r0", "ipc:///a", "ipc:///b")
    for bad in ("tcp://x:1", "r0=", "r0=http://x", "r0=tcp://*:5557", "r=tcp://a:1,tcp://b:2,x"):
        with pytest.raises(ValueError):
            parse_kv_events_spec(bad)
    sources, skipped = kv_event_sources(["a=tcp://h:1", "b=tcp://h:2,tcp://h:3"], {"a": "m"}.get)
    assert [(s.replica_id, s.model, s.replay_endpoint) for s in sources] == [("a", "m", None)]
    assert skipped == ["b"]


def test_sim_tokenizer_for_token_mode() -> None:
    tokenizer = load_routing_tokenizer("sim")
    text = "lorem ipsum dolor sit amet " * 10
    hashes, units = routing_key_hashes(
        "completions", {"prompt": text}, "m", 16, tokenizer=tokenizer
    )
    tokens = list(tokenizer.encode(text))
    assert units == len(tokens)
    assert list(hashes) == hash_token_blocks(tokens, chain_seed("m"), 16)


def test_local_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = load_routing_tokenizer(str(path))
    assert list(loaded.encode("hello world hello other")) == [1, 2, 1, 0]
    with pytest.raises(ConfigError):
        load_routing_tokenizer(str(tmp_path / "missing.json"))


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_prefix_metrics_on_a_fresh_registry() -> None:
    registry = CollectorRegistry()
    metrics = PrefixMetrics(registry)
    index = PrefixIndex()
    index.set_capacity("r0", 2)
    index.insert("m", tuple(hash_token_blocks([1, 2, 3], chain_seed("m"), 1)), "r0")
    metrics.watch_index(index)
    metrics.watch_index(index)  # idempotent
    metrics.observe_route("kv_aware", "r0", prompt_tokens=100, hit_tokens=75)
    metrics.observe_route("kv_aware", "r0", prompt_tokens=0, hit_tokens=0)  # ignored
    metrics.kv_events_applied("r0", "BlockStored", 3)
    metrics.kv_event_gap("r0", 2)
    text = generate_latest(registry).decode()
    assert _value(text, 'fleet_router_index_blocks{model="m"}') == 2
    assert _value(text, "fleet_router_index_bytes") > 0
    assert _value(text, 'fleet_router_index_evictions_total{replica="r0"}') == 1
    assert _value(text, 'fleet_router_index_replica_blocks{replica="r0"}') == 2
    assert _value(text, 'fleet_router_predicted_hit_tokens_total{replica="r0"}') == 75
    assert _value(text, 'fleet_router_predicted_prompt_tokens_total{replica="r0"}') == 100
    assert _value(text, 'fleet_router_match_ratio_bucket{le="0.8",policy="kv_aware"}') == 1
    assert _value(text, 'fleet_router_match_ratio_bucket{le="0.7",policy="kv_aware"}') == 0
    assert _value(text, 'fleet_router_kv_events_total{replica="r0",type="BlockStored"}') == 3
    assert _value(text, 'fleet_router_kv_event_gaps_total{replica="r0"}') == 1
    metrics.forget_replica("r0")
    text = generate_latest(registry).decode()
    assert 'fleet_router_predicted_hit_tokens_total{replica="r0"}' not in text
    assert 'fleet_router_kv_events_total{replica="r0"' not in text
