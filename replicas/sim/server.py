"""The simulated replica's HTTP server: vLLM's OpenAI-compatible API around the engine.

Routes (vLLM's, plus SGLang's info endpoints so sglang-router / vllm-router can use it)::

    POST /v1/completions  /v1/chat/completions      generation, JSON or SSE
    POST /v1/embeddings  /tokenize  /detokenize
    GET  /v1/models  /health  /ping  /version  /metrics
    GET  /get_model_info  /model_info  /get_server_info  /server_info

Handlers parse (`replicas.sim.api`), submit to the real-time driver (`replicas.sim.runtime`) and
format; `SimApiError` becomes an OpenAI-style body in one middleware. Everything a replica owns
(engine task, ZMQ sockets) is started and stopped by the application's cleanup contexts, and lives
in typed app state: several replicas run in one process.

Embedding API::

    async with running_replica(SimSettings(port=0, time_scale=0.02)) as replica:
        ... replica.url ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from replicas.sim import api
from replicas.sim.api import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    GenerationParams,
    InjectedFailure,
    ModelNotFound,
    SimApiError,
)
from replicas.sim.engine import Engine, EngineRequest
from replicas.sim.faults import FaultInjector
from replicas.sim.kv_publisher import KVEventPublisher
from replicas.sim.lengths import OutputLengthDistribution, draw_output_length
from replicas.sim.metrics import SimMetrics
from replicas.sim.prompt_encoder import PromptEncoder
from replicas.sim.runtime import EngineRuntime, RequestStream, build_engine, resolve_max_model_len
from replicas.sim.settings import SimSettings
from replicas.sim.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "REPLICA",
    "VLLM_COMPAT_VERSION",
    "OutputPlan",
    "ReplicaState",
    "SimReplica",
    "create_app",
    "plan_output",
    "running_replica",
    "start_replica",
]

log = logging.getLogger(__name__)

# The vLLM release whose API and metric names the simulator follows (GET /version).
VLLM_COMPAT_VERSION = "0.11.0"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


# ------------------------------------------------------------------------------------ state


class _CrashSwitch:
    """Makes the replica die like a killed process (fault injection `crash_after_requests`)."""

    def __init__(self) -> None:
        self.crashed = False
        self._runner: web.BaseRunner | None = None
        self._sites: list[web.BaseSite] = []

    def attach(self, runner: web.BaseRunner, sites: list[web.BaseSite]) -> None:
        self._runner = runner
        self._sites = sites

    async def trigger(self, request: web.Request) -> None:
        if not self.crashed:
            log.warning("fault injection: replica crashes now")
        self.crashed = True
        for site in self._sites:
            with contextlib.suppress(RuntimeError):
                await site.stop()  # closes the listening socket at once
        self._sites = []
        server = self._runner.server if self._runner is not None else None
        if server is not None:
            for handler in server.connections:
                if handler.transport is not None:
                    handler.transport.abort()
        if request.transport is not None:
            request.transport.abort()


@dataclass
class ReplicaState:
    """Everything one replica owns; stored in the app under `REPLICA`."""

    settings: SimSettings
    engine: Engine
    runtime: EngineRuntime
    tokenizer: Tokenizer
    encoder: PromptEncoder  # tokenizes long prompts off the event loop
    registry: CollectorRegistry
    metrics: SimMetrics
    faults: FaultInjector
    max_model_len: int
    length_dist: OutputLengthDistribution
    publisher: KVEventPublisher | None = None
    crash: _CrashSwitch = field(default_factory=_CrashSwitch)
    started_at: float = field(default_factory=time.time)


REPLICA = web.AppKey("sim_replica", ReplicaState)


def _cache_config_labels(settings: SimSettings, engine: Engine) -> dict[str, str]:
    """Labels of `vllm:cache_config_info`, as vLLM's CacheConfig.metrics_info() renders them."""
    cfg = engine.config
    return {
        "block_size": str(cfg.block_size),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(cfg.num_gpu_blocks),
        "num_gpu_blocks_override": str(settings.num_gpu_blocks),
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        "swap_space": "4",
    }


def _build_state(settings: SimSettings, registry: CollectorRegistry | None) -> ReplicaState:
    publisher: KVEventPublisher | None = None
    if settings.kv_events_endpoint is not None:
        publisher = KVEventPublisher(
            settings.kv_events_endpoint,
            topic=settings.kv_events_topic,
            encoding=settings.kv_events_encoding,
            replay_endpoint=settings.kv_events_replay_endpoint,
            buffer_steps=settings.kv_events_buffer_steps,
            hwm=settings.kv_events_hwm,
        )
    tokenizer = load_tokenizer(settings.tokenizer_path)
    engine = build_engine(settings, kv_event_sink=publisher, output_vocab=tokenizer.output_ids)
    max_model_len = resolve_max_model_len(settings, engine.config)
    registry = registry if registry is not None else CollectorRegistry()
    metrics = SimMetrics(
        registry,
        model_name=settings.model,
        stats=engine.stats,
        max_model_len=max_model_len,
        cache_config=_cache_config_labels(settings, engine),
    )
    runtime = EngineRuntime(
        engine,
        time_scale=settings.time_scale,
        observer=metrics,
        after_step=publisher.flush if publisher is not None else None,
    )
    return ReplicaState(
        settings=settings,
        engine=engine,
        runtime=runtime,
        tokenizer=tokenizer,
        encoder=PromptEncoder(tokenizer),
        registry=registry,
        metrics=metrics,
        faults=FaultInjector(
            seed=settings.seed,
            failure_rate=settings.failure_rate,
            stall_before_first_byte_s=settings.stall_before_first_byte_s,
            crash_after_requests=settings.crash_after_requests,
        ),
        max_model_len=max_model_len,
        length_dist=OutputLengthDistribution(
            kind=settings.output_len_kind,
            mean=settings.output_len_mean,
            low=settings.output_len_low,
            high=settings.output_len_high,
        ),
        publisher=publisher,
    )


# ------------------------------------------------------------------------- pure decisions


def _mix_seed(*parts: object) -> int:
    return xxhash.xxh64_intdigest(repr(parts).encode())


def _u32_le_bytes(token_ids: tuple[int, ...]) -> bytes:
    """Token ids as little-endian uint32 bytes (array in C: 32k ids in ~0.1 ms, not 2 ms)."""
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - not on any platform CPython builds for today
        return b"".join(t.to_bytes(4, "little") for t in token_ids)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """What the engine will generate for one request."""

    output_tokens: int
    finish_reason: str  # "length" (max_tokens reached) or "stop" (the simulated EOS)
    token_seed: int  # seeds the generated token ids
    max_tokens: int  # resolved max_tokens (static batching reserves KV for it)


def plan_output(
    *,
    params: GenerationParams,
    prompt_token_ids: tuple[int, ...],
    max_model_len: int,
    settings_seed: int,
    dist: OutputLengthDistribution,
) -> OutputPlan:
    """The output of one request; `BadRequest` if it cannot fit the context.

    max_tokens defaults, as in vLLM, to the context left after the prompt. With ignore_eos the
    request generates exactly max_tokens ("length"); otherwise an EOS is simulated at a length
    drawn reproducibly from (seed, request seed, prompt), capped at max_tokens ("stop" when the EOS
    came first). Token contents depend on the same key, so a repeated request repeats its text.
    """
    prompt_len = len(prompt_token_ids)
    if params.max_tokens is None:
        max_tokens = max_model_len - prompt_len
        if max_tokens < 1:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt has {prompt_len} tokens, which leaves no room for the completion. "
                "Please reduce the length of the prompt.",
                param="prompt",
            )
    else:
        max_tokens = params.max_tokens
        if prompt_len + max_tokens > max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                param="max_tokens",
            )
    prompt_key = xxhash.xxh3_64_hexdigest(_u32_le_bytes(prompt_token_ids))
    request_key = f"{params.seed}:{prompt_key}"
    token_seed = _mix_seed(settings_seed, request_key)
    if params.ignore_eos:
        return OutputPlan(max_tokens, "length", token_seed, max_tokens)
    n = draw_output_length(dist, settings_seed, request_key, max_tokens, params.min_tokens)
    return OutputPlan(n, "stop" if n < max_tokens else "length", token_seed, max_tokens)


# --------------------------------------------------------------------------------- middleware


def _undeliverable() -> web.Response:
    """What a handler returns when nobody can receive it any more (connection aborted or gone):
    aiohttp's attempt to send it fails quietly, without the error log a raised exception gets."""
    return web.Response(status=499)


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _error_response(err: SimApiError) -> web.Response:
    return web.Response(
        body=api.error_body(err), status=err.status, content_type="application/json"
    )


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    state = request.app[REPLICA]
    if state.crash.crashed:  # a dead process answers nothing
        await state.crash.trigger(request)
        return _undeliverable()
    try:
        return await handler(request)
    except SimApiError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(api.RouteError(exc.status, exc.reason))


# ------------------------------------------------------------------------ generation handlers


async def _read_json(request: web.Request) -> dict[str, Any]:
    return api.parse_json_object(await request.read())


def _check_model(state: ReplicaState, model: str | None) -> str:
    if model is None:
        return state.settings.model
    if model not in state.settings.served_model_names:
        raise ModelNotFound(model)
    return model


def _check_vocab(state: ReplicaState, token_ids: tuple[int, ...], param: str) -> None:
    vocab = state.tokenizer.vocab_size
    if token_ids and max(token_ids) >= vocab:  # max() in C: 32k ids in ~0.2 ms
        bad = next(t for t in token_ids if t >= vocab)
        raise BadRequest(f"Token id {bad} is out of vocabulary", param=param)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[REPLICA]
    return await _generate(request, state, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[REPLICA]
    return await _generate(request, state, "chat")


async def _generate(
    request: web.Request, state: ReplicaState, kind: api.Kind
) -> web.StreamResponse:
    fault = state.faults.next_request()
    if fault.crash:
        await state.crash.trigger(request)
        return _undeliverable()
    body = await _read_json(request)
    parsed: CompletionRequest | ChatRequest = (
        api.parse_chat(body) if kind == "chat" else api.parse_completion(body)
    )
    model = _check_model(state, parsed.model)
    params = parsed.params
    if isinstance(parsed, ChatRequest):
        prompt_text = api.render_chat(
            parsed.messages, add_generation_prompt=parsed.add_generation_prompt
        )
        prompt_ids = tuple(await state.encoder.encode(prompt_text, parsed.add_special_tokens))
    elif isinstance(parsed.prompt, str):
        prompt_text = parsed.prompt
        prompt_ids = tuple(await state.encoder.encode(prompt_text, parsed.add_special_tokens))
    else:
        prompt_text = ""
        prompt_ids = parsed.prompt
        _check_vocab(state, prompt_ids, "prompt")
    if not prompt_ids:
        raise BadRequest("The prompt is empty after tokenization.", param="prompt")
    plan = plan_output(
        params=params,
        prompt_token_ids=prompt_ids,
        max_model_len=state.max_model_len,
        settings_seed=state.settings.seed,
        dist=state.length_dist,
    )
    if fault.fail:
        raise InjectedFailure("Injected failure (simulated replica fault injection).")
    if fault.stall_s > 0:
        await asyncio.sleep(fault.stall_s)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    engine_request = EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        output_tokens=plan.output_tokens,
        finish_reason=plan.finish_reason,
        cache_salt=params.cache_salt,
        priority=params.priority,
        seed=plan.token_seed,
        max_tokens=plan.max_tokens,
    )
    try:
        stream = state.runtime.submit(engine_request)
    except ValueError as exc:
        raise BadRequest(f"The request cannot be served: {exc}", param="prompt") from None
    created = int(time.time())
    try:
        if params.stream:
            return await _stream(request, state, kind, stream, params, model, created)
        collected = await _collect(request, state, stream, params)
        if collected is None:
            return _undeliverable()
        text, reason, stop_reason = collected
        if isinstance(parsed, CompletionRequest) and parsed.echo:
            text = (prompt_text or state.tokenizer.decode(prompt_ids)) + text
        usage = _usage(stream)
        body = api.response_body(kind, request_id, model, created, text, reason, stop_reason, usage)
        return _json(body)
    finally:
        if not stream.finished:  # the client went away, or we are shutting down
            state.runtime.abort(request_id)


def _usage(stream: RequestStream) -> api.Usage:
    return api.Usage(
        prompt_tokens=stream.num_prompt_tokens,
        completion_tokens=stream.num_output_tokens,
        cached_tokens=stream.num_cached_tokens,
    )


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _collect(
    request: web.Request, state: ReplicaState, stream: RequestStream, params: GenerationParams
) -> tuple[str, str, str | None] | None:
    """Wait for a whole non-streamed answer: (text, finish_reason, stop_reason); None when the
    client went away meanwhile (its engine request is aborted)."""
    detok = api.IncrementalDetokenizer(state.tokenizer.decode)
    stops = api.StopChecker(params.stop, params.min_tokens)
    parts: list[str] = []
    while True:
        batch = await stream.next_batch()
        if _client_gone(request):
            state.runtime.abort(stream.request_id)
            return None
        delta = detok.push(batch.token_ids, final=batch.finished)
        released, hit = stops.push(delta, len(batch.token_ids), final=batch.finished)
        parts.append(released)
        if hit is not None:
            state.runtime.finish(stream.request_id, "stop")
            return "".join(parts), "stop", hit
        if batch.finished:
            return "".join(parts), batch.finish_reason or "abort", None


async def _stream(
    request: web.Request,
    state: ReplicaState,
    kind: api.Kind,
    stream: RequestStream,
    params: GenerationParams,
    model: str,
    created: int,
) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    fmt = api.StreamFormatter(kind, stream.request_id, model, created)
    detok = api.IncrementalDetokenizer(state.tokenizer.decode)
    stops = api.StopChecker(params.stop, params.min_tokens)
    continuous = params.continuous_usage_stats
    try:
        # Inside the try: a client that closed (or half-closed) its side before the headers
        # went out makes this raise too. aiohttp's own attempt to finish the response then
        # fails quietly, as it does for any response to a departed client.
        await response.prepare(request)
        # Like vLLM's serving_chat, the role chunk goes out with the first engine output, i.e.
        # after prefill: a router reading the first body byte as "prefill done" is then right.
        role_pending = kind == "chat"
        while True:
            batch = await stream.next_batch()
            if role_pending:
                role_pending = False
                await response.write(fmt.role_chunk())
            delta = detok.push(batch.token_ids, final=batch.finished)
            released, hit = stops.push(delta, len(batch.token_ids), final=batch.finished)
            if hit is not None:
                state.runtime.finish(stream.request_id, "stop")
                usage = _usage(stream) if continuous else None
                await response.write(fmt.final_chunk(released, "stop", hit, usage))
                break
            if batch.finished:
                if batch.finish_reason == "abort":  # the replica is shutting down
                    return response
                usage = _usage(stream) if continuous else None
                await response.write(
                    fmt.final_chunk(released, batch.finish_reason or "length", None, usage)
                )
                break
            if released or continuous:
                await response.write(
                    fmt.delta_chunk(released, _usage(stream) if continuous else None)
                )
        if params.include_usage:
            await response.write(fmt.usage_chunk(_usage(stream)))
        await response.write(api.DONE_EVENT)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client left before its stream ended: %s", stream.request_id)
        state.runtime.abort(stream.request_id)
    return response


# ------------------------------------------------------------------------------ other routes


async def models(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    s = state.settings
    return _json(api.models_response(s.served_model_names, s.model, state.max_model_len))


async def health(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    if not state.runtime.running:
        return web.Response(status=503)
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return _json({"version": VLLM_COMPAT_VERSION})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    body = generate_latest(state.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    parsed = api.parse_tokenize(await _read_json(request))
    _check_model(state, parsed.model)
    tokens = await state.encoder.encode(parsed.text, parsed.add_special_tokens)
    strs = state.tokenizer.convert_ids_to_tokens(tokens) if parsed.return_token_strs else None
    return _json(api.tokenize_response(tokens, state.max_model_len, strs))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    parsed = api.parse_detokenize(await _read_json(request))
    _check_model(state, parsed.model)
    _check_vocab(state, parsed.tokens, "tokens")
    # vLLM decodes with the HF default here: special tokens are kept
    text = state.tokenizer.decode(parsed.tokens, skip_special_tokens=False)
    return _json(api.detokenize_response(text))


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[REPLICA]
    parsed = api.parse_embeddings(await _read_json(request))
    model = _check_model(state, parsed.model)
    dim = parsed.dimensions or state.settings.embedding_dim
    vectors = []
    prompt_tokens = 0
    for item in parsed.inputs:
        ids = tuple(await state.encoder.encode(item, True)) if isinstance(item, str) else item
        if len(ids) > state.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {state.max_model_len} tokens. However, "
                f"you requested {len(ids)} tokens in the input for embedding generation.",
                param="input",
            )
        prompt_tokens += len(ids)
        vectors.append(api.embedding_vector(ids, dim, xxhash.xxh64_intdigest))
    request_id = f"embd-{uuid.uuid4().hex}"
    return _json(
        api.embeddings_response(request_id, model, vectors, parsed.encoding_format, prompt_tokens)
    )


async def model_info(request: web.Request) -> web.Response:
    """SGLang's /get_model_info."""
    s = request.app[REPLICA].settings
    return _json(
        {
            "model_path": s.model,
            "tokenizer_path": s.tokenizer_path or s.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """SGLang's /get_server_info: its server args plus a little live state."""
    state = request.app[REPLICA]
    s = state.settings
    cfg = state.engine.config
    stats = state.engine.stats()
    return _json(
        {
            "model_path": s.model,
            "tokenizer_path": s.tokenizer_path or s.model,
            "served_model_name": s.model,
            "host": s.host,
            "port": s.port,
            "tp_size": 1,
            "dp_size": 1,
            "page_size": cfg.block_size,
            "context_length": state.max_model_len,
            "max_running_requests": cfg.max_num_seqs,
            "max_total_num_tokens": cfg.capacity_tokens,
            "chunked_prefill_size": (
                cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else -1
            ),
            "max_prefill_tokens": cfg.max_num_batched_tokens,
            "disable_radix_cache": not cfg.enable_prefix_caching,
            "schedule_policy": "fcfs",
            "random_seed": s.seed,
            "version": VLLM_COMPAT_VERSION,
            "internal_states": [
                {
                    "num_running_reqs": stats.num_running,
                    "num_waiting_reqs": stats.num_waiting,
                    "token_usage": stats.kv_cache_usage,
                    "avg_spec_accept_length": None,
                }
            ],
            "simulator": {
                "profile": s.profile,
                "scheduling": cfg.scheduling,
                "time_scale": s.time_scale,
                "kv_events_endpoint": s.kv_events_endpoint,
            },
        }
    )


# ------------------------------------------------------------------------------ application


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's connection-level logger for one replica, minus tracebacks that are not errors
    of ours: a peer that does not speak HTTP/1.1 (sglang-router's HTTP/2 preface probe, a TLS
    hello; aiohttp answers it 400 and closes) or a client that left while its answer was being
    written. Those get one debug line; anything else is logged as aiohttp logs it."""

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        exc_info = kwargs.get("exc_info", True)
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError | ConnectionError):
            text = msg % args if args and isinstance(msg, str) else msg
            detail = " ".join(str(exc).split())  # aiohttp's parser errors span lines
            self.debug("%s: %s: %s", text, type(exc).__name__, detail)
            return
        super().exception(msg, *args, **kwargs)


def create_app(
    settings: SimSettings, *, registry: CollectorRegistry | None = None
) -> web.Application:
    """The replica as an aiohttp application (for `web.AppRunner` or aiohttp's test utilities).

    A fresh Prometheus registry is made unless one is passed in.
    """
    app = web.Application(middlewares=[_errors_middleware], client_max_size=64 * 1024**2)
    app[REPLICA] = _build_state(settings, registry)
    app.cleanup_ctx.append(_publisher_ctx)
    app.cleanup_ctx.append(_encoder_ctx)
    app.cleanup_ctx.append(_runtime_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, server_info)
    return app


async def _publisher_ctx(app: web.Application) -> AsyncIterator[None]:
    publisher = app[REPLICA].publisher
    if publisher is None:
        yield
        return
    await publisher.open()
    try:
        yield
    finally:
        await publisher.close()


async def _encoder_ctx(app: web.Application) -> AsyncIterator[None]:
    encoder = app[REPLICA].encoder
    encoder.open()
    try:
        yield
    finally:
        await encoder.close()


async def _runtime_ctx(app: web.Application) -> AsyncIterator[None]:
    runtime = app[REPLICA].runtime
    runtime.start()
    try:
        yield
    finally:
        await runtime.stop()


class SimReplica:
    """A running replica: its URL, settings and engine; `await stop()` to shut it down."""

    def __init__(self, app: web.Application, runner: web.AppRunner, url: str, port: int) -> None:
        self.app = app
        self._runner = runner
        self.url = url
        self.port = port
        self._stopped = False

    @property
    def state(self) -> ReplicaState:
        return self.app[REPLICA]

    @property
    def settings(self) -> SimSettings:
        return self.state.settings

    @property
    def engine(self) -> Engine:
        return self.state.engine

    @property
    def runtime(self) -> EngineRuntime:
        return self.state.runtime

    @property
    def registry(self) -> CollectorRegistry:
        return self.state.registry

    @property
    def crashed(self) -> bool:
        return self.state.crash.crashed

    async def stop(self) -> None:
        """Close connections, stop the engine task and the KV publisher (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        await self._runner.cleanup()


async def start_replica(
    settings: SimSettings, *, registry: CollectorRegistry | None = None
) -> SimReplica:
    """Start a replica listening on settings.host:settings.port (port 0 picks a free port)."""
    app = create_app(settings, registry=registry)
    # handler_cancellation: a client that disconnects cancels its handler, whose `finally`
    # aborts the engine request and frees its KV blocks, as vLLM does.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=1.0,
        logger=_ServerLog(logging.getLogger("replicas.sim.http"), {}),
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = int(runner.addresses[0][1])
    app[REPLICA].crash.attach(runner, [site])
    url = f"http://{settings.host}:{port}"
    return SimReplica(app, runner, url, port)


@contextlib.asynccontextmanager
async def running_replica(
    settings: SimSettings, *, registry: CollectorRegistry | None = None
) -> AsyncIterator[SimReplica]:
    """`start_replica` as an async context manager that always stops the replica."""
    replica = await start_replica(settings, registry=registry)
    try:
        yield replica
    finally:
        await replica.stop()
