"""``fleet-loadtest``: run a workload against a target, compare targets, or write a trace.

    fleet-loadtest run --target URL --workload NAME [--num-requests N | --duration S]
        [--rate R [--burstiness K] | --concurrency C] [--slo ttft=200ms,tpot=50ms]
        [--replica-metrics URL ...] [--json FILE] [--plot FILE] [--seed N] [--model NAME]
    fleet-loadtest compare [--policy NAME ...] [--replicas N] ... (see ``compare --help``)
    fleet-loadtest make-trace --workload NAME --rate R --num-requests N --output FILE

Bad arguments end in an argparse error (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Callable, Sequence

from rich.console import Console

from loadtest.drivers import DriverConfig
from loadtest.stats import Slo, parse_slo
from loadtest.workloads import WORKLOADS, WorkloadError, make_workload

__all__ = [
    "add_driver_arguments",
    "add_workload_arguments",
    "driver_from_args",
    "main",
    "workload_params_from_args",
]


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def _slo(text: str) -> Slo:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http(s):// URL, got {text!r}")
    return text.rstrip("/")


def add_workload_arguments(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    """``--workload`` and its parameters (shared by run, compare and make-trace)."""
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default=default,
        required=default is None,
        help="workload name",
    )
    group.add_argument(
        "-W",
        "--workload-param",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload parameter, e.g. -W num_groups=8 (repeatable)",
    )
    group.add_argument("--trace", metavar="FILE", help="JSONL trace for --workload trace")
    group.add_argument(
        "--cap", type=_positive_int, help="output-length cap of --workload output-variance"
    )
    group.add_argument("--seed", type=int, default=0, help="workload and arrival seed")


def add_driver_arguments(parser: argparse.ArgumentParser) -> None:
    """Bounds, loop type, warm-up."""
    group = parser.add_argument_group("load")
    group.add_argument(
        "--num-requests", type=_positive_int, help="measured requests (default: one workload pass)"
    )
    group.add_argument("--duration", type=_positive_float, metavar="S", help="stop sending after S")
    group.add_argument(
        "--rate",
        type=_positive_float,
        metavar="R",
        help="open loop: requests (or conversations) per second; inf = all at once (default)",
    )
    group.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        metavar="K",
        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier (needs --rate)",
    )
    group.add_argument(
        "--concurrency",
        type=_positive_int,
        metavar="C",
        help="closed loop with C users; with --rate, a cap on requests in flight",
    )
    group.add_argument(
        "--warmup", type=_non_negative_int, default=0, metavar="N", help="warm-up requests"
    )


def workload_params_from_args(args: argparse.Namespace) -> dict[str, str | int]:
    params: dict[str, str | int] = dict(args.workload_param)
    if args.trace is not None:
        params["path"] = args.trace
    if args.cap is not None:
        params["cap"] = args.cap
    return params


def driver_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, natural_size: int
) -> DriverConfig:
    if args.burstiness != 1.0 and args.rate is None:
        parser.error("--burstiness needs --rate")
    num = args.num_requests
    if num is None and args.duration is None:
        num = natural_size
    try:
        return DriverConfig(
            num_requests=num,
            duration_s=args.duration,
            rate_per_s=args.rate,
            burstiness=args.burstiness,
            concurrency=args.concurrency,
            warmup_requests=args.warmup,
            seed=args.seed,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet-loadtest", description="Load tester for OpenAI-compatible LLM servers."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one workload against one target")
    run.add_argument(
        "--target",
        type=_url,
        action="append",
        required=True,
        metavar="URL",
        help="base URL (a router or a replica); repeat for a client-side round robin",
    )
    add_workload_arguments(run, default=None)
    add_driver_arguments(run)
    _add_output_arguments(run)
    run.set_defaults(subparser=run)

    from loadtest.compare import add_compare_arguments

    compare = sub.add_parser(
        "compare", help="the same seeded workload against several routers, each on fresh replicas"
    )
    add_workload_arguments(compare, default="shared-prefix")
    add_driver_arguments(compare)
    add_compare_arguments(compare)
    compare.set_defaults(subparser=compare)

    trace = sub.add_parser("make-trace", help="write a workload's requests as a JSONL trace")
    add_workload_arguments(trace, default=None)
    trace.add_argument("--rate", type=_positive_float, required=True, metavar="R")
    trace.add_argument("--burstiness", type=_positive_float, default=1.0, metavar="K")
    trace.add_argument("--num-requests", type=_positive_int, required=True)
    trace.add_argument("--output", "-o", required=True, metavar="FILE")
    trace.set_defaults(subparser=trace)
    return parser


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("measurement and output")
    group.add_argument("--model", help="model name (default: first of the target's /v1/models)")
    group.add_argument("--slo", type=_slo, help="goodput SLOs, e.g. ttft=200ms,tpot=50ms")
    group.add_argument(
        "--replica-metrics",
        type=_url,
        action="append",
        default=[],
        metavar="URL",
        help="a replica whose /metrics to diff over the run (repeatable)",
    )
    group.add_argument(
        "--request-timeout", type=_positive_float, default=300.0, metavar="S", help="per request"
    )
    group.add_argument("--label", default="", help="name of this run in the table and JSON")
    group.add_argument("--json", metavar="FILE", help="write the result as JSON")
    group.add_argument("--plot", metavar="FILE", help="write a PNG (latency CDFs, shares, time)")


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from loadtest.plot import PlotRun, plot_run
    from loadtest.report import output_console, result_json, summary_table, write_json
    from loadtest.runner import RunError, RunSettings, execute

    params = workload_params_from_args(args)
    try:
        workload = make_workload(args.workload, params, seed=args.seed)
    except WorkloadError as exc:
        parser.error(str(exc))
    driver = driver_from_args(parser, args, workload.natural_size)
    settings = RunSettings(
        targets=tuple(args.target),
        workload=args.workload,
        workload_params=params,
        driver=driver,
        seed=args.seed,
        model=args.model,
        slo=args.slo or Slo(),
        replica_metrics=tuple(args.replica_metrics),
        request_timeout_s=args.request_timeout,
        label=args.label,
    )
    console = output_console()
    try:
        outcome = asyncio.run(execute(settings, console=Console(stderr=True)))
    except (RunError, WorkloadError) as exc:
        print(f"fleet-loadtest: error: {exc}", file=sys.stderr)
        return 1
    console.print(summary_table(outcome.summary, outcome.meta.label))
    if args.json:
        write_json(args.json, result_json(outcome.summary, outcome.meta))
    if args.plot:
        result = outcome.result
        plot_run(
            args.plot,
            PlotRun(outcome.meta.label, result.records, result.started_s, outcome.summary),
        )
    return 0 if outcome.summary.completed else 1


def _make_trace(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import random

    from loadtest.arrivals import arrival_offsets
    from loadtest.trace import write_trace
    from loadtest.workloads import take_requests

    try:
        workload = make_workload(args.workload, workload_params_from_args(args), seed=args.seed)
        specs = take_requests(workload, args.num_requests)
    except WorkloadError as exc:
        parser.error(str(exc))
    offsets = arrival_offsets(len(specs), args.rate, args.burstiness, random.Random(args.seed))
    count = write_trace(args.output, zip(offsets, specs, strict=True))
    print(f"wrote {count} requests to {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fleet-loadtest``."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    sub: argparse.ArgumentParser = args.subparser  # errors print the subcommand's usage
    if args.command == "run":
        return _run(sub, args)
    if args.command == "compare":
        from loadtest.compare import run_compare_cli

        return run_compare_cli(sub, args)
    return _make_trace(sub, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
