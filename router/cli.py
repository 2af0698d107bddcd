"""The `fleet-router` command.

fleet-router serve                      # 4 simulated replicas in-process, router on :8080
fleet-router serve --replica http://gpu-1:8000 --replica http://gpu-2:8000 --policy NAME
fleet-router demo ...                   # the load-test demo (loadtest.demo)
fleet-router policies                   # list routing policies (the default marked)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence

from router import __version__
from router.app import running_gateway
from router.config import RouterConfig, add_config_arguments, config_from_args
from router.errors import ConfigError
from router.hotpath import hot_path_build
from router.policies import DEFAULT_POLICY, POLICIES, PolicySettings, make_policy

__all__ = ["main"]

log = logging.getLogger("router")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet-router",
        description="A cache-aware, OpenAI-compatible router for fleets of vLLM replicas.",
    )
    parser.add_argument("--version", action="version", version=f"fleet-router {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the router (with no --replica: in front of 4 in-process simulated replicas)",
        description="Run the router. Settings: flags > FLEET_ROUTER_* env > --config YAML.",
    )
    add_config_arguments(serve)
    commands.add_parser("demo", help="run the load-test demo (see `fleet-router demo --help`)")
    commands.add_parser("policies", help="list the routing policies")
    return parser


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve(config: RouterConfig) -> None:
    """Run a gateway in the foreground until SIGINT/SIGTERM, then drain and exit.

    With `workers` > 1 this process only supervises: `workers` forked processes each run a
    gateway with its own event loop on the same port (SO_REUSEPORT), sharing state in Redis.
    """
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.workers > 1:
        raise SystemExit(_supervise_workers(config))
    _serve_one(config, reuse_port=False)


def _supervise_workers(config: RouterConfig) -> int:
    """Fork the workers (no loop or thread exists yet), forward SIGINT/SIGTERM, wait for all."""
    # fork, not spawn: the config holds read-only mappings that do not pickle, and the
    # workers need nothing the parent has not already imported.
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(
            target=_serve_one, args=(config, True), name=f"fleet-router-worker-{i}", daemon=False
        )
        for i in range(config.workers)
    ]
    for worker in workers:
        worker.start()
    log.info(
        "fleet-router: %d worker processes on %s:%d sharing state through %s (pids %s)",
        len(workers),
        config.host,
        config.port,
        config.redis_url,
        ", ".join(str(w.pid) for w in workers),
    )

    def forward(signum: int, _frame: object) -> None:
        for worker in workers:
            if worker.pid is not None and worker.is_alive():
                os.kill(worker.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = []
    for worker in workers:
        worker.join()
        codes.append(worker.exitcode or 0)
    return max(codes, key=abs)


def _serve_one(config: RouterConfig, reuse_port: bool) -> None:
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve_until_signalled(config, reuse_port))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _serve_until_signalled(config: RouterConfig, reuse_port: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with running_gateway(config, config.host, config.port, reuse_port=reuse_port):
        log.info(
            "fleet-router %s listening on http://%s:%d (policy %s, pid %d, hot path %s)",
            __version__,
            config.host,
            config.port,
            config.policy,
            os.getpid(),
            hot_path_build(),
        )
        # Everything allocated so far lives as long as the process: keep it out of the
        # collector's way (fewer, cheaper collections on the request path).
        gc.collect()
        gc.freeze()
        # Requests allocate container objects that die young, by refcount; a young-generation
        # collection costs in proportion to what is alive at that moment (the requests in
        # flight), so collecting 100x less often does 100x less of that work.
        gc.set_threshold(70_000, 10, 10)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fleet-router` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:
        from loadtest.demo import main as demo_main  # the load tester is optional at run time

        result = demo_main(args_list[1:])
        return int(result or 0)
    args = _parser().parse_args(args_list)
    if args.command == "policies":
        # One name a line, the default marked after it (`awk '{print $1}'` still lists names).
        for name in sorted(POLICIES):
            print(f"{name} (default)" if name == DEFAULT_POLICY else name)
        return 0
    try:
        config = config_from_args(args)
        # Fail fast on a bad policy name or option, before anything starts.
        make_policy(
            config.policy,
            PolicySettings(seed=config.seed, block_units=config.block_units,
                           options=config.policy_options),
        )  # fmt: skip
    except ConfigError as exc:
        print(f"fleet-router: {exc.message}", file=sys.stderr)
        return 2
    serve(config)
    return 0
