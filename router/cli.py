"""The `fleet-router` command.

fleet-router serve                      # 4 simulated replicas in-process, router on :8080
fleet-router serve --replica http://gpu-1:8000 --replica http://gpu-2:8000 --policy NAME
fleet-router demo ...                   # the load-test demo (loadtest.demo)
fleet-router policies                   # list routing policies
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from router import __version__
from router.app import create_app
from router.config import RouterConfig, add_config_arguments, config_from_args
from router.errors import ConfigError
from router.policies import POLICIES, PolicySettings, make_policy

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
    """Run a gateway in the foreground until SIGINT/SIGTERM, then drain and exit."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    app = create_app(config)

    async def _announce(app: web.Application) -> None:
        log.info(
            "fleet-router %s listening on http://%s:%d (policy %s)",
            __version__,
            config.host,
            config.port,
            config.policy,
        )

    app.on_startup.append(_announce)
    # Everything allocated so far lives as long as the process: keep it out of the collector's
    # way (fewer, cheaper collections on the request path).
    gc.collect()
    gc.freeze()
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        shutdown_timeout=config.drain_timeout_s,
        handler_cancellation=True,
        access_log=logging.getLogger("router.access") if config.access_log else None,
        backlog=4096,
        print=None,
        loop=loop,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fleet-router` console script."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:
        from loadtest.demo import main as demo_main  # the load tester is optional at run time

        result = demo_main(args_list[1:])
        return int(result or 0)
    args = _parser().parse_args(args_list)
    if args.command == "policies":
        for name in sorted(POLICIES):
            print(name)
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
