"""`fleet-replica` / `python -m replicas.sim`: run one simulated vLLM replica.

Flags follow vLLM's spelling where vLLM has the flag (`--max-num-seqs`,
`--no-enable-prefix-caching`, `--kv-events-config '{...}'`); the simulator's own knobs
(`--profile`, `--time-scale`, `--scheduling`, faults) are documented in `--help`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import signal
import sys
from collections.abc import Sequence

from replicas.sim.cost_model import DEFAULT_PROFILE, PROFILES
from replicas.sim.settings import DEFAULT_MODEL, SettingsError, SimSettings

__all__ = ["build_parser", "main", "settings_from_args"]

log = logging.getLogger("replicas.sim")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fleet-replica",
        description="A simulated vLLM replica: vLLM's API, metrics and KV events, no GPU.",
    )
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    http.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    http.add_argument(
        "--model-alias", action="append", default=[], help="another accepted name (repeatable)"
    )
    http.add_argument("--max-model-len", type=int, default=None)

    eng = p.add_argument_group("engine")
    eng.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    eng.add_argument(
        "--profile-override",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a cost-model parameter, e.g. step_overhead_s=0.002 (repeatable)",
    )
    eng.add_argument("--num-gpu-blocks", type=int, default=None, help="default: the profile's")
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--max-num-seqs", type=int, default=None, help="default: the profile's")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    eng.add_argument("--scheduling", choices=("continuous", "static"), default="continuous")
    eng.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies every modelled step duration (0.05 = 20x faster than the GPU)",
    )

    out = p.add_argument_group("outputs")
    out.add_argument("--seed", type=int, default=0)
    out.add_argument(
        "--output-len-dist", choices=("exponential", "uniform", "fixed"), default="exponential"
    )
    out.add_argument("--output-len-mean", type=float, default=128.0)
    out.add_argument("--output-len-low", type=int, default=1)
    out.add_argument("--output-len-high", type=int, default=256)
    out.add_argument("--tokenizer", default=None, help="path to a local tokenizer.json")
    out.add_argument("--embedding-dim", type=int, default=1024)

    kv = p.add_argument_group("KV cache events")
    kv.add_argument("--kv-events-endpoint", default=None, help="e.g. tcp://*:5557 (binds)")
    kv.add_argument("--kv-events-replay-endpoint", default=None)
    kv.add_argument("--kv-events-topic", default="kv-events")
    kv.add_argument("--kv-events-encoding", choices=("array", "map"), default="map")
    kv.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's JSON form; its endpoint/topic/replay_endpoint fill the flags above",
    )

    faults = p.add_argument_group("fault injection")
    faults.add_argument("--failure-rate", type=float, default=0.0)
    faults.add_argument("--stall-before-first-byte-s", type=float, default=0.0)
    faults.add_argument("--crash-after-requests", type=int, default=None)

    p.add_argument("--log-level", default="INFO")
    return p


def _overrides(items: Sequence[str]) -> tuple[tuple[str, float], ...]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SettingsError(f"--profile-override needs NAME=VALUE, got {item!r}")
        try:
            pairs.append((name.strip(), float(value)))
        except ValueError:
            raise SettingsError(f"--profile-override {name}: not a number: {value!r}") from None
    return tuple(pairs)


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    """Turn parsed flags into `SimSettings` (`SettingsError` on bad values)."""
    endpoint = args.kv_events_endpoint
    replay = args.kv_events_replay_endpoint
    topic = args.kv_events_topic
    if args.kv_events_config:
        try:
            cfg = json.loads(args.kv_events_config)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise SettingsError("--kv-events-config must be a JSON object")
        if cfg.get("enable_kv_cache_events", True) and cfg.get("publisher", "zmq") == "zmq":
            endpoint = cfg.get("endpoint", endpoint or "tcp://*:5557")
            replay = cfg.get("replay_endpoint", replay)
            topic = cfg.get("topic", topic)
    return SimSettings(
        host=args.host,
        port=args.port,
        model=args.model,
        model_aliases=tuple(args.model_alias),
        max_model_len=args.max_model_len,
        profile=args.profile,
        profile_overrides=_overrides(args.profile_override),
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling=args.scheduling,
        time_scale=args.time_scale,
        seed=args.seed,
        output_len_kind=args.output_len_dist,
        output_len_mean=args.output_len_mean,
        output_len_low=args.output_len_low,
        output_len_high=args.output_len_high,
        tokenizer_path=args.tokenizer,
        embedding_dim=args.embedding_dim,
        kv_events_endpoint=endpoint,
        kv_events_replay_endpoint=replay,
        kv_events_topic=topic,
        kv_events_encoding=args.kv_events_encoding,
        failure_rate=args.failure_rate,
        stall_before_first_byte_s=args.stall_before_first_byte_s,
        crash_after_requests=args.crash_after_requests,
    )


async def serve(settings: SimSettings) -> None:
    """Run until SIGINT/SIGTERM."""
    from replicas.sim.server import start_replica

    try:
        replica = await start_replica(settings)
    except ValueError as exc:  # e.g. a profile override the engine refuses
        raise SettingsError(str(exc)) from None
    cfg = replica.engine.config
    log.info(
        "simulated vLLM replica listening on %s: model %s, profile %s, %d KV blocks of %d tokens, "
        "max_num_seqs %d, max_num_batched_tokens %d, %s scheduling, chunked prefill %s, "
        "prefix caching %s, time scale %g%s",
        replica.url,
        settings.model,
        settings.profile,
        cfg.num_gpu_blocks,
        cfg.block_size,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        cfg.scheduling,
        "on" if cfg.enable_chunked_prefill else "off",
        "on" if cfg.enable_prefix_caching else "off",
        settings.time_scale,
        f", KV events on {settings.kv_events_endpoint}" if settings.kv_events_endpoint else "",
    )
    # The engine's KV pool and the imported modules are long-lived: keep them out of the cyclic
    # GC's full collections, which otherwise stall the loop for tens of milliseconds under load
    # (measured in benchmarks/sim_realtime.py). The process is ours, so this global is fine here.
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await replica.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        print(f"fleet-replica: error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # optional: plain asyncio works, a little slower
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(settings))
    except SettingsError as exc:
        print(f"fleet-replica: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # port in use, cannot bind the KV endpoint, ...
        print(f"fleet-replica: error: {exc}", file=sys.stderr)
        return 1
    return 0
