"""How many concurrent streams one simulated replica sustains in real time (time scale 1).

The replica runs in this process (its event loop is what we measure); N streaming clients run in
a separate process, so their parsing does not steal this loop's time. For each N, the clients keep N
streams open (a finished stream is replaced at once); after every stream is running, the
replica's real-time driver records, for each engine step, the modelled duration and the wall
interval between successive token deliveries. We report:

- drift: (sum of wall intervals - sum of modelled durations) / sum of modelled durations, i.e. how
  much slower than the modelled GPU the replica ran (the pass criterion: |drift| < 5%);
- per-step error: |wall interval - modelled| / modelled, median and p99 (timer granularity is
  ~1 ms, so individual steps jitter even when the schedule holds: the driver sleeps to a
  monotonic deadline, so a late step is followed by a shorter one);
- the replica process's CPU use, and the chunks per second the clients received.

    python benchmarks/sim_realtime.py                       # N = 1, 64, 128, 256, 384, 512
    python benchmarks/sim_realtime.py --streams 256 --duration-s 10 --repeat 3
    python benchmarks/sim_realtime.py --long-prompts [--tokenizer tokenizer.json]

``--long-prompts`` measures something else: how long the replica's event loop stalls while
32k-token text prompts are tokenized, inline on the loop vs in the replica's tokenizer thread
(`replicas.sim.prompt_encoder`). A 1 ms ticker on the replica's loop records its lateness while
a client process posts the prompts one after another; token-id prompts (nothing to tokenize)
give the floor.

On a shared machine an occasional stall of the whole process (another job taking both cores)
shows up as a run with positive drift and a ~0.25 s max lag (the driver forgives a larger lag
instead of bursting steps to catch up); repeat runs tell such noise from a real limit.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from replicas.sim import SimSettings, start_replica

PROMPT_TOKENS = 128
MAX_TOKENS = 1024


# ----------------------------------------------------------------------------- client process


async def _client_main(url: str, streams: int) -> None:
    """Keep `streams` streams open until a line arrives on stdin; then print counts as JSON."""
    stop = asyncio.Event()
    chunks = 0
    completed = 0
    errors = 0

    async def one_stream(session: aiohttp.ClientSession, worker: int) -> None:
        nonlocal chunks, completed, errors
        n = 0
        while not stop.is_set():
            n += 1
            # distinct prompts: no prefix-cache hits, every stream pays its own prefill
            prompt = [
                (worker * 7919 + n * 104729 + i) % 100_000 + 1000 for i in range(PROMPT_TOKENS)
            ]
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
            try:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    async for data in resp.content.iter_any():
                        chunks += data.count(b"\n\n")
                        if stop.is_set():
                            return
                completed += 1
            except aiohttp.ClientError:
                errors += 1
                await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(one_stream(session, w)) for w in range(streams)]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)
        stop.set()
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps({"chunks": chunks, "completed": completed, "errors": errors}), flush=True)


# ----------------------------------------------------------------------------- replica process


async def _measure(streams: int, duration_s: float, warmup_timeout_s: float) -> dict[str, float]:
    settings = SimSettings(port=0, time_scale=1.0, max_num_seqs=max(streams, 1), seed=1)
    replica = await start_replica(settings)
    gc.freeze()  # as the CLI does: long-lived engine state out of full GC passes
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", replica.url, str(streams),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        engine = replica.engine
        deadline = time.monotonic() + warmup_timeout_s
        while engine.stats().num_running < streams:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {engine.stats().num_running}/{streams} streams started")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # past the prefill burst: measure the steady decode phase
        timing = replica.runtime.timing
        timing.reset()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        wall0 = time.monotonic()
        await asyncio.sleep(duration_s)
        wall = time.monotonic() - wall0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        intervals = list(timing.intervals)
        running = engine.stats().num_running
        assert client.stdin is not None and client.stdout is not None
        client.stdin.write(b"stop\n")
        await client.stdin.drain()
        counts = json.loads(await asyncio.wait_for(client.stdout.readline(), 30))
        await asyncio.wait_for(client.wait(), 30)
    finally:
        if client.returncode is None:
            client.kill()
            await client.wait()
        await replica.stop()
    if not intervals:
        raise RuntimeError("no steps recorded")
    modelled = sum(m for m, _ in intervals)
    wall_sum = sum(w for _, w in intervals)
    errors = sorted(abs(w - m) / m for m, w in intervals if m > 0)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {
        "streams": streams,
        "running": running,
        "steps": len(intervals),
        "modelled_step_ms": 1000 * modelled / len(intervals),
        "wall_step_ms": 1000 * wall_sum / len(intervals),
        "drift_pct": 100 * (wall_sum - modelled) / modelled,
        "err_p50_pct": 100 * statistics.median(errors),
        "err_p99_pct": 100 * errors[min(len(errors) - 1, int(0.99 * len(errors)))],
        "max_lag_ms": 1000 * timing.max_lag_s,
        "cpu_pct": 100 * cpu / wall,
        "client_chunks_per_s": counts["chunks"] / max(wall, 1e-9),
        "client_errors": counts["errors"],
    }


def _print_table(rows: list[dict[str, float]]) -> None:
    header = (
        "| streams | steps | modelled step | wall step | drift | step err p50 | step err p99 "
        "| max lag | replica CPU | sustained |"
    )
    print(header)
    print("|---" * 10 + "|")
    for r in rows:
        ok = abs(r["drift_pct"]) < 5 and r["running"] == r["streams"]
        print(
            f"| {int(r['streams'])} | {int(r['steps'])} | {r['modelled_step_ms']:.2f} ms "
            f"| {r['wall_step_ms']:.2f} ms | {r['drift_pct']:+.2f}% | {r['err_p50_pct']:.1f}% "
            f"| {r['err_p99_pct']:.1f}% | {r['max_lag_ms']:.1f} ms | {r['cpu_pct']:.0f}% "
            f"| {'yes' if ok else 'NO'} |"
        )


# ------------------------------------------------------------------------ long-prompt stalls

LONG_PROMPT_CHARS = 4 * 32768  # 32k tokens for the simulator's tokenizer
_TEXT = "the quick brown fox jumps over a lazy dog while routers send requests to replicas"
_WORDS = _TEXT.split()


def _long_text(i: int) -> str:
    words = [_WORDS[(i * 31 + k * 7 + k // 5) % len(_WORDS)] for k in range(LONG_PROMPT_CHARS // 3)]
    return f"request {i}: " + " ".join(words)[:LONG_PROMPT_CHARS]


async def _stall_client_main(url: str, count: int, kind: str) -> None:
    async with aiohttp.ClientSession() as session:
        for i in range(count):
            ids = [(i + k) % 256 for k in range(32768)]  # inside any vocabulary
            prompt: object = _long_text(i) if kind == "text" else ids
            body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                usage = (await resp.json())["usage"]
    print(json.dumps({"prompt_tokens": usage["prompt_tokens"]}), flush=True)


async def _measure_stall(mode: str, count: int, tokenizer: str | None) -> dict[str, object]:
    # time scale 0.01: a 32k prefill takes ~10 ms, so the run is about tokenizing, not waiting
    settings = SimSettings(port=0, time_scale=0.01, seed=1, tokenizer_path=tokenizer)
    replica = await start_replica(settings)
    if mode == "inline":
        replica.state.encoder.inline_max_chars = sys.maxsize  # the old behaviour
    gc.freeze()
    lateness: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        clock = time.perf_counter  # uvloop's loop.time() has 1 ms resolution
        while not stop.is_set():
            due = clock() + 0.001
            await asyncio.sleep(0.001)
            lateness.append(clock() - due)

    tick = asyncio.create_task(ticker())
    kind = "ids" if mode == "token ids" else "text"
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--stall-client", replica.url, str(count), kind,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out = json.loads(await asyncio.wait_for(client.stdout.readline(), 300))  # type: ignore[union-attr]
        await client.wait()
    finally:
        stop.set()
        await tick
        if client.returncode is None:
            client.kill()
            await client.wait()
        await replica.stop()
    lateness.sort()
    return {
        "mode": mode,
        "prompt_tokens": out["prompt_tokens"],
        "ticks": len(lateness),
        "p99_ms": 1000 * lateness[int(0.99 * (len(lateness) - 1))],
        "max_ms": 1000 * lateness[-1],
    }


def _long_prompts(run: Any, count: int, tokenizer: str | None, repeat: int) -> None:
    name = tokenizer or "the simulator's tokenizer"
    print(f"event-loop lateness while {count} long prompts are tokenized ({name}); 1 ms ticker")
    print("| prompts | prompt tokens | p99 lateness | max lateness |")
    print("|---|---|---|---|")
    for mode in ("token ids", "inline", "tokenizer thread"):
        for _ in range(repeat):
            r = run(_measure_stall(mode, count, tokenizer))
            print(
                f"| {mode} | {r['prompt_tokens']} | {r['p99_ms']:.2f} ms | {r['max_ms']:.2f} ms |",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", nargs=2, metavar=("URL", "STREAMS"), help=argparse.SUPPRESS)
    parser.add_argument("--stall-client", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument(
        "--long-prompts", type=int, nargs="?", const=40, metavar="COUNT",
        help="measure event-loop stalls while COUNT (40) 32k-token prompts are tokenized",
    )  # fmt: skip
    parser.add_argument("--tokenizer", help="a local tokenizer.json for --long-prompts")
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 64, 128, 256, 384, 512])
    parser.add_argument("--duration-s", type=float, default=6.0)
    parser.add_argument("--warmup-timeout-s", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=1, help="runs per stream count")
    parser.add_argument("--json", action="store_true", help="print one JSON line per run too")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    if args.client:
        run(_client_main(args.client[0], int(args.client[1])))
        return 0
    if args.stall_client:
        url, count, kind = args.stall_client
        run(_stall_client_main(url, int(count), kind))
        return 0
    if args.long_prompts:
        _long_prompts(run, args.long_prompts, args.tokenizer, args.repeat)
        return 0
    print(
        f"sim replica in real time (time scale 1, profile h100-llama3-8b, {PROMPT_TOKENS}-token "
        f"prompts, {MAX_TOKENS} output tokens, clients in another process; "
        f"{os.cpu_count()} CPUs, {args.duration_s:.0f} s per row)",
        flush=True,
    )
    rows = []
    for n in args.streams:
        for _ in range(args.repeat):
            row = run(_measure(n, args.duration_s, args.warmup_timeout_s))
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    _print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
