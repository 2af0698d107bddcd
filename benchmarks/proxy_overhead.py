"""Gateway overhead: router CPU per proxied request and added latency versus going direct.

Three processes besides this one (the load generator): one sim replica that answers at once
(`--time-scale 0`), fleet-router in front of it, and — when `sglang-router` is installed —
SGLang's router in front of the same replica, for the ratio.  Per mode (non-streaming,
streaming) it measures:

- latency: sequential requests, targets interleaved (direct, fleet-router, sglang-router, ...),
  time to first body byte (TTFT) and to the last byte; "added" = router minus direct percentiles;
- CPU: a closed loop at `--concurrency`; the router process's CPU time (utime + stime from
  /proc/<pid>/stat) divided by the requests it proxied; median of `--rounds` alternating rounds.

fleet-router is measured twice: as installed for development (interpreted) and as the image
ships it, its request hot path compiled by mypyc ("fleet-router compiled": a scratch copy made by
scripts/compiled_copy.py, about a minute to build; `--skip-compiled` leaves it out).

"aiohttp floor" is the least an aiohttp proxy can do (no routing, validation, metrics, timeouts,
retries, header filtering): what the aiohttp stack alone costs per request.  fleet-router
itself no longer runs its data path on aiohttp (router.http.edge and router.proxy.upstream:
httptools on asyncio protocols), so it sits below that floor.

`--policy` is fleet-router's policy; sglang-router runs `--sglang-policy` (default: the same
name when sglang-router has it, else its own default, cache_aware).

    python benchmarks/proxy_overhead.py                # ~5 minutes on 2 cores
    python benchmarks/proxy_overhead.py --quick        # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def minimal_proxy(port: int, upstream: str) -> None:
    """The floor: the least an aiohttp proxy can do (no routing, validation, metrics, timeouts,
    retries or header filtering).  Run as `proxy_overhead.py --minimal-proxy PORT UPSTREAM`."""
    from aiohttp import web

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        yield
        await app[SESSION].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with request.app[SESSION].post(upstream + request.path, data=body,
                                             headers=headers) as up:  # fmt: skip
            resp = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers["Content-Type"]}
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    SESSION = web.AppKey("session", aiohttp.ClientSession)
    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", handle)
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=loop)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass
class Target:
    name: str
    url: str
    pid: int | None  # the router process whose CPU we measure (None: direct)


def start(
    cmd: list[str], env: dict[str, str] | None = None, root: Path = ROOT
) -> subprocess.Popen[bytes]:
    """Run `cmd` on the code in `root` (this checkout, or a compiled copy of it)."""
    return subprocess.Popen(
        cmd,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


async def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Until a real completion succeeds through `url` (so routers have discovered the worker)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"{url}: process exited ({proc.returncode}): {err[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.post(
                    url + "/v1/completions",
                    json={"model": MODEL, "prompt": "warm", "max_tokens": 1},
                    timeout=aiohttp.ClientTimeout(total=2),
                ) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


def body(stream: bool, tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def one(
    session: aiohttp.ClientSession, url: str, payload: dict[str, object]
) -> tuple[float, float]:
    """(seconds to first body byte, seconds to last byte) of one request."""
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json=payload) as resp:
        first = await resp.content.readany()
        ttft = time.perf_counter() - started
        while await resp.content.readany():
            pass
        if resp.status != 200 or not first:
            raise RuntimeError(f"{url}: status {resp.status}")
    return ttft, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency(
    targets: list[Target], payload: dict[str, object], n: int
) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {t.name: ([], []) for t in targets}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for t in targets:  # warm connections and code paths
            for _ in range(20):
                await one(session, t.url, payload)
        for _ in range(n):
            for t in targets:
                ttft, total = await one(session, t.url, payload)
                out[t.name][0].append(ttft)
                out[t.name][1].append(total)
    return out


async def cpu_per_request(
    target: Target, payload: dict[str, object], n: int, concurrency: int
) -> tuple[float, float]:
    """(router CPU µs per request, requests per second) in a closed loop."""
    assert target.pid is not None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):
            await one(session, target.url, payload)
        remaining = n

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await one(session, target.url, payload)

        cpu0, wall0 = cpu_seconds(target.pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu1, wall1 = cpu_seconds(target.pid), time.perf_counter()
    return (cpu1 - cpu0) / n * 1e6, n / (wall1 - wall0)


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-requests", type=int, default=500)
    parser.add_argument("--cpu-requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--sglang-policy", default=None)
    parser.add_argument("--skip-sglang", action="store_true")
    parser.add_argument("--skip-compiled", action="store_true", help="no compiled fleet-router")
    parser.add_argument("--rounds", type=int, default=5, help="CPU rounds per router")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.latency_requests, args.cpu_requests, args.rounds = 60, 300, 1

    sglang_policies = ("round_robin", "random", "cache_aware", "power_of_two")
    sg_policy = args.sglang_policy or (
        args.policy if args.policy in sglang_policies else "cache_aware"
    )
    with contextlib.ExitStack() as stack, processes() as procs:
        sim_port, fr_port = free_port(), free_port()
        sim = start([sys.executable, "-m", "replicas.sim", "--port", str(sim_port),
                     "--time-scale", "0", "--log-level", "warning"])  # fmt: skip
        procs.append(sim)
        sim_url = f"http://127.0.0.1:{sim_port}"
        await wait_ready(sim_url, sim)
        router = start([sys.executable, "-m", "router", "serve", "--host", "127.0.0.1",
                        "--port", str(fr_port), "--replica", sim_url, "--policy", args.policy,
                        "--log-level", "warning"])  # fmt: skip
        procs.append(router)
        targets = [Target("direct", sim_url, None)]
        fr = Target("fleet-router", f"http://127.0.0.1:{fr_port}", router.pid)
        await wait_ready(fr.url, router)
        targets.append(fr)
        if not args.skip_compiled:
            sys.path.insert(0, str(ROOT / "scripts"))
            from compiled_copy import compiled_copy

            copy = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fr-compiled-")))
            await asyncio.to_thread(compiled_copy, copy)  # a minute of pip and gcc: off the loop
            frc_port = free_port()
            compiled = start([sys.executable, "-m", "router", "serve", "--host", "127.0.0.1",
                              "--port", str(frc_port), "--replica", sim_url, "--policy",
                              args.policy, "--log-level", "warning"], root=copy)  # fmt: skip
            procs.append(compiled)
            frc = Target("fleet-router compiled", f"http://127.0.0.1:{frc_port}", compiled.pid)
            await wait_ready(frc.url, compiled)
            targets.append(frc)
        sglang_note = ""
        if not args.skip_sglang:
            try:
                import sglang_router  # noqa: F401
            except ImportError as exc:
                sglang_note = f"sglang-router not measured: {exc}"
            else:
                sg_port = free_port()
                sg = start(
                    [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                     "--port", str(sg_port), "--worker-urls", sim_url, "--policy", sg_policy,
                     "--log-level", "warn"],
                    # No tokenizer download: an unreachable local "hub".
                    env={"HF_ENDPOINT": "http://127.0.0.1:9"},
                )  # fmt: skip
                procs.append(sg)
                target = Target("sglang-router", f"http://127.0.0.1:{sg_port}", sg.pid)
                try:
                    await wait_ready(target.url, sg)
                    targets.append(target)
                except RuntimeError as exc:
                    sglang_note = f"sglang-router not measured: {exc}"

        floor_port = free_port()
        floor = start([sys.executable, str(SCRIPT), "--minimal-proxy",
                       str(floor_port), sim_url])  # fmt: skip
        procs.append(floor)
        floor_target = Target("aiohttp floor", f"http://127.0.0.1:{floor_port}", floor.pid)
        await wait_ready(floor_target.url, floor)
        targets.append(floor_target)

        print(f"replica answers at once (time_scale 0), {args.tokens} output tokens, policy "
              f"{args.policy} (sglang-router: {sg_policy}); {os.cpu_count()} CPUs")  # fmt: skip
        if sglang_note:
            print(sglang_note)
        # Latency first (the replica is fresh), then CPU.  Streaming is measured twice: with
        # `--tokens` (the replica bursts them out at once, so on a small machine the proxy is
        # still busy forwarding the burst) and with one token (the first-chunk path alone).
        # sglang-router gets its own pass against direct: its streams idle ~40 ms each (Nagle),
        # which would leave the cores cold for whichever target follows it.
        groups = [[t for t in targets if t.name != "sglang-router"]]
        if any(t.name == "sglang-router" for t in targets):
            groups.append([t for t in targets if t.name in ("direct", "sglang-router")])
        for stream, tokens in ((False, args.tokens), (True, args.tokens), (True, 1)):
            mode = f"streaming {tokens} tokens" if stream else f"non-streaming {tokens} tokens"
            print(f"\n## {mode}: latency over {args.latency_requests} sequential requests (ms)")
            print("| target | TTFT p50 | TTFT p99 | total p50 | total p99 | added TTFT p50 | "
                  "added TTFT p99 | added total p50 | added total p99 |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|")
            for group in groups:
                lat = await latency(group, body(stream, tokens), args.latency_requests)
                d_ttft, d_total = lat["direct"]
                for t in group:
                    ttft, total = lat[t.name]
                    row = [pct(ttft, 0.5), pct(ttft, 0.99), pct(total, 0.5), pct(total, 0.99)]
                    added = ["-"] * 4 if t.pid is None else [
                        f"{(pct(ttft, 0.5) - pct(d_ttft, 0.5)) * 1e3:+.3f}",
                        f"{(pct(ttft, 0.99) - pct(d_ttft, 0.99)) * 1e3:+.3f}",
                        f"{(pct(total, 0.5) - pct(d_total, 0.5)) * 1e3:+.3f}",
                        f"{(pct(total, 0.99) - pct(d_total, 0.99)) * 1e3:+.3f}",
                    ]  # fmt: skip
                    cells = [f"{v * 1e3:.3f}" for v in row] + added
                    print(f"| {t.name} | " + " | ".join(cells) + " |")
        routers = [t for t in targets if t.pid is not None]
        for stream in (False, True):
            mode = "streaming" if stream else "non-streaming"
            payload = body(stream, args.tokens)
            cpu: dict[str, list[float]] = {t.name: [] for t in routers}
            rate: dict[str, list[float]] = {t.name: [] for t in routers}
            for _ in range(args.rounds):  # rounds alternate targets: drift hits all alike
                for t in routers:
                    us, rps = await cpu_per_request(t, payload, args.cpu_requests, args.concurrency)
                    cpu[t.name].append(us)
                    rate[t.name].append(rps)
            print(f"\n## {mode}: router CPU, median of {args.rounds} rounds of "
                  f"{args.cpu_requests} requests at concurrency {args.concurrency}")  # fmt: skip
            print("| router | CPU µs / request | rounds | requests / s |")
            print("|---|---|---|---|")
            for t in routers:
                rounds = ", ".join(f"{v:.0f}" for v in cpu[t.name])
                print(f"| {t.name} | {statistics.median(cpu[t.name]):.0f} | {rounds} | "
                      f"{statistics.median(rate[t.name]):.0f} |")  # fmt: skip
            if "sglang-router" in cpu:
                print()
                for name in ("fleet-router", "fleet-router compiled"):
                    if name in cpu:
                        ratio = statistics.median(cpu[name]) / statistics.median(
                            cpu["sglang-router"]
                        )
                        print(f"{name} / sglang-router CPU per request: {ratio:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--minimal-proxy"]:
        minimal_proxy(int(sys.argv[2]), sys.argv[3])
    else:
        asyncio.run(main())
