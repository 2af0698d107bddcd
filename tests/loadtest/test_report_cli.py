"""JSON field set (golden), table, plot PNG, CLI argument errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest
from rich.console import Console

from loadtest import cli
from loadtest.plot import PlotRun, plot_compare, plot_run
from loadtest.replica_metrics import ServerStats
from loadtest.report import JSON_KEYS, RunMeta, result_json, summary_table, write_json
from loadtest.stats import parse_slo, summarize
from tests.loadtest.test_stats import timeline

GOLDEN_KEYS = [
    # the run
    "date", "backend", "label", "model_id", "target", "workload", "workload_params", "seed",
    "num_prompts", "duration_limit_s", "request_rate", "burstiness", "max_concurrency",
    "warmup_requests",
    # vLLM bench serve's figures, same names
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p50_itl_ms", "p90_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p50_e2el_ms", "p90_e2el_ms", "p99_e2el_ms",
    # our extras
    "offered_rate", "achieved_rate", "slo", "prefix_cache_hit_rate", "per_replica_share",
    "preemptions", "client_replica_share", "cached_tokens", "errors",
]  # fmt: skip

META = RunMeta(
    label="t",
    targets=("http://127.0.0.1:1",),
    model="m",
    workload="random",
    workload_params={"input_len": 8},
    seed=0,
    num_prompts=4,
    duration_limit_s=None,
    request_rate=float("inf"),
    burstiness=1.0,
    max_concurrency=None,
    warmup_requests=0,
)
SERVER = ServerStats(
    prefix_cache_hits=30, prefix_cache_queries=60, preemptions=1,
    per_replica_requests={"http://a": 2, "http://b": 1},
)  # fmt: skip


def test_json_field_set_is_stable(tmp_path: Path) -> None:
    summary = summarize(timeline(), slo=parse_slo("ttft=150ms"), server=SERVER)
    doc = result_json(summary, META)
    assert list(doc) == GOLDEN_KEYS
    assert list(JSON_KEYS) == GOLDEN_KEYS
    write_json(tmp_path / "r.json", doc)
    back = orjson.loads((tmp_path / "r.json").read_bytes())
    assert back["request_rate"] == "inf" and back["completed"] == 3
    assert back["prefix_cache_hit_rate"] == 0.5 and back["preemptions"] == 1
    assert back["per_replica_share"] == {"http://a": 2 / 3, "http://b": 1 / 3}
    assert back["errors"] == {"http_503": 1} and back["slo"] == "ttft<=150ms"
    # without SLO and server metrics the keys stay, with nulls
    bare = result_json(summarize(timeline()), META)
    assert list(bare) == GOLDEN_KEYS
    assert bare["request_goodput"] is None and bare["prefix_cache_hit_rate"] is None


def test_table_renders(tmp_path: Path) -> None:
    console = Console(record=True, width=120)
    console.print(summary_table(summarize(timeline(), server=SERVER), "demo"))
    text = console.export_text()
    assert "TTFT ms" in text and "prefix cache hit rate" in text and "50.0%" in text
    assert "http_503: 1" in text


def test_plots_are_written(tmp_path: Path) -> None:
    records = timeline()
    summary = summarize(records, server=SERVER)
    run = PlotRun("run", records, 0.0, summary)
    plot_run(tmp_path / "one.png", run)
    plot_compare(tmp_path / "many.png", [run, PlotRun("other", records, 0.0, summarize(records))])
    for name in ("one.png", "many.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["run", "--workload", "random"], "--target"),
        (["run", "--target", "127.0.0.1:1", "--workload", "random"], "http"),
        (["run", "--target", "http://h:1", "--workload", "nope"], "invalid choice"),
        (["run", "--target", "http://h:1", "--workload", "random", "--rate", "-2"], "> 0"),
        (["run", "--target", "http://h:1", "--workload", "random", "--rate", "x"], "number"),
        (["run", "--target", "http://h:1", "--workload", "random", "--num-requests", "0"], ">= 1"),
        (["run", "--target", "http://h:1", "--workload", "random", "--slo", "ttft"], "bad SLO"),
        (
            ["run", "--target", "http://h:1", "--workload", "random", "-W", "bogus=1"],
            "no parameter",
        ),
        (["run", "--target", "http://h:1", "--workload", "random", "-W", "nokey"], "KEY=VALUE"),
        (
            ["run", "--target", "http://h:1", "--workload", "random", "--burstiness", "0.5"],
            "--rate",
        ),
        (["run", "--target", "http://h:1", "--workload", "trace"], "--trace"),
        (["compare", "--target", "policy:", "--num-requests", "3"], "bad target"),
        (["compare", "--replicas", "0", "--num-requests", "3"], "--replicas"),
    ],
)
def test_bad_arguments_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_make_trace_writes_a_replayable_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    argv = ["make-trace", "--workload", "prefix-repetition", "--rate", "50", "--num-requests", "12",
            "-W", "num_prompts=12", "-o", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(lines) == 12 and lines[0]["timestamp"] == 0.0
    assert all(a["timestamp"] <= b["timestamp"] for a, b in itertools.pairwise(lines))
    assert {line["max_tokens"] for line in lines} == {128}
