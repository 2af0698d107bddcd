"""Typed, frozen settings of the gateway, parsed once at the edge.

Sources, lowest to highest precedence: defaults < YAML file (`--config FILE` or
`FLEET_ROUTER_CONFIG`) < environment (`FLEET_ROUTER_<FIELD>`) < command-line flags.  Every field
has one flag (`--field-name`, tuples repeat a singular flag such as `--replica URL`), one
environment variable and one YAML key (the field name).  Validation happens in one place,
`RouterConfig.__post_init__`, whatever the source.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import yaml

from router.errors import ConfigError
from router.prefix.kv_spec import parse_kv_events_spec

__all__ = [
    "ENV_PREFIX",
    "DnsTarget",
    "OptionValue",
    "ReplicaSpec",
    "RouterConfig",
    "add_config_arguments",
    "config_from_args",
    "load_config",
    "parse_dns_target",
    "parse_replica_spec",
]

ENV_PREFIX = "FLEET_ROUTER_"
OptionValue = str | int | float | bool

_LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One configured replica: its id (a name, or the base URL when unnamed) and base URL."""

    replica_id: str
    url: str


def parse_replica_spec(text: str) -> ReplicaSpec:
    """Parse `URL` or `NAME=URL` (a trailing slash is dropped) and check the URL's shape."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"replica {text!r}: expected http(s)://host[:port], optionally NAME=URL")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise ConfigError(f"replica {text!r}: {exc}") from None
    return ReplicaSpec(replica_id=name.strip() or url, url=url)


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """A name whose addresses are replicas (`--discover-dns`): each address A resolved for
    `host` is the replica `scheme://A:port` (router.fleet.discovery)."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:  # the metrics label and log text
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def replica_url(self, address: str) -> str:
        """The base URL of the replica at `address` (an IPv4 or IPv6 literal)."""
        if ":" in address:  # IPv6: bracketed, a zone id percent-encoded (RFC 6874)
            address = "[" + address.replace("%", "%25") + "]"
        return f"{self.scheme}://{address}:{self.port}"


def parse_dns_target(text: str) -> DnsTarget:
    """Parse `HOST:PORT` or `http(s)://HOST:PORT` (the scheme defaults to http)."""
    raw = text.strip().rstrip("/")
    parts = urlsplit(raw if "://" in raw else "http://" + raw)
    problem = "expected HOST:PORT or http(s)://HOST:PORT"
    try:
        port = parts.port
    except ValueError as exc:
        port, problem = None, str(exc)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or not port
        or parts.path
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ConfigError(f"discover_dns {text!r}: {problem}")
    return DnsTarget(scheme=parts.scheme, host=parts.hostname, port=port)


def _meta(help_text: str, *, flag: str | None = None) -> dict[str, str]:
    meta = {"help": help_text}
    if flag is not None:
        meta["flag"] = flag
    return meta


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Every setting of one gateway.  Construct it in code with keyword arguments, or with
    `load_config(argv)` from flags, environment and YAML."""

    # --- listening -------------------------------------------------------------------------
    host: str = field(default="0.0.0.0", metadata=_meta("address to listen on"))
    port: int = field(default=8080, metadata=_meta("TCP port to listen on (0 = any free port)"))
    # --- fleet -----------------------------------------------------------------------------
    replicas: tuple[str, ...] = field(
        default=(),
        metadata=_meta("replica base URL, or NAME=URL (repeatable)", flag="--replica"),
    )
    models: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "model /ready waits for (repeatable; default: every model discovered)", flag="--model"
        ),
    )
    # DNS discovery (router.fleet.discovery; docs/gateway.md, "DNS discovery")
    discover_dns: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "[http(s)://]HOST:PORT: every address HOST resolves to is a replica (repeatable; "
            "e.g. a Kubernetes headless Service)",
            flag="--discover-dns",
        ),
    )
    discover_dns_interval_s: float = field(
        default=5.0, metadata=_meta("period of resolving each --discover-dns name")
    )
    discover_dns_grace_rounds: int = field(
        default=2,
        metadata=_meta("rounds in a row an address must be missing before its replica is removed"),
    )
    discover_dns_kv_events_port: int | None = field(
        default=None,
        metadata=_meta(
            "exact mode for discovered replicas: their KV events at tcp://ADDRESS:PORT "
            "(needs --tokenizer)"
        ),
    )
    # --- routing ---------------------------------------------------------------------------
    policy: str = field(default="kv_aware", metadata=_meta("routing policy name"))
    policy_options: Mapping[str, OptionValue] = field(
        default_factory=lambda: types.MappingProxyType({}),
        metadata=_meta("extra policy setting KEY=VALUE (repeatable)", flag="--policy-option"),
    )
    seed: int | None = field(
        default=None, metadata=_meta("seed of the random and power_of_two policies")
    )
    session_header: str = field(
        default="x-session-id", metadata=_meta("header the session policy hashes on")
    )
    block_units: int = field(
        default=64, metadata=_meta("prompt units (characters or tokens) per prefix block")
    )
    # --- prefix index, token mode, exact mode (docs/routing.md) ---------------------------
    chars_per_token: float = field(
        default=4.0, metadata=_meta("characters per model token when prompts are cut by characters")
    )
    prefix_capacity_blocks: int = field(
        default=1 << 16,
        metadata=_meta("a replica's share of the prefix index until its KV capacity is scraped"),
    )
    prefix_max_blocks: int = field(
        default=2_000_000, metadata=_meta("hard cap on prefix-index blocks (memory bound)")
    )
    tokenizer: str | None = field(
        default=None,
        metadata=_meta(
            "token mode: local tokenizer.json (or 'sim') cutting prompts into --block-units tokens"
        ),
    )
    kv_events: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "exact mode: REPLICA=ZMQ_ENDPOINT[,REPLAY_ENDPOINT] of a replica's KV events "
            "(repeatable; needs --tokenizer)",
            flag="--kv-events",
        ),
    )
    # --- proxying --------------------------------------------------------------------------
    connect_timeout_s: float = field(default=2.0, metadata=_meta("upstream connect timeout"))
    first_byte_timeout_s: float = field(
        default=300.0, metadata=_meta("max wait for the first body byte from a replica")
    )
    idle_timeout_s: float = field(
        default=60.0, metadata=_meta("max silence between two chunks from a replica")
    )
    total_timeout_s: float = field(default=900.0, metadata=_meta("max duration of one attempt"))
    max_retries: int = field(
        default=2, metadata=_meta("extra attempts on other replicas before the first byte")
    )
    retry_backoff_base_s: float = field(
        default=0.005, metadata=_meta("first retry backoff (doubles, with full jitter)")
    )
    retry_backoff_max_s: float = field(default=0.25, metadata=_meta("retry backoff cap"))
    max_body_bytes: int = field(
        default=16 * 1024 * 1024, metadata=_meta("largest accepted request body")
    )
    max_connections: int = field(
        default=4096, metadata=_meta("upstream connection pool size (all replicas)")
    )
    max_connections_per_replica: int = field(
        default=0, metadata=_meta("upstream connections per replica (0 = no per-replica cap)")
    )
    # --- fleet health ----------------------------------------------------------------------
    health_interval_s: float = field(default=2.0, metadata=_meta("active health check period"))
    health_timeout_s: float = field(default=1.0, metadata=_meta("active health check timeout"))
    models_refresh_interval_s: float = field(
        default=30.0, metadata=_meta("period of re-reading each replica's /v1/models")
    )
    scrape_interval_s: float = field(
        default=0.5, metadata=_meta("period of scraping each replica's /metrics (0 = off)")
    )
    scrape_timeout_s: float = field(default=1.0, metadata=_meta("metrics scrape timeout"))
    circuit_failure_threshold: int = field(
        default=5, metadata=_meta("consecutive connect errors/5xx that open a replica's circuit")
    )
    circuit_open_s: float = field(
        default=5.0, metadata=_meta("time an open circuit waits before a half-open trial")
    )
    circuit_half_open_trials: int = field(
        default=1, metadata=_meta("concurrent trial requests allowed while half-open")
    )
    retry_after_s: int = field(
        default=1, metadata=_meta("Retry-After seconds sent with 503 no-healthy-replica")
    )
    # --- shared state and worker processes (docs/redis.md) --------------------------------
    redis_url: str | None = field(
        default=None,
        metadata=_meta("share fleet state between router instances through this Redis"),
    )
    redis_prefix: str = field(
        default="fleet-router:", metadata=_meta("prefix of every Redis key this router uses")
    )
    workers: int = field(
        default=1,
        metadata=_meta("router processes on one port (SO_REUSEPORT); > 1 needs --redis-url"),
    )
    # --- admin, lifecycle ------------------------------------------------------------------
    admin_token: str | None = field(
        default=None,
        metadata=_meta("bearer token enabling /admin/replicas (unset = admin API disabled)"),
    )
    drain_timeout_s: float = field(
        default=30.0, metadata=_meta("on SIGTERM, how long in-flight requests may finish")
    )
    log_level: str = field(default="info", metadata=_meta("debug, info, warning or error"))
    access_log: bool = field(default=False, metadata=_meta("log every request"))
    # --- embedded simulated fleet (the zero-configuration default) -------------------------
    sim_replicas: int | None = field(
        default=None,
        metadata=_meta(
            "in-process sim replicas to start (default: 4 when no --replica or --discover-dns, "
            "else 0)"
        ),
    )
    sim_model: str | None = field(
        default=None, metadata=_meta("model name the sim replicas serve (default: the sim's)")
    )
    sim_time_scale: float = field(
        default=1.0, metadata=_meta("sim replica speed: 1 = real time, smaller = faster")
    )

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def replica_specs(self) -> tuple[ReplicaSpec, ...]:
        """The configured replicas, parsed."""
        return tuple(parse_replica_spec(text) for text in self.replicas)

    @property
    def dns_targets(self) -> tuple[DnsTarget, ...]:
        """The `--discover-dns` names, parsed."""
        return tuple(parse_dns_target(text) for text in self.discover_dns)

    @property
    def embedded_sim_replicas(self) -> int:
        """How many sim replicas the gateway starts in-process (4 when no replica configured)."""
        if self.sim_replicas is not None:
            return self.sim_replicas
        return 0 if self.replicas or self.discover_dns else 4


def _validate(cfg: RouterConfig) -> None:
    """The one place settings are checked, whatever their source."""
    # Tuples and mappings may arrive as lists/dicts from code or YAML: normalise in place.
    for name in ("replicas", "models", "kv_events", "discover_dns"):
        value = getattr(cfg, name)
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(f"{name}: expected a list of strings, got {value!r}")
        object.__setattr__(cfg, name, tuple(str(v) for v in value))
    if not isinstance(cfg.policy_options, Mapping):
        raise ConfigError(f"policy_options: expected a mapping, got {cfg.policy_options!r}")
    object.__setattr__(cfg, "policy_options", types.MappingProxyType(dict(cfg.policy_options)))

    problems: list[str] = []
    if not 0 <= cfg.port <= 65535:
        problems.append(f"port must be in 0..65535, got {cfg.port}")
    if not cfg.policy:
        problems.append("policy must not be empty")
    if not cfg.session_header:
        problems.append("session_header must not be empty")
    for name in (
        "connect_timeout_s",
        "first_byte_timeout_s",
        "idle_timeout_s",
        "total_timeout_s",
        "health_interval_s",
        "health_timeout_s",
        "models_refresh_interval_s",
        "discover_dns_interval_s",
        "scrape_timeout_s",
        "circuit_open_s",
        "sim_time_scale",
    ):
        if not getattr(cfg, name) > 0:
            problems.append(f"{name} must be > 0, got {getattr(cfg, name)}")
    for name in ("scrape_interval_s", "retry_backoff_base_s", "retry_backoff_max_s"):
        if getattr(cfg, name) < 0:
            problems.append(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.drain_timeout_s < 0:
        problems.append(f"drain_timeout_s must be >= 0, got {cfg.drain_timeout_s}")
    for name in ("block_units", "max_body_bytes", "max_connections", "circuit_failure_threshold"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name in ("max_retries", "max_connections_per_replica", "retry_after_s"):
        if getattr(cfg, name) < 0:
            problems.append(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.circuit_half_open_trials < 1:
        problems.append("circuit_half_open_trials must be >= 1")
    if cfg.sim_replicas is not None and cfg.sim_replicas < 0:
        problems.append(f"sim_replicas must be >= 0, got {cfg.sim_replicas}")
    if cfg.log_level not in _LOG_LEVELS:
        problems.append(f"log_level must be one of {', '.join(_LOG_LEVELS)}, got {cfg.log_level}")
    if cfg.admin_token is not None and not cfg.admin_token.strip():
        problems.append("admin_token must not be blank (unset it to disable the admin API)")
    ids: set[str] = set()
    for text in cfg.replicas:
        try:
            spec = parse_replica_spec(text)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if spec.replica_id in ids:
            problems.append(f"replica id {spec.replica_id!r} appears twice")
        ids.add(spec.replica_id)
    targets: set[DnsTarget] = set()
    for text in cfg.discover_dns:
        try:
            target = parse_dns_target(text)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        if target in targets:
            problems.append(f"discover_dns {text!r} appears twice")
        targets.add(target)
    if cfg.discover_dns_grace_rounds < 1:
        problems.append(
            f"discover_dns_grace_rounds must be >= 1, got {cfg.discover_dns_grace_rounds}"
        )
    kv_port = cfg.discover_dns_kv_events_port
    if kv_port is not None:
        if not 1 <= kv_port <= 65535:
            problems.append(f"discover_dns_kv_events_port must be in 1..65535, got {kv_port}")
        if not cfg.discover_dns:
            problems.append("discover_dns_kv_events_port needs --discover-dns")
        if cfg.tokenizer is None:
            problems.append(
                "discover_dns_kv_events_port (exact mode) needs --tokenizer: own hashes are over "
                "tokens"
            )
    if not cfg.chars_per_token > 0:
        problems.append(f"chars_per_token must be > 0, got {cfg.chars_per_token}")
    for name in ("prefix_capacity_blocks", "prefix_max_blocks"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.kv_events and cfg.tokenizer is None:
        problems.append("kv_events (exact mode) needs --tokenizer: own hashes are over tokens")
    for text in cfg.kv_events:
        try:
            source_id, _, _ = parse_kv_events_spec(text)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if source_id not in ids:
            problems.append(f"kv_events: {source_id!r} is not a configured replica id")
    if cfg.redis_url is not None and not cfg.redis_url.startswith(
        ("redis://", "rediss://", "unix://")
    ):
        problems.append(
            f"redis_url must start with redis://, rediss:// or unix://: {cfg.redis_url}"
        )
    if not cfg.redis_prefix:
        problems.append("redis_prefix must not be empty")
    if cfg.workers < 1:
        problems.append(f"workers must be >= 1, got {cfg.workers}")
    elif cfg.workers > 1 and cfg.redis_url is None:
        problems.append(
            f"workers = {cfg.workers} needs --redis-url: without shared state each process would "
            "route on its own view of the fleet"
        )
    elif cfg.workers > 1 and cfg.embedded_sim_replicas:
        problems.append("workers > 1 needs --replica: each process would start its own sim fleet")
    elif cfg.workers > 1 and cfg.port == 0:
        problems.append("workers > 1 needs a fixed --port: they share one listening port")
    if problems:
        raise ConfigError("invalid router settings: " + "; ".join(problems))


# --- parsing ---------------------------------------------------------------------------------

_FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
_HINTS = get_type_hints(RouterConfig)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _base_type(name: str) -> tuple[Any, bool]:
    """The field's type without `| None`, and whether None is allowed."""
    hint = _HINTS[name]
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _parse_option_value(text: str) -> OptionValue:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _parse_options(items: Sequence[str]) -> dict[str, OptionValue]:
    out: dict[str, OptionValue] = {}
    for item in items:
        if not item.strip():
            continue  # an empty setting means no option (e.g. `--policy-option "$UNSET"`)
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"policy option {item!r}: expected KEY=VALUE")
        out[key.strip()] = _parse_option_value(value)
    return out


def _coerce(name: str, value: Any) -> Any:
    """Turn a string (env, flag) or YAML scalar/list into the field's type, or raise ConfigError."""
    base, optional = _base_type(name)
    if value is None or (optional and isinstance(value, str) and value.strip() == ""):
        if optional:
            return None
        raise ConfigError(f"{name}: a value is required")
    try:
        if get_origin(base) is tuple:
            items = _split_list(name, value) if isinstance(value, str) else value
            if not isinstance(items, list | tuple):
                raise TypeError
            # Blank items mean nothing: FLEET_ROUTER_KV_EVENTS="" or `--replica "$UNSET"` = none.
            return tuple(
                str(_replica_from_yaml(v) if name == "replicas" else v)
                for v in items
                if not (isinstance(v, str) and not v.strip())
            )
        if base is Mapping or get_origin(base) is Mapping:
            if isinstance(value, str):
                return _parse_options([p for p in value.split(",") if p.strip()])
            if isinstance(value, Mapping):
                return {str(k): v for k, v in value.items()}
            raise TypeError
        if base is bool:
            if isinstance(value, bool):
                return value
            low = str(value).strip().lower()
            if low in _TRUE | _FALSE:
                return low in _TRUE
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base is str:
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise TypeError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot read {value!r} as {_type_name(name)}") from None
    raise ConfigError(f"{name}: unsupported type")  # pragma: no cover - all field types handled


def _split_list(name: str, text: str) -> list[str]:
    """A comma-separated list (environment, YAML scalar); an empty string is an empty list.

    A `kv_events` spec has a comma of its own (`REPLICA=ENDPOINT,REPLAY_ENDPOINT`): a piece
    without `=` is the replay endpoint of the spec before it.
    """
    items = [part.strip() for part in text.split(",") if part.strip()]
    if name != "kv_events":
        return items
    specs: list[str] = []
    for item in items:
        if "=" not in item and specs:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def _type_name(name: str) -> str:
    base, optional = _base_type(name)
    text = getattr(base, "__name__", str(base))
    return f"{text} or null" if optional else text


def _replica_from_yaml(value: Any) -> str:
    """YAML may list replicas as strings or as {name, url} mappings."""
    if isinstance(value, Mapping):
        url = value.get("url")
        if not isinstance(url, str):
            raise TypeError
        name = value.get("name")
        return f"{name}={url}" if name else url
    if not isinstance(value, str):
        raise TypeError
    return value


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {path}: expected a mapping of settings at the top level")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _FIELDS:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        out[name] = _coerce(name, value)
    return out


def _read_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            out[name] = _coerce(name, env[key])
    return out


def _flag(name: str) -> str:
    return str(_FIELDS[name].metadata.get("flag", "--" + name.replace("_", "-")))


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting (plus `--config FILE`); unset flags stay absent from the result."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"YAML settings file (env {ENV_PREFIX}CONFIG); flags and env override it",
    )
    for name, fld in _FIELDS.items():
        base, _ = _base_type(name)
        help_text = f"{fld.metadata.get('help', '')} (env {ENV_PREFIX}{name.upper()})"
        flag = _flag(name)
        if get_origin(base) is tuple or base is Mapping or get_origin(base) is Mapping:
            parser.add_argument(
                flag,
                dest=name,
                action="append",
                default=argparse.SUPPRESS,
                metavar=flag.lstrip("-").replace("-", "_").upper(),
                help=help_text,
            )
        elif base is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text)


def config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> RouterConfig:
    """Merge defaults < YAML < environment < flags into one validated `RouterConfig`."""
    env = os.environ if env is None else env
    given = vars(args)
    merged: dict[str, Any] = {}
    config_file = given.get("config") or env.get(ENV_PREFIX + "CONFIG")
    if config_file:
        merged.update(_read_yaml(config_file))
    merged.update(_read_env(env))
    for name in _FIELDS:
        if name not in given:
            continue
        value = given[name]
        if name == "policy_options":
            merged[name] = {**merged.get(name, {}), **_parse_options(value)}
        else:
            merged[name] = _coerce(name, value)
    return RouterConfig(**merged)


def load_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> RouterConfig:
    """Parse settings from command-line arguments (no subcommand), environment and YAML."""
    parser = argparse.ArgumentParser(prog="fleet-router serve", exit_on_error=False)
    add_config_arguments(parser)
    try:
        args, extra = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ConfigError(str(exc)) from None
    if extra:
        raise ConfigError(f"unrecognised arguments: {' '.join(extra)}")
    return config_from_args(args, env)
