"""The simulated engine: vLLM's iteration-level scheduler over a paged, prefix-cached KV cache.

The engine knows no clock. `Engine.step` decides what one iteration computes, advances every
request it touched, and returns how long that iteration takes under the `CostModel`; the tokens it
returns count as produced at the end of that duration. A real-time driver sleeps that long (the
server); a virtual-time driver just adds it up (`replicas.sim.virtual`).

Scheduling modes (docs/simulator.md has the details):

- ``continuous`` with chunked prefill (vLLM V1): every running sequence decodes one token, then
  the rest of the token budget goes to prefills, FCFS, a partially prefilled prompt first;
- ``continuous`` without chunked prefill: a step either prefills whole waiting prompts (the
  running sequences wait) or decodes every running sequence;
- ``static``: a batch of up to ``max_num_seqs`` is formed, reserves KV for prompt + ``max_tokens``
  per member like pre-paging servers, is prefilled, then decodes until its longest member ends;
  nobody joins mid-batch.

Speed: a decoding sequence is not touched on steps where nothing happens to it. Its progress is
``generated = g0 + (D - d0)`` with ``D`` the number of decode steps so far; it is visited only when
it needs a new KV block (every ``block_size`` tokens), finishes, is preempted or aborted.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replicas.sim.config import EngineConfig
from replicas.sim.cost_model import CostModel
from replicas.sim.kv_cache import BlockPool, hash_block, root_hash
from replicas.sim.kv_events import KVEvent
from replicas.sim.tokenizer import NUM_OUTPUT_TOKENS, output_token, output_tokens

__all__ = [
    "Engine",
    "EngineRequest",
    "EngineStats",
    "RequestOutput",
    "RequestState",
    "StepResult",
    "StepSummary",
]

FINISH_REASONS = ("length", "stop")

_WAITING, _PREFILL, _DECODE, _DONE = 0, 1, 2, 3


@dataclass(frozen=True)
class EngineRequest:
    """One generation request, already tokenized, with its exact output length."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_tokens: int  # exact number of tokens to generate
    finish_reason: str = "length"  # reported when output_tokens are done: "length" or "stop"
    cache_salt: str | None = None
    priority: int = 0  # accepted like vLLM's field; scheduling is FCFS
    seed: int = 0  # seeds the generated token ids
    # The request's max_tokens; static batching reserves KV for prompt + max_tokens (None:
    # output_tokens). Continuous batching never needs it.
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """Tokens one request produced in one step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit when first scheduled, block-aligned
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step computed; its tokens exist at the end of ``duration_s``."""

    duration_s: float
    outputs: tuple[RequestOutput, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: tuple[str, ...]
    # Requests scheduled for the first time in this step (vLLM's first SCHEDULED event): their
    # queue time ends at the step's start. A preempted request re-admitted later is not repeated.
    scheduled: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Gauges and cumulative counters (tokens for the prefix cache, like vLLM)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_gpu_blocks: int
    block_size: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_used_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int


class RequestState:
    """The engine's bookkeeping for one request (drivers may read it, never write it)."""

    __slots__ = (
        "blocks",
        "counted_prompt",
        "d0",
        "epoch",
        "finish_reason",
        "hashes",
        "num_cached_tokens",
        "num_computed",
        "num_generated",
        "num_preemptions",
        "num_stored",
        "prompt",
        "prompt_len",
        "request_id",
        "reserve_tokens",
        "salt",
        "scheduled",
        "seed",
        "state",
        "target",
    )

    def __init__(self, request: EngineRequest, reserve_tokens: int) -> None:
        self.request_id = request.request_id
        self.prompt = request.prompt_token_ids
        self.prompt_len = len(request.prompt_token_ids)
        self.target = request.output_tokens
        self.finish_reason = request.finish_reason
        self.salt = request.cache_salt.encode("utf-8") if request.cache_salt else b""
        self.seed = request.seed
        self.reserve_tokens = reserve_tokens
        self.state = _WAITING
        self.blocks: list[int] = []
        self.hashes: list[int] = []  # chain hashes of the full blocks computed so far
        self.num_stored = 0  # blocks already offered to the prefix cache
        self.num_computed = 0  # tokens with KV (for a decoder: as of decode step d0)
        self.num_generated = 0  # output tokens (for a decoder: as of decode step d0)
        self.d0 = 0
        self.epoch = 0  # bumped whenever scheduled events for this request become stale
        self.num_cached_tokens = 0
        self.scheduled = False
        self.counted_prompt = False
        self.num_preemptions = 0


class StepSummary:
    """A step without per-token objects (for the virtual-time driver).

    ``first_tokens``: requests whose prefill completed and produced a token this step;
    ``decode_steps_before``/``decoded``: the decode-step counter before the step and whether
    every decoding request produced a token; ``finished``/``preempted``: requests that left;
    ``scheduled``: requests scheduled for the first time.
    """

    __slots__ = (
        "decode_steps_before",
        "decoded",
        "duration_s",
        "finished",
        "first_tokens",
        "num_decode_tokens",
        "num_prefill_tokens",
        "outputs",
        "preempted",
        "scheduled",
    )

    def __init__(self) -> None:
        self.duration_s = 0.0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.decode_steps_before = 0
        self.decoded = False
        self.first_tokens: list[RequestState] = []
        self.finished: list[RequestState] = []
        self.preempted: list[RequestState] = []
        self.scheduled: list[RequestState] = []
        self.outputs: list[RequestOutput] = []


def _step_tokens(remaining: int, budget: int, whole: bool, first: bool) -> int | None:
    """Prompt tokens of one request to compute this step, within the step's token ``budget``.

    Without chunked prefill (``whole``) the rest of the prompt goes at once, over the budget only
    as the step's ``first`` piece of work (None: it waits for the next step); with it, up to the
    budget.
    """
    if whole:
        return None if remaining > budget and not first else remaining
    return remaining if remaining < budget else budget


class Engine:
    """One simulated replica's engine. Not thread-safe; drive it from one task.

    Generated token ``i`` of a request is ``output_vocab[output_token(seed, i) % len(...)]``
    (a real tokenizer's `output_ids`); ``None`` means the simulator's own table (ids
    ``0 .. NUM_OUTPUT_TOKENS-1``, what `SimTokenizer` decodes).
    """

    def __init__(
        self,
        config: EngineConfig,
        cost_model: CostModel,
        kv_event_sink: Callable[[KVEvent], None] | None = None,
        output_vocab: Sequence[int] | None = None,
    ) -> None:
        if output_vocab is not None:
            if len(output_vocab) == 0:
                raise ValueError("output_vocab must not be empty")
            if tuple(output_vocab) == tuple(range(NUM_OUTPUT_TOKENS)):
                output_vocab = None  # the identity: skip the lookup
        self._out_vocab = (
            None
            if output_vocab is None
            else tuple(output_vocab[i % len(output_vocab)] for i in range(NUM_OUTPUT_TOKENS))
        )
        self.config = config
        self.cost_model = cost_model
        self._bs = config.block_size
        self._caching = config.enable_prefix_caching
        self._pool = BlockPool(
            config.num_gpu_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            sink=kv_event_sink if config.enable_prefix_caching else None,
        )
        self._hash_seed = config.hash_seed
        self._root = root_hash(config.hash_seed)
        self._static = config.scheduling == "static"
        self._requests: dict[str, RequestState] = {}  # every unfinished request
        self._waiting: deque[RequestState] = deque()  # may hold aborted tombstones
        self._num_waiting = 0
        self._running: dict[str, RequestState] = {}  # admission order: the last is the newest
        self._prefilling: dict[str, RequestState] = {}
        self._decoders: dict[str, RequestState] = {}
        self._dec_ctx_base = 0  # sum over decoders of (num_computed - d0 + 1)
        self._decode_steps = 0
        self._alloc_at: dict[int, list[tuple[RequestState, int]]] = {}
        self._finish_at: dict[int, list[tuple[RequestState, int]]] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._first_scheduled: list[RequestState] = []  # the current step's (see _run_step)

    # --- public API -----------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; ``ValueError`` if it is malformed or can never fit the KV cache."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt = request.prompt_token_ids
        if len(prompt) == 0:
            raise ValueError("the prompt must contain at least one token")
        try:
            array("I", prompt)
        except (OverflowError, TypeError):
            raise ValueError("prompt token ids must be integers in [0, 2**32)") from None
        if request.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {request.output_tokens}")
        if request.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be 'length' or 'stop', got {request.finish_reason!r}"
            )
        max_tokens = request.output_tokens if request.max_tokens is None else request.max_tokens
        if max_tokens < request.output_tokens:
            raise ValueError(
                f"max_tokens ({max_tokens}) must be >= output_tokens ({request.output_tokens})"
            )
        # The last sampled token never gets KV; static batching reserves up to max_tokens.
        needed = len(prompt) + (max_tokens if self._static else request.output_tokens) - 1
        blocks = -(-needed // self._bs)
        if blocks > self.config.num_gpu_blocks:
            raise ValueError(
                f"this request needs {needed} tokens of KV cache ({blocks} blocks) but the "
                f"cache holds {self.config.capacity_tokens} tokens "
                f"({self.config.num_gpu_blocks} blocks of {self._bs})"
            )
        req = RequestState(request, len(prompt) + max_tokens - 1)
        self._requests[rid] = req
        self._waiting.append(req)
        self._num_waiting += 1

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; True if it was waiting or running."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.state == _WAITING:
            req.state = _DONE  # a tombstone in the waiting deque, skipped when reached
            req.epoch += 1
            self._num_waiting -= 1
            return True
        self._release(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def request_ids_running(self) -> list[str]:
        return list(self._running)

    def request_ids_waiting(self) -> list[str]:
        return [r.request_id for r in self._waiting if r.state == _WAITING]

    @property
    def decode_steps(self) -> int:
        """Number of steps so far in which the decoding requests produced a token."""
        return self._decode_steps

    def step(self) -> StepResult:
        """Decide and compute one iteration (duration 0 and no outputs when idle)."""
        s = self._run_step(materialize=True)
        return StepResult(
            duration_s=s.duration_s,
            outputs=tuple(s.outputs),
            num_prefill_tokens=s.num_prefill_tokens,
            num_decode_tokens=s.num_decode_tokens,
            preempted=tuple(r.request_id for r in s.preempted),
            scheduled=tuple(r.request_id for r in s.scheduled),
        )

    def step_summary(self) -> StepSummary:
        """`step` without per-token outputs: what the virtual-time driver uses."""
        return self._run_step(materialize=False)

    def stats(self) -> EngineStats:
        pool = self._pool
        return EngineStats(
            num_running=len(self._running),
            num_waiting=self._num_waiting,
            kv_cache_usage=pool.num_used / pool.num_blocks,
            num_gpu_blocks=pool.num_blocks,
            block_size=self._bs,
            num_free_blocks=pool.num_free,
            num_cached_free_blocks=pool.num_cached_free,
            num_used_blocks=pool.num_used,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            num_preemptions=self._num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
        )

    def clear_prefix_cache(self) -> bool:
        """Forget every cached block hash (emits AllBlocksCleared); running requests go on."""
        self._pool.clear_cache()
        return True

    def cached_block_hashes(self) -> set[int]:
        """Hashes a new request could hit now (tests compare them with replayed events)."""
        return self._pool.cached_hashes()

    def check_invariants(self) -> None:
        """Assert the KV pool's and the scheduler's invariants (tests; O(num_blocks))."""
        pool = self._pool
        pool.check()
        held: set[int] = set()
        refs: dict[int, int] = {}
        d = self._decode_steps
        ctx = 0
        for r in self._running.values():
            held.update(r.blocks)
            for b in r.blocks:
                refs[b] = refs.get(b, 0) + 1
            computed = r.num_computed + (d - r.d0 if r.state == _DECODE else 0)
            assert len(r.blocks) * self._bs >= computed, (r.request_id, len(r.blocks), computed)
            if r.state == _DECODE:
                ctx += computed + 1
                assert r.num_generated + d - r.d0 < r.target
        assert pool.num_used == len(held), (pool.num_used, len(held))
        assert all(pool.ref[b] == n for b, n in refs.items())
        assert self._dec_ctx_base + len(self._decoders) * d == ctx
        assert len(self._running) <= self.config.max_num_seqs
        assert self._num_waiting == sum(1 for r in self._waiting if r.state == _WAITING)
        assert set(self._decoders) | set(self._prefilling) == set(self._running)
        assert not set(self._decoders) & set(self._prefilling)
        active = set(self._running) | {r.request_id for r in self._waiting if r.state == _WAITING}
        assert active == set(self._requests)

    # --- one step -------------------------------------------------------------------------------
    def _run_step(self, materialize: bool) -> StepSummary:
        s = StepSummary()
        s.decode_steps_before = self._decode_steps
        chunks: list[tuple[RequestState, int]] = []
        preempted = s.preempted
        self._first_scheduled = s.scheduled  # `_start` records first admissions here
        if self._static:
            decode_now = self._schedule_static(chunks)
        elif self.config.enable_chunked_prefill:
            decode_now = self._schedule_chunked(preempted, chunks)
        else:
            decode_now = self._schedule_unchunked(preempted, chunks)
        n_dec = len(self._decoders) if decode_now else 0
        if n_dec == 0 and not chunks:
            return s
        d = self._decode_steps
        prefill_tokens = 0
        for _req, n in chunks:
            prefill_tokens += n
        s.duration_s = self.cost_model.step_time_totals_s(
            n_dec,
            self._dec_ctx_base + n_dec * d if n_dec else 0,
            [(n, req.num_computed) for req, n in chunks],
        )
        s.num_prefill_tokens = prefill_tokens
        s.num_decode_tokens = n_dec
        if n_dec:
            d += 1
            self._decode_steps = d
            s.decoded = True
            self._generation_tokens += n_dec
            if materialize:
                self._decode_outputs(s.outputs, d)
        for req, n in chunks:
            self._after_prefill_chunk(req, n, s, materialize)
        if n_dec:
            due = self._finish_at.pop(d, None)
            if due:
                finished = s.finished
                for req, epoch in due:
                    if req.epoch == epoch:
                        self._release(req)
                        finished.append(req)
        return s

    def _decode_outputs(self, outputs: list[RequestOutput], d: int) -> None:
        for req in self._decoders.values():
            generated = req.num_generated + d - req.d0
            done = generated >= req.target
            outputs.append(
                RequestOutput(
                    req.request_id,
                    (self._output_token(req.seed, generated - 1),),
                    req.prompt_len,
                    req.num_cached_tokens,
                    done,
                    req.finish_reason if done else None,
                )
            )

    def _after_prefill_chunk(
        self, req: RequestState, n: int, s: StepSummary, materialize: bool
    ) -> None:
        computed = req.num_computed + n
        req.num_computed = computed
        if computed < req.prompt_len + req.num_generated:
            self._cache_full(req, computed)  # a long prompt's blocks are reusable early
            return
        # The prefill is complete: this step samples the next token.
        req.num_generated += 1
        self._generation_tokens += 1
        if not req.counted_prompt:
            req.counted_prompt = True
            self._prompt_tokens += req.prompt_len
        s.first_tokens.append(req)
        done = req.num_generated >= req.target
        if materialize:
            s.outputs.append(
                RequestOutput(
                    req.request_id,
                    (self._output_token(req.seed, req.num_generated - 1),),
                    req.prompt_len,
                    req.num_cached_tokens,
                    done,
                    req.finish_reason if done else None,
                )
            )
        if done:
            self._release(req)
            s.finished.append(req)
        else:
            self._cache_full(req, computed)
            self._enter_decode(req)

    # --- scheduling policies --------------------------------------------------------------------
    def _schedule_chunked(
        self, preempted: list[RequestState], chunks: list[tuple[RequestState, int]]
    ) -> bool:
        self._decode_allocations(preempted)
        budget = self.config.max_num_batched_tokens - len(self._decoders)
        if self._prefilling:
            for req in list(self._prefilling.values()):
                if budget <= 0:
                    break
                if req.state != _PREFILL:
                    continue  # preempted while this loop ran
                remaining = req.prompt_len + req.num_generated - req.num_computed
                n = remaining if remaining < budget else budget
                if not self._grow(req, req.num_computed + n, preempted):
                    continue
                chunks.append((req, n))
                budget -= n
        if not preempted and budget > 0:
            self._admit(budget, chunks, whole=False)
        return True

    def _schedule_unchunked(
        self, preempted: list[RequestState], chunks: list[tuple[RequestState, int]]
    ) -> bool:
        # Whole prompts in a step of their own; the decoders wait (vLLM without chunking).
        self._admit(self.config.max_num_batched_tokens, chunks, whole=True)
        if chunks:
            return False
        self._decode_allocations(preempted)
        return True

    def _schedule_static(self, chunks: list[tuple[RequestState, int]]) -> bool:
        if not self._running:
            self._admit_static_batch()
        if not self._prefilling:
            self._decode_allocations([])  # blocks are reserved: this only hashes full blocks
            return True
        budget = self.config.max_num_batched_tokens
        whole = not self.config.enable_chunked_prefill
        for req in self._prefilling.values():
            remaining = req.prompt_len + req.num_generated - req.num_computed
            n = _step_tokens(remaining, budget, whole, not chunks)
            if n is None:
                break
            chunks.append((req, n))
            budget -= n
            if budget <= 0:
                break
        return False

    # --- admission ------------------------------------------------------------------------------
    def _match(self, req: RequestState, total: int) -> list[int]:
        if not self._caching:
            return []
        max_hit = (total - 1) // self._bs  # at least one token must be computed
        self._ensure_hashes(req, max_hit)
        return self._pool.match_prefix(req.hashes, max_hit)

    def _admit(self, budget: int, chunks: list[tuple[RequestState, int]], whole: bool) -> None:
        waiting = self._waiting
        running = self._running
        pool = self._pool
        bs = self._bs
        max_seqs = self.config.max_num_seqs
        while waiting and budget > 0 and len(running) < max_seqs:
            req = waiting[0]
            if req.state != _WAITING:
                waiting.popleft()  # aborted while waiting
                continue
            total = req.prompt_len + req.num_generated
            hit_blocks = self._match(req, total)
            hit = len(hit_blocks) * bs
            n = _step_tokens(total - hit, budget, whole, not chunks)
            if n is None:
                break
            need = -(-(hit + n) // bs) - len(hit_blocks)
            if need > pool.num_allocatable - pool.count_unreferenced(hit_blocks):
                break  # FCFS: the head waits for blocks, nobody overtakes it
            waiting.popleft()
            self._start(req, hit_blocks, need)
            chunks.append((req, n))
            budget -= n

    def _admit_static_batch(self) -> None:
        waiting = self._waiting
        pool = self._pool
        bs = self._bs
        max_seqs = self.config.max_num_seqs
        while waiting and len(self._running) < max_seqs:
            req = waiting[0]
            if req.state != _WAITING:
                waiting.popleft()
                continue
            hit_blocks = self._match(req, req.prompt_len + req.num_generated)
            need = -(-req.reserve_tokens // bs) - len(hit_blocks)
            if need > pool.num_allocatable - pool.count_unreferenced(hit_blocks):
                break
            waiting.popleft()
            self._start(req, hit_blocks, need)

    def _start(self, req: RequestState, hit_blocks: list[int], need: int) -> None:
        pool = self._pool
        hit = len(hit_blocks) * self._bs
        pool.take(hit_blocks)
        req.blocks = hit_blocks
        if need > 0:
            fresh = pool.allocate(need)
            assert fresh is not None  # checked by the caller
            hit_blocks.extend(fresh)
        req.num_computed = hit
        req.num_stored = hit // self._bs
        if not req.scheduled:
            req.scheduled = True
            self._first_scheduled.append(req)
            req.num_cached_tokens = hit
            self._prefix_queries += req.prompt_len + req.num_generated
            self._prefix_hits += hit
        req.state = _PREFILL
        self._num_waiting -= 1
        self._running[req.request_id] = req
        self._prefilling[req.request_id] = req

    # --- decoding requests ----------------------------------------------------------------------
    def _enter_decode(self, req: RequestState) -> None:
        d = self._decode_steps
        bs = self._bs
        req.state = _DECODE
        req.d0 = d
        c = req.num_computed
        self._dec_ctx_base += c - d + 1
        self._decoders[req.request_id] = req
        del self._prefilling[req.request_id]
        epoch = req.epoch
        d_finish = d + req.target - req.num_generated
        self._push(self._finish_at, d_finish, req, epoch)
        d_alloc = d + (-c) % bs  # first decode step whose token starts a new block
        if d_alloc < d_finish:
            self._push(self._alloc_at, d_alloc, req, epoch)

    def _leave_decode(self, req: RequestState) -> None:
        k = self._decode_steps - req.d0
        self._dec_ctx_base -= req.num_computed - req.d0 + 1
        req.num_computed += k
        req.num_generated += k
        req.d0 = self._decode_steps
        del self._decoders[req.request_id]
        if not self._decoders:
            # Every pending event belongs to a decoder: with none left they are all stale.
            self._alloc_at.clear()
            self._finish_at.clear()

    @staticmethod
    def _push(
        table: dict[int, list[tuple[RequestState, int]]], key: int, req: RequestState, epoch: int
    ) -> None:
        bucket = table.get(key)
        if bucket is None:
            table[key] = [(req, epoch)]
        else:
            bucket.append((req, epoch))

    def _decode_allocations(self, preempted: list[RequestState]) -> None:
        d = self._decode_steps
        due = self._alloc_at.pop(d, None)
        if not due:
            return
        bs = self._bs
        for req, epoch in due:
            if req.epoch != epoch:
                continue
            computed = req.num_computed + d - req.d0  # a multiple of block_size
            self._cache_full(req, computed)
            if not self._grow(req, computed + 1, preempted):
                continue
            nxt = d + bs
            if nxt < req.d0 + req.target - req.num_generated:
                self._push(self._alloc_at, nxt, req, epoch)

    # --- blocks ---------------------------------------------------------------------------------
    def _grow(self, req: RequestState, tokens: int, preempted: list[RequestState]) -> bool:
        """Give ``req`` blocks for ``tokens`` tokens, preempting the newest running requests if
        needed; False if ``req`` itself had to be preempted."""
        need = -(-tokens // self._bs) - len(req.blocks)
        if need <= 0:
            return True
        pool = self._pool
        running = self._running
        while True:
            fresh = pool.allocate(need)
            if fresh is not None:
                req.blocks.extend(fresh)
                return True
            victim = running[next(reversed(running))]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False

    def _preempt(self, req: RequestState) -> None:
        self._release(req)
        req.num_computed = 0
        req.state = _WAITING
        req.num_preemptions += 1
        self._num_preemptions += 1
        self._requests[req.request_id] = req
        self._waiting.appendleft(req)
        self._num_waiting += 1

    def _release(self, req: RequestState) -> None:
        """Take a running request out of the running set and free its blocks."""
        if req.state == _DECODE:
            self._leave_decode(req)
        else:
            self._prefilling.pop(req.request_id, None)
        req.epoch += 1
        self._cache_full(req, req.num_computed)
        self._pool.free(req.blocks)
        req.blocks = []
        req.num_stored = 0
        req.state = _DONE
        del self._running[req.request_id]
        self._requests.pop(req.request_id, None)

    # --- hashing --------------------------------------------------------------------------------
    def _output_token(self, seed: int, index: int) -> int:
        t = output_token(seed, index)
        vocab = self._out_vocab
        return t if vocab is None else vocab[t]

    def _output_tokens(self, seed: int, start: int, count: int) -> list[int]:
        ts = output_tokens(seed, start, count)
        vocab = self._out_vocab
        return ts if vocab is None else [vocab[t] for t in ts]

    def _tokens(self, req: RequestState, start: int, end: int) -> list[int]:
        pl = req.prompt_len
        if end <= pl:
            return list(req.prompt[start:end])
        if start >= pl:
            return self._output_tokens(req.seed, start - pl, end - start)
        return list(req.prompt[start:pl]) + self._output_tokens(req.seed, 0, end - pl)

    def _ensure_hashes(self, req: RequestState, n_blocks: int) -> None:
        hashes = req.hashes
        have = len(hashes)
        if have >= n_blocks:
            return
        bs = self._bs
        seed = self._hash_seed
        parent = hashes[-1] if have else self._root
        pl = req.prompt_len
        prompt = req.prompt
        for i in range(have, n_blocks):
            start = i * bs
            end = start + bs
            toks = prompt[start:end] if end <= pl else self._tokens(req, start, end)
            parent = hash_block(parent, toks, req.salt if i == 0 else b"", seed)
            hashes.append(parent)

    def _cache_full(self, req: RequestState, computed: int) -> None:
        if not self._caching:
            return
        full = computed // self._bs
        if full <= req.num_stored:
            return
        self._ensure_hashes(req, full)
        bs = self._bs
        self._pool.store(
            req.blocks,
            req.hashes,
            req.num_stored,
            full,
            lambda a, b: self._tokens(req, a * bs, b * bs),
        )
        req.num_stored = full
