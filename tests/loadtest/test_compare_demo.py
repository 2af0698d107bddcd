"""`fleet-loadtest compare` and `fleet-router demo --quick`, end to end (they start everything)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import orjson
import pytest

from loadtest import cli, demo
from loadtest.compare import PEERS, Target, default_targets, load_ratio, parse_target
from loadtest.report import JSON_KEYS
from router.policies import POLICIES


def test_targets_parse() -> None:
    assert parse_target("cache_aware") == Target("policy", "cache_aware")
    assert parse_target("policy:round_robin") == Target("policy", "round_robin")
    assert parse_target("client-rr") == Target("client-rr")
    assert parse_target("sglang-router") == Target("sglang-router", "cache_aware")
    kinds = [t.kind for t in default_targets()]
    assert kinds.count("policy") == 4 and "client-rr" in kinds and set(PEERS) <= set(kinds)
    assert load_ratio({"a": 3, "b": 1}) == 1.5 and load_ratio({}) is None


def test_compare_runs_every_target_on_fresh_replicas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "compare", "--replicas", "2", "--time-scale", "0.05",
        "--target", "round_robin", "--target", "client-rr", "--target", "sglang-router",
        "--target", "no_such_policy",
        "-W", "num_groups=3", "-W", "prompts_per_group=4", "-W", "system_prompt_len=128",
        "-W", "question_len=16", "-W", "output_len=4",
        "--concurrency", "3", "--seed", "5",
        "--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "skipped: policy not registered" in out
    docs = orjson.loads((tmp_path / "c.json").read_bytes())
    assert [d["label"] for d in docs] == [
        "fleet-router round_robin",
        "client round robin (no router)",
        "sglang-router cache_aware",
        "fleet-router no_such_policy",
    ]
    for doc in docs[:2]:
        assert list(doc) == list(JSON_KEYS)
        assert doc["completed"] == 12 and doc["failed"] == 0
        # fresh replicas per target: each target's deltas see exactly its own 12 requests
        assert sum(doc["per_replica_share"].values()) == pytest.approx(1.0)
        assert doc["workload_params"]["num_groups"] == 3 and doc["seed"] == 5
    assert docs[0]["target"] != docs[1]["target"]
    assert len(docs[1]["target"]) == 2  # client-side round robin over the two replicas
    if importlib.util.find_spec("sglang_router") is None:
        assert docs[2]["skipped"] == "skipped: not installed"
    else:  # installed: it must have served the same workload
        assert docs[2]["completed"] == 12 and docs[2]["failed"] == 0
    assert "skipped" in docs[3]
    assert (tmp_path / "c.png").stat().st_size > 20_000


def test_demo_quick_end_to_end(tmp_path: Path) -> None:
    assert demo.main(["--quick", "--json", str(tmp_path / "d.json")]) == 0
    doc = orjson.loads((tmp_path / "d.json").read_bytes())
    routing = {row["policy"]: row for row in doc["routing"]}
    assert list(routing) == list(demo.DEMO_POLICIES)
    size = demo.QUICK
    total = size.groups * size.prompts_per_group
    assert set(routing) <= set(POLICIES)  # every demo policy is registered, so none is skipped
    for row in routing.values():
        assert row["completed"] == total and row["failed"] == 0
    rr = routing["round_robin"]["prefix_cache_hit_rate"]
    assert rr is not None and rr < 0.5
    # a group's prompts land where its system prompt is cached; round robin scatters them
    assert routing["cache_aware"]["prefix_cache_hit_rate"] > rr + 0.15
    (batching,) = doc["batching"]
    assert batching["cap"] == 512 and batching["ratio"] > 1.3
    assert doc["chunked_prefill"]["ratio"] > 2
