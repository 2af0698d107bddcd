"""`python -m replicas.sim` as a real process, and the flag → settings mapping."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import pytest

from replicas.sim.cli import build_parser, settings_from_args
from replicas.sim.settings import SettingsError
from tests.conftest import free_port


def _settings(*argv: str):  # type: ignore[no-untyped-def]
    return settings_from_args(build_parser().parse_args(list(argv)))


def test_flags_map_to_settings() -> None:
    s = _settings(
        "--port", "9001", "--model", "m", "--num-gpu-blocks", "100", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching", "--scheduling", "static", "--time-scale", "0.5",
        "--kv-events-endpoint", "tcp://*:5557", "--seed", "9", "--failure-rate", "0.1",
        "--profile-override", "step_overhead_s=0.002", "--model-alias", "m2",
    )  # fmt: skip
    assert (s.port, s.model, s.model_aliases) == (9001, "m", ("m2",))
    assert (s.num_gpu_blocks, s.max_num_seqs, s.max_num_batched_tokens) == (100, 8, 512)
    assert not s.enable_chunked_prefill and not s.enable_prefix_caching
    assert (s.scheduling, s.time_scale, s.seed, s.failure_rate) == ("static", 0.5, 9, 0.1)
    assert s.kv_events_endpoint == "tcp://*:5557"
    assert s.profile_overrides == (("step_overhead_s", 0.002),)
    # vLLM's JSON form of the KV events flag
    s = _settings("--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
                  '"endpoint": "tcp://*:6000", "topic": "t"}')  # fmt: skip
    assert (s.kv_events_endpoint, s.kv_events_topic) == ("tcp://*:6000", "t")
    with pytest.raises(SettingsError):
        _settings("--time-scale", "-1")
    with pytest.raises(SettingsError):
        _settings("--profile-override", "nonsense")


def test_bad_flags_exit_with_usage_error() -> None:
    for argv in (["--time-scale", "-1"], ["--scheduling", "bogus"], ["--failure-rate", "2"]):
        proc = subprocess.run(
            [sys.executable, "-m", "replicas.sim", *argv], capture_output=True, timeout=30,
            text=True,
        )  # fmt: skip
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "error" in proc.stderr


async def test_process_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replicas.sim", "--port", str(port), "--model", "cli-model",
        "--time-scale", "0.02", "--num-gpu-blocks", "512",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as s:
            async with asyncio.timeout(30):
                while True:
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientConnectorError:
                        await asyncio.sleep(0.1)
            body = {"model": "cli-model", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await proc.wait() == 0
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
        assert f"listening on http://127.0.0.1:{port}" in log
        assert "512 KV blocks of 16 tokens" in log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
