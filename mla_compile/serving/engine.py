"""A small reference serving engine: prefix-cached block allocation, chunked prefill mixed with
decodes, per-request sampling (:mod:`mla_compile.serving.sampling`).

Each :meth:`Engine.step` is one model step under a token budget: every running request decodes one
token, and the rest of the budget goes to prompt chunks of requests being prefilled (a long prompt
spreads over several steps; each chunk attends to the cached context before it). Admission reserves
a request's blocks up front (a windowed model's: its peak, released as the window moves); full blocks of earlier prompts are shared through the prefix cache, so
a prefill starts after its cached prefix. A request stops at a stop token or ``max_new_tokens``. Steps go through a
runner (:class:`~mla_compile.graphs.cuda_graph.DecodeGraphRunner`): pure decode steps replay CUDA
graphs when the runner has captured them.

One client never takes down the others: requests are validated before they are queued
(:mod:`mla_compile.serving.admission`), any request can be aborted between steps, and a step whose runner
raises fails only the requests in that step (see :class:`Engine`).

``Engine(overlap=True)`` takes the host work off the critical path (see :class:`Engine`): sampled tokens stay
on the device and feed the next step's inputs there, the host plans and launches step n+1 while the device
runs step n, and it learns step n's tokens one step late.

DeepSeek-V4 (a runner over :class:`~mla_compile.models.v4_model.V4ForCausalLM` with a
:class:`~mla_compile.serving.v4_builder.V4DecodeBuilder`) is served by the same engine: its caches go through a
:class:`~mla_compile.serving.v4_blocks.V4BlockManager` (token rows released as the window moves, compressed
entries per rate, a compressor-state row per request; prefix hits rounded down to a compressor-state snapshot),
without ``dp_sync``.

``Engine(dp_sync=DPStepSync(...))`` serves one data-parallel attention group (:mod:`mla_compile.serving.dp_sync`):
every step's shape is agreed with the other groups' engines first and the step padded to it; a group with no
work runs padding-only steps while others have some; a step failing before its model runs a padding-only step in
its place. The lines marked ``[dp]`` do this.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, is_
from typing import Any, Iterator, NamedTuple, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from mla_compile.serving.admission import RequestLimits, model_limits, validate_request
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.decode_rows import DecodeRows, RowState
from mla_compile.serving.block_manager import Allocation, BlockManager, sink_window_of
from mla_compile.models.metadata import SeqChunk, step_size
from mla_compile.serving.dp_sync import DPStepFatal, DPStepSync, StepDemand, StepShape
from mla_compile.serving.sampling import SamplingParams, sample_rows
from mla_compile.serving.v4_blocks import V4BlockManager
from mla_compile.serving.v4_builder import V4DecodeBuilder

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class StepOutput:
    """What one step of :meth:`Engine.stream` produced: ``tokens`` (request id -> the tokens it generated in the
    step, in order; requests still prefilling are absent) and the requests it ``finished``."""

    tokens: dict[int, list[int]]
    finished: list["Request"]


class StepRunner(Protocol):
    """What the engine drives: ``mla_compile.graphs.cuda_graph.DecodeGraphRunner`` (the core does not
    import graphs; any object with these members works). A ``step_fn`` with a ``config`` (the patched
    model, or ``torch.compile`` of it) gives the engine its vocabulary size and positions. A runner that also
    has ``decode_sampled(chunks, params, steps) -> (logits, tokens)`` samples decode steps itself (on the
    device, inside the captured step when it was made with ``sampling=True``); the engine then reads only the
    tokens. ``Engine(overlap=True)`` needs ``enable_token_feed()`` and ``sample_step(decode, prefill, params,
    steps, feed) -> (logits, tokens)`` (see ``DecodeGraphRunner.sample_step``). A runner with ``takes_decode_rows =
    True`` over a ``MetadataBuilder`` is handed decode-only steps as the engine's
    :class:`~mla_compile.serving.decode_rows.DecodeRows` batch (``params`` / ``steps`` None: the batch's own
    columns), kept on the host between steps and updated only where it changed."""

    builder: MetadataBuilder

    def decode(self, chunks: Sequence[SeqChunk]) -> Tensor: ...

    def run(self, decode: Sequence[SeqChunk], prefill: Sequence[SeqChunk] = ()) -> Tensor: ...


class StepFailed(RuntimeError):
    """A step's runner raised. ``request_ids``: the requests of that step, now finished with
    ``finish_reason == "error"``; ``__cause__``: the runner's exception."""

    def __init__(self, message: str, request_ids: list[int]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class Request:
    """One generation request and its state (``computed``: prompt tokens already in the cache;
    ``finish_reason``: None while waiting or running, then one of ``FINISH_REASONS``)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    output: list[int] = field(default_factory=list)
    alloc: Allocation = field(default_factory=Allocation)
    computed: int = 0
    finish_reason: str | None = None

    @property
    def blocks(self) -> list[int]:
        """The request's cache blocks."""
        return self.alloc.blocks

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens remain to be computed."""
        return self.computed < len(self.prompt)

    @property
    def length(self) -> int:
        """Tokens in the cache before the next decode step (prompt plus generated, minus the last)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def done(self) -> bool:
        """Whether it has produced ``max_new_tokens`` tokens."""
        return len(self.output) >= self.max_new_tokens

    @property
    def stopped(self) -> bool:
        """Whether its last token is one of its ``stop_token_ids``."""
        return bool(self.output) and self.output[-1] in self.params.stop_token_ids


class Engine:
    """Serving over a patched model's paged cache, driven one step at a time.

    Each request samples under its :class:`~mla_compile.serving.sampling.SamplingParams` (greedy by default): its
    ``n``-th new token is drawn from the ``(seed, n)`` stream of :func:`mla_compile.serving.sampling.sample`, so its
    tokens do not depend on the requests batched with it. A request without a seed gets one at
    :meth:`add_request` from the engine's generator (``random.Random(seed)``), so a run is reproducible
    given ``seed`` and the order of the calls.

    Requests move ``waiting`` -> ``running`` -> ``finished``; every finished request carries its
    ``finish_reason`` and the tokens it produced:

    - ``"stop"``: its last token is one of its ``stop_token_ids`` (kept in the output).
    - ``"length"``: it produced ``max_new_tokens`` tokens.
    - ``"abort"``: :meth:`abort` took it out of ``waiting`` or ``running`` between steps.
    - ``"error"``: it was in a step whose runner raised (a backend error, an out-of-memory). All the
      requests of that step (its decodes and its prompt chunks) are failed, not retried: their blocks
      are freed and their tokens so far kept, and :meth:`step` raises :class:`StepFailed` with their
      ids, chained to the runner's exception. Nothing of the failed step is kept: no token is sampled
      and no block it was filling becomes findable in the prefix cache (blocks are registered only
      after their step succeeded), so the half-written slots are in unregistered blocks, which return
      to the free list. Requests outside that step are untouched, and the next :meth:`step` serves
      them. (An error that breaks the device itself, such as a CUDA device-side assert, fails every
      later step too: admission keeps bad token ids from reaching the embedding kernel.)

    :meth:`add_request` validates before queueing (:func:`mla_compile.serving.admission.validate_request`):
    token ids in ``[0, vocab_size)`` (stop tokens too), a non-empty prompt, ``max_new_tokens >= 1``, prompt plus new
    tokens within ``max_positions``, one sequence's block table and the whole cache. ``vocab_size`` and
    ``max_positions`` default to the runner's model config (``runner.step_fn.config``) and may only
    lower it; a runner without one needs ``vocab_size`` passed.

    ``overlap=True`` (the runner needs ``enable_token_feed`` and ``sample_step``: ``DecodeGraphRunner``) keeps
    sampled tokens on the device: a decode row's input id is gathered there from the previous step's tokens
    (inside the captured graph for replayed steps), so :meth:`step` launches step n+1 before it reads step n's
    tokens, which arrive by a non-blocking copy into host memory. Each :meth:`step` call plans and launches one
    step, then reads the previous step's tokens: it returns (and :attr:`new_tokens` / :meth:`stream` report)
    what that previous step produced and finished. Every request gets the same tokens as without overlap
    (same ``(seed, n)`` streams). A request that reaches ``max_new_tokens`` in step n leaves the batch (and
    frees its blocks) when step n is launched, as it would after step n without overlap; one that draws a stop
    token in step n is known to have stopped only after step n+1 was launched: it still has a row in step n+1,
    whose token is dropped (its blocks are freed then; a later step reuses them only after step n+1 ran, in
    stream order). Full prompt blocks enter the prefix cache when their step was launched without an error,
    and leave it again if reading that step's tokens fails.
    :meth:`abort` first waits for the step in flight (a host sync outside the step), so the request keeps the
    tokens that step gave it, as without overlap. A step whose launch raises fails its requests as above,
    after the previous step's tokens were taken; an error met while reading a step's tokens (an asynchronous
    device error) fails that step's requests, those of the step launched after it (fed that step's tokens) and
    every request that took one of their new prompt blocks by a prefix hit; no such block stays findable.
    When no request is left running, :meth:`step` also waits for the step in flight, so an idle engine has
    nothing pending.

    ``enable_prefix_caching`` (default None: on, except for DeepSeek-V4, where it costs snapshots of the
    compressors' state and prompt chunks ending at snapshot positions; True turns it on there too, see
    :class:`~mla_compile.serving.v4_blocks.V4BlockManager`).
    ``num_entry_blocks`` (DeepSeek-V4 only): compressed-entry blocks per rate the engine hands out (default: all
    the model's ``allocate_cache`` made); the compressor-state rows are the model's too.

    ``dp_sync`` (a :class:`~mla_compile.serving.dp_sync.DPStepSync`; the runner's ``run``, ``decode``,
    ``decode_sampled`` and ``sample_step`` take ``shape=`` and its builder's ``build`` takes ``tokens=`` and
    ``rows=``: ``DecodeGraphRunner`` over a ``MetadataBuilder``): this engine serves one data-parallel attention group
    of a sharded model (``ParallelConfig(dp_attention=D)``), one engine per rank, the same requests on every rank
    of a group. The constructor and every :meth:`step` are collective over ``dp_sync``'s group: every rank calls
    them in lockstep. Each :meth:`step` agrees on the step's shape with the other groups and pads its step to it
    (padding tokens and rows read and write nothing, so every request gets the tokens it would get alone); a
    group with nothing to run runs a padding-only step while some other group has work. :attr:`dp_active` says
    whether some group still had requests at the last step; :meth:`stream` and :meth:`run` step until no group
    has any. A step that raises fails its requests as above (:class:`StepFailed`) and every rank goes on when
    this rank can still run the collectives the other ranks run in that step: when it raised before the runner
    started the model (planning, a builder error, a runner that raises before calling its model: the runner's
    ``model_calls`` did not change), the engine runs a padding-only step of the agreed shape in its place; when it
    raised after the runner returned, the model's collectives all ran. Once the model started (``model_calls``
    changed, or a runner without ``model_calls``) the ranks' collectives may no longer match: the engine raises
    :class:`~mla_compile.serving.dp_sync.DPStepFatal`, finishes every request it holds with ``"error"`` and
    raises it again from every later :meth:`step`; the other ranks, left in a collective of that model step or of
    the next agreement, raise it when that collective fails or times out (``init(timeout=)``,
    ``DPStepSync(timeout=)``; under NCCL its watchdog may end a stuck peer's process at that timeout instead). A
    padding-only step that raises, or a failed agreement, is fatal the same way.
    """

    def __init__(self, runner: StepRunner, *, num_blocks: int, max_tokens_per_step: int | None = None,
                 enable_prefix_caching: bool | None = None, vocab_size: int | None = None,
                 max_positions: int | None = None, seed: int = 0, overlap: bool = False,
                 dp_sync: DPStepSync | None = None, num_entry_blocks: int | dict[int, int] | None = None) -> None:
        self.runner = runner
        self.block_size = runner.builder.block_size
        self.max_batch = runner.builder.max_batch
        self.max_blocks = runner.builder.max_blocks
        self.max_tokens = min(max_tokens_per_step or runner.builder.max_tokens, runner.builder.max_tokens)
        if self.max_tokens <= self.max_batch:
            raise ValueError(f"max_tokens_per_step ({self.max_tokens}) must exceed max_batch ({self.max_batch}) "
                             "so prompts progress while a full batch decodes")
        model_vocab, model_positions = model_limits(runner)
        if vocab_size is None and model_vocab is None:
            found = type(getattr(runner, "step_fn", runner)).__name__
            raise ValueError(f"Engine needs vocab_size: the runner's step_fn ({found}) has no "
                             "config.vocab_size; pass vocab_size=...")
        for name, given, model in (("vocab_size", vocab_size, model_vocab),
                                   ("max_positions", max_positions, model_positions)):
            if given is not None and model is not None and given > model:
                raise ValueError(f"{name}={given} exceeds the model's {model}; pass at most {model} or leave "
                                 "it None to use the model's")
        vocab_size = model_vocab if vocab_size is None else vocab_size
        max_positions = model_positions if max_positions is None else max_positions
        self.blocks = self._cache_manager(num_blocks, enable_prefix_caching, num_entry_blocks)
        windowed = self.blocks.sink_window is not None
        self.limits = RequestLimits(vocab_size=vocab_size, max_seq_tokens=self.max_blocks * self.block_size,
                                    cache_tokens=self.blocks.usable_blocks * self.block_size,
                                    max_positions=max_positions,
                                    peak_tokens=self.blocks.peak_tokens if windowed else None,
                                    never_fits=getattr(self.blocks, "never_fits", None))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._scheduled = -1  # the running version _decoding / _prefilling were made for (see _schedule)
        self._decoding: list[Request] = []
        self._prefilling: list[Request] = []
        self.finished: list[Request] = []
        self.requests: dict[int, Request] = {}  # every admitted request by id
        self._ids = itertools.count()
        self._seeds = random.Random(seed)
        self.step_logits: list[Tensor] = []
        self.new_tokens: dict[int, list[int]] = {}  # the last step's tokens by request id (see stream)
        self.cached_prompt_tokens = 0
        self.overlap = overlap
        if overlap:
            missing = [m for m in ("enable_token_feed", "sample_step") if not callable(getattr(runner, m, None))]
            if missing:
                raise ValueError(f"overlap=True needs a runner with {' and '.join(missing)} (DecodeGraphRunner); "
                                 f"{type(runner).__name__} has none")
            runner.enable_token_feed()
        self._inflight: _InFlight | None = None  # overlap: the launched step whose tokens are not read yet
        self._host_tokens = _HostTokens(2 * self.max_batch)
        self._learned: dict[int, list[int]] = {}  # overlap: tokens read since the last step() returned
        self._done: list[Request] = []  # overlap: requests finished since the last step() returned
        self.dp_sync = dp_sync  # [dp]
        self.dp_active = True  # [dp] whether some group had requests at the last step's agreement
        self._dp_fatal: DPStepFatal | None = None  # [dp] set once a step failed where the ranks cannot go on
        self._returned = False  # [dp] whether the runner call of the step being run returned
        if dp_sync is not None:
            self._check_dp_runner()
        # the decode batch kept on the host between steps (see DecodeRows), for a runner that takes one over a
        # MetadataBuilder of one token per decode row; _rows_at: the running version its rows were arranged for
        b = runner.builder
        takes_rows = getattr(runner, "takes_decode_rows", False) and type(self.blocks) is BlockManager \
            and isinstance(b, MetadataBuilder) and b.query_len == 1
        self._rows = DecodeRows(b.max_batch, b.max_blocks, b.block_size) if takes_rows else None
        self._rows_at: int | None = None
        self._view: _DecodeView | None = None  # see _decode_view
        self._finishes = 0  # requests finished so far (_finish calls): a step read notes if any finished since launch

    @property
    def running(self) -> list[Request]:
        """The admitted requests not finished yet, in batch order (prefilling ones included)."""
        return self._running

    @running.setter
    def running(self, requests: list[Request]) -> None:
        self._running = _Running(requests)  # a version no list had before

    def _cache_manager(self, num_blocks: int, prefix_caching: bool | None,
                       num_entry_blocks: int | dict[int, int] | None) -> BlockManager | V4BlockManager:
        """The block manager of the runner's model: a :class:`~mla_compile.serving.v4_blocks.V4BlockManager` for a
        DeepSeek-V4 runner (its builder a ``V4DecodeBuilder``), else a :class:`BlockManager` (windowed for a sink +
        window model, ``patch(..., sparse="sink_window")``: blocks outside both are released as it moves)."""
        if isinstance(self.runner.builder, V4DecodeBuilder):
            return V4BlockManager.for_runner(self.runner, num_blocks=num_blocks, num_entry_blocks=num_entry_blocks,
                                             enable_prefix_caching=bool(prefix_caching))
        if num_entry_blocks is not None:
            raise ValueError("num_entry_blocks is for DeepSeek-V4 runners (a V4DecodeBuilder); this runner's builder "
                             f"is a {type(self.runner.builder).__name__}")
        return BlockManager(num_blocks, self.block_size, enable_prefix_caching=prefix_caching is not False,
                            sink_window=sink_window_of(self.runner))

    def _check_dp_runner(self) -> None:
        """[dp] The runner pads to an agreed shape, and every rank's engine and runner are built alike (collective)."""
        methods = ["run", "decode", "sample_step"] if self.overlap else ["run", "decode"]
        if callable(getattr(self.runner, "decode_sampled", None)):
            methods.append("decode_sampled")
        for m in methods:
            if "shape" not in inspect.signature(getattr(self.runner, m)).parameters:
                raise ValueError(f"dp_sync needs a runner whose {m}() takes shape= (DecodeGraphRunner); "
                                 f"{type(self.runner).__name__}.{m} does not")
        b = self.runner.builder
        if not {"tokens", "rows"} <= inspect.signature(b.build).parameters.keys():
            raise ValueError(f"dp_sync needs a builder whose build() pads to tokens= and rows= (MetadataBuilder); "
                             f"{type(b).__name__}.build does not")
        sizes = tuple(getattr(self.runner, "capture_sizes", ()))
        self.dp_sync.check_same("engine sizes (max_batch, max_tokens, min_batch, query_len, capture sizes)",
                                [b.max_batch, self.max_tokens, b.min_batch, b.query_len, hash(sizes) % (1 << 62)])

    def _has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight is not None or self._learned or self._done)

    def _dp_agree(self, decoding: list[Request], chunks: list[tuple[Request, int]]) -> StepShape | None:
        """[dp] This step's shape, agreed with every other group (None: no group runs a step); runs this rank's
        padding-only step when only other groups have something to run."""
        if self._dp_fatal is not None:
            raise DPStepFatal(f"this engine stopped at an earlier fatal data-parallel step failure: {self._dp_fatal}"
                              ) from self._dp_fatal
        b = self.runner.builder
        tokens, rows = step_size(len(decoding), sum(n for _, n in chunks), len(chunks), query_len=b.query_len,
                                 min_batch=b.min_batch)
        try:
            agreed = self.dp_sync.agree(StepDemand(self._has_work(), len(decoding), bool(chunks), tokens, rows))
        except DPStepFatal as exc:
            raise self._dp_stop([], exc, "the step agreement failed") from exc
        self.dp_active = agreed.active
        if agreed.shape is not None and not decoding and not chunks:
            self._dp_padding(agreed.shape, [])  # nothing here while other groups step
        self._returned = False
        return agreed.shape

    def _model_calls(self) -> int | None:
        """[dp] The runner's count of the model runs it started (None: it does not count them)."""
        calls = getattr(self.runner, "model_calls", None)
        return calls if isinstance(calls, int) else None

    def _dp_padding(self, shape: StepShape, requests: list[Request], failed: Exception | None = None) -> None:
        """[dp] A padding-only step of ``shape``: this rank's part of the collectives every other rank runs in
        this step. If it raises, the ranks cannot go on (``requests``: the step's, ``failed``: the error it
        stands in for)."""
        try:
            self.runner.run((), (), shape=shape)
        except Exception as exc:
            why = "its padding-only step raised" if failed is None else \
                f"its step raised before its model ({type(failed).__name__}: {failed}) and the padding-only " \
                "step run in its place raised too"
            raise self._dp_stop(requests, exc, why) from exc

    def _dp_recover(self, calls: int | None, shape: StepShape, requests: list[Request], exc: Exception) -> None:
        """[dp] After this rank's step (of ``requests``) raised ``exc``: make sure this rank ran the step's
        collectives as every other rank did, or stop (raises :class:`DPStepFatal`). ``calls``: the runner's
        ``model_calls`` before the step."""
        if self._returned:  # the runner returned: the model ran every collective of the step
            return
        now = self._model_calls()
        if calls is None or now is None:
            raise self._dp_stop(requests, exc, f"its step raised and its runner ({type(self.runner).__name__}) has "
                                "no model_calls counter, so whether its model's collectives started is unknown")
        if now != calls:
            raise self._dp_stop(requests, exc, "its step raised inside the model (its collectives may have run on "
                                "some ranks and not on others)")
        self._dp_padding(shape, requests, exc)  # before its model: the padding step runs its collectives

    def _dp_stop(self, requests: list[Request], exc: Exception, why: str) -> DPStepFatal:
        """[dp] Stop this engine for good: every request not finished yet (``requests``: the failed step's, those
        in flight, running and waiting) is finished with ``"error"``; returns the error to raise (and raised again
        by every later step)."""
        pending = [*requests, *(self._inflight.requests if self._inflight is not None else ()), *self.running,
                   *self.waiting]
        failed = list({r.id: r for r in pending if r.finish_reason is None}.values())
        self.running, self._inflight, self.dp_active = [], None, False
        self.waiting.clear()
        for r in failed:
            self._finish(r, "error")
        ids = [r.id for r in failed]
        self._dp_fatal = DPStepFatal(
            f"data-parallel step {self.dp_sync.steps} on this rank: {why} ({type(exc).__name__}: {exc}); "
            f"the ranks cannot go on in lockstep, so this engine stops: its requests {ids} are finished with "
            "finish_reason 'error' (the other ranks raise DPStepFatal too, at the latest at their process group's "
            "timeout)", ids)
        return self._dp_fatal

    def add_request(self, prompt: Sequence[int], params: SamplingParams | int) -> int:
        """Validate and queue a request; returns its id.

        ``prompt``: token ids (Python or numpy ints, or a 1-D integer tensor/array); ``params``: its
        :class:`~mla_compile.serving.sampling.SamplingParams`, or an int >= 1, the ``max_new_tokens`` of greedy
        decoding. Raises :class:`~mla_compile.serving.admission.RequestRejected` (a ``ValueError``) naming
        the request id, the argument and the first bad position; nothing is queued then. Every call
        takes the next id, rejected or not, so ids follow the order of calls.
        """
        request_id = next(self._ids)
        tokens, params = validate_request(request_id, prompt, params, self.limits)
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        req = Request(request_id, tokens, params.max_new_tokens, params)
        self.requests[req.id] = req
        self.waiting.append(req)
        return req.id

    def abort(self, request_id: int) -> Request:
        """Stop a request between steps; returns it with the tokens produced so far.

        A waiting or running request leaves its queue, its blocks go back (shared prefix blocks only
        lose its reference) and it is finished with ``finish_reason "abort"``. Aborting a request
        that already finished (for any reason, an earlier abort included) changes nothing and returns
        it. An id that was never admitted (unknown, or rejected by :meth:`add_request`) raises
        ``ValueError``. With ``overlap`` it first waits for the step in flight and takes its tokens (a
        :class:`StepFailed` of that step propagates); the next :meth:`step` reports them.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} is unknown: never added, or rejected at admission")
        self._sync()  # overlap: the step in flight gives the request its token first
        if req.finish_reason is not None:
            return req
        if not self.running.drop(req):
            self.waiting.remove(req)
        self._finish(req, "abort")
        return req

    def _finish(self, req: Request, reason: str) -> None:
        assert reason in FINISH_REASONS and req.finish_reason is None, (reason, req.finish_reason)
        req.finish_reason = reason
        self._finishes += 1
        self.blocks.free(req.alloc)
        self.finished.append(req)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            try:
                req.alloc = self.blocks.allocate(req.prompt, len(req.prompt) + req.max_new_tokens)
            except RuntimeError:
                break  # not enough free blocks now; retry after requests finish
            self.waiting.popleft()
            req.computed = req.alloc.cached_tokens
            self.cached_prompt_tokens += req.computed
            self.running.append(req)

    def step(self, keep_logits: bool = False) -> list[Request]:
        """Run one step; returns the requests that finished in it (with ``overlap``: launch one step, then
        read the one launched before; returns the requests that one finished).

        Raises :class:`StepFailed` when the runner raised: the step's requests are failed (see the
        class docstring) and the engine is ready for the next step. With ``dp_sync``, raises
        :class:`~mla_compile.serving.dp_sync.DPStepFatal` when the ranks cannot go on (see the class docstring).
        """
        if self.overlap:
            return self._step_overlap(keep_logits)
        self.new_tokens = {}
        self._admit()
        decoding, chunks = self._schedule()
        shape = None if self.dp_sync is None else self._dp_agree(decoding, chunks)  # [dp]
        if not decoding and not chunks:
            return []
        kw = {} if shape is None else {"shape": shape}  # [dp]
        calls = None if shape is None else self._model_calls()  # [dp]
        batch = self._rows
        try:  # a failed grow (no block left) fails the step's requests like a runner error: never a stuck engine
            decode_only = not chunks and (shape is None or shape.decode_only)  # [dp] a mixed shape pads to tokens
            if batch is not None:  # the decode rows kept between steps: only what changed is written
                self._arrange_rows(decoding, {})
                self._grow_rows(decoding)  # [window]
                dec = batch if decode_only else batch.chunks()
            else:
                for r in decoding:  # [window] a no-op unless a windowed allocation reaches a new block
                    self.blocks.grow(r.alloc, r.length + 1)
                dec = [self.blocks.chunk(r.alloc, [r.output[-1]], r.length, key=r.id) for r in decoding]
            pre = [self.blocks.chunk(r.alloc, r.prompt[r.computed:r.computed + n], r.computed) for r, n in chunks]
            rows = [*decoding, *(r for r, _ in chunks)]
            decode_sampled = getattr(self.runner, "decode_sampled", None) if decode_only else None
            if decode_sampled is not None and dec is batch:  # the batch samples under its own columns
                logits, tokens = decode_sampled(batch, None, None, **kw)
            elif decode_sampled is not None:  # the runner samples on the device, in the captured step if it can
                logits, tokens = decode_sampled(dec, [r.params for r in rows], [len(r.output) for r in rows], **kw)
            else:
                logits = self.runner.decode(dec, **kw) if decode_only else self.runner.run(dec, pre, **kw)
                tokens = None
            self._returned = True  # [dp] the runner returned: every collective of its model step ran
            if tokens is None:
                tokens = self._sample(logits, rows)
            host = tokens.cpu()  # a host sync: an asynchronous device error shows here
            if keep_logits:
                self.step_logits.append(logits.float().cpu())
        except Exception as exc:
            failed = [*decoding, *(r for r, _ in chunks)]
            if shape is not None:  # [dp] run this step's collectives on padding, or stop
                self._dp_recover(calls, shape, failed, exc)
            raise self._fail(failed, exc) from exc
        if batch is not None and not chunks:  # one vectorised pass over the decode rows (see _take_rows)
            view = self._decode_view(decoding)
            last = view.last_rows(batch.steps)
            batch.advance(host.numpy())  # each decode row's token is its next input
            done = self._take_rows(view, host.numpy(), last, self.new_tokens)
            for r in done:
                self.running.drop(r)
                self._finish(r, "stop" if r.stopped else "length")
            self._release_windows()  # [window]
            return done
        if batch is not None:
            batch.advance(host.numpy())  # each decode row's token is its next input
        sampled = host.tolist()
        for r, t in zip(decoding, sampled):
            r.output.append(t)
            self.new_tokens[r.id] = [t]
        for (r, n), t in zip(chunks, sampled[len(decoding):]):
            r.computed += n
            self.blocks.register(r.alloc, r.prompt[:r.computed])  # only now are these blocks complete
            if not r.prefilling:  # the chunk that completes the prompt yields the first token
                self.running.touch()  # it decodes from the next step on
                r.output.append(t)
                self.new_tokens[r.id] = [t]
        done = [r for r in self.running if r.stopped or r.done]
        for r in done:
            self.running.drop(r)
            self._finish(r, "stop" if r.stopped else "length")
        self._release_windows()  # [window]
        return done

    def _release_windows(self, in_flight: _InFlight | None = None) -> None:
        """[window] Give back the blocks no later query of a running request reads (a no-op for dense models).
        ``in_flight``: the launched step whose tokens the host has not read yet (overlap)."""
        if type(self.blocks) is BlockManager and self.blocks.sink_window is None:
            return  # dense: nothing is ever released
        pending = set() if in_flight is None else {r.id for _, r in in_flight.yields}
        batch = self._rows
        for r in self.running:
            next_pos = r.computed if r.prefilling else len(r.prompt) + len(r.output) + (r.id in pending) - 1
            if self.blocks.release_outside(r.alloc, next_pos) and batch is not None:
                row = batch.row_of(r.id)
                if row is not None:  # its table follows the released entries (alloc.blocks is a new list)
                    batch.set_blocks(row, r.alloc.blocks)

    def _schedule(self) -> tuple[list[Request], list[tuple[Request, int]]]:
        """The next step's rows: every running request past its prompt decodes one token, and the rest of the
        token budget goes to prompt chunks ``(request, tokens)`` in running order. The split of the running
        requests into decoding and prefilling ones is made again only when the running list or a request's
        prefilling state changed (``running.version``)."""
        if self._scheduled != self.running.version:
            self._decoding = [r for r in self.running if not r.prefilling]
            self._prefilling = [r for r in self.running if r.prefilling]
            self._scheduled = self.running.version
        decoding = self._decoding
        # the decode part is padded to the builder's min_batch, so count its padded size
        budget = self.max_tokens - (max(len(decoding), self.runner.builder.min_batch) if decoding else 0)
        chunks = []
        for r in self._prefilling:
            if budget <= 0:
                break
            n = self.blocks.prefill_chunk(r.computed, min(len(r.prompt) - r.computed, budget), len(r.prompt))
            chunks.append((r, n))
            budget -= n
        return decoding, chunks

    def _arrange_rows(self, decoding: list[Request], fed: dict[int, int]) -> None:
        """Make the decode batch's rows those of ``decoding`` (in order) when the running requests changed since
        it was last arranged: a request already there keeps its row, a new one's row starts from its state
        (``fed``: request id -> the previous step's logits row whose token, still on the device, is its input)."""
        version = self.running.version
        if self._rows_at == version:
            return
        self._rows.arrange([r.id for r in decoding], lambda i: self._row_state(decoding[i], fed))
        self._rows_at = version

    @staticmethod
    def _row_state(r: Request, fed: dict[int, int]) -> RowState:
        """A new decode row of ``r``: its last token as input (or a placeholder 0 when ``fed`` names the row of
        the previous step that holds it on the device), at the position after its tokens so far."""
        row = fed.get(r.id, -1)
        pending = int(row >= 0)
        token = 0 if pending else r.output[-1]
        return RowState(r.alloc.blocks, token, len(r.prompt) + len(r.output) + pending - 1, len(r.output) + pending,
                        r.params, row)

    def _grow_rows(self, decoding: list[Request]) -> None:
        """[window] Give the decode rows whose blocks do not reach their position a block (a windowed allocation
        grows from its reservation; a dense one holds its blocks from admission on) and write it into the batch."""
        batch = self._rows
        for i in batch.short().tolist():
            r = decoding[i]
            self.blocks.grow(r.alloc, int(batch.positions[i]) + 1)
            batch.set_blocks(i, r.alloc.blocks)

    def _decode_view(self, decoding: list[Request]) -> _DecodeView:
        """What reading the tokens of a decode-only step of ``decoding`` (the decode rows, in row order) needs, made
        once per ``decoding`` list (:meth:`_schedule` makes a new one whenever the running requests change)."""
        view = self._view
        if view is not None and view.requests is decoding:
            return view
        n = len(decoding)
        stop_sets = list(map(_STOPS, decoding))
        width = max(map(len, stop_sets), default=0)
        stops = None
        if width:  # -1 pads (token ids are >= 0)
            stops = np.full((n, width), -1, dtype=np.int64)
            if min(map(len, stop_sets)) == width:
                stops[:] = stop_sets
            else:
                for i, ids in enumerate(stop_sets):
                    stops[i, :len(ids)] = ids
        view = self._view = _DecodeView(decoding, list(enumerate(decoding)), list(map(_OUTPUT, decoding)),
                                        list(map(_ID, decoding)),
                                        np.fromiter(map(_MAX_NEW, decoding), np.int64, n) - 1, stops)
        return view

    @staticmethod
    def _take_rows(view: _DecodeView, tokens: np.ndarray, last: list[int], learned: dict[int, list[int]]
                   ) -> list[Request]:
        """Take a decode-only step's tokens in one pass: row ``i``'s token ``tokens[i]`` goes to the end of its
        request's output and of ``learned[request id]``, in row order; returns the requests those tokens finished (a
        stop token, or ``max_new_tokens`` reached: among the rows ``last``, see :meth:`_DecodeView.last_rows`), in
        row order, without finishing them. Every request of ``view`` must be unfinished."""
        n = len(view.ids)
        toks = tokens[:n]
        deque(map(list.append, view.outputs, toks.tolist()), 0)
        singles = toks.reshape(n, 1).tolist()  # [[t], ...]: each request's new tokens
        if learned:
            for key, new in zip(view.ids, singles):
                learned.setdefault(key, []).extend(new)
        else:
            learned.update(zip(view.ids, singles))
        ends = last
        if view.stops is not None:
            hit = (view.stops == toks[:, None]).any(1).nonzero()[0].tolist()
            if hit:
                ends = sorted({*last, *hit})
        return [r for r in map(view.requests.__getitem__, ends) if r.stopped or r.done]

    @staticmethod
    def _sample(logits: Tensor, rows: list[Request]) -> Tensor:
        """One token per row of ``logits`` ``[len(rows), V]``, each under its request's params at the index
        of the token it would generate; an all-greedy step takes the argmax (what ``sample`` gives it)."""
        if all(r.params.greedy for r in rows):
            return logits.argmax(-1)
        return sample_rows(logits, [r.params for r in rows], [len(r.output) for r in rows])

    def _fail(self, requests: list[Request], exc: Exception) -> StepFailed:
        """Finish the requests of a failed step; returns the error to raise."""
        for r in requests:
            self.running.drop(r)  # overlap: a request whose last token is in flight has left running
            self._finish(r, "error")
        ids = [r.id for r in requests]
        return StepFailed(f"the step of requests {ids} failed ({type(exc).__name__}: {exc}); they are "
                          "finished with finish_reason 'error' and their blocks freed, the engine serves "
                          "the others", ids)

    def stream(self) -> Iterator[StepOutput]:
        """Step until no request is waiting or running, yielding after every step the tokens it produced per
        request id and the requests it finished (for streaming output). Between two items the caller may add
        or abort requests; a :class:`StepFailed` propagates (iterate a fresh :meth:`stream` to go on). With
        ``overlap`` each item holds what the step before it produced (tokens arrive one step late). With
        ``dp_sync`` it steps until no group has a request (a group without any runs padding steps meanwhile)."""
        while self.dp_sync is not None or self.waiting or self.running or self._learned or self._done:
            finished = self.step()
            if self.dp_sync is not None and not self.dp_active:  # [dp] no group had a request: nothing ran
                return
            yield StepOutput(dict(self.new_tokens), finished)
            if self.waiting and not self.running:
                self._admit()
                if not self.running:  # cannot happen for admitted requests: each fits the empty cache
                    raise RuntimeError("engine is stuck: a waiting request cannot be admitted into the "
                                       "empty cache (leaked blocks?)")

    def run(self) -> list[Request]:
        """Step until no request is waiting or running (with ``dp_sync``: in any group); returns all finished
        requests by id.

        A :class:`StepFailed` propagates; calling :meth:`run` again serves the remaining requests.
        """
        for _ in self.stream():
            pass
        return sorted(self.finished, key=lambda r: r.id)

    # ------------------------------------------------------------------ overlap (see the class docstring)

    def _step_overlap(self, keep_logits: bool) -> list[Request]:
        """Plan and launch the next step while the device runs the one in flight, then read that one's tokens;
        returns the requests it finished."""
        self._admit()
        decoding, chunks = self._schedule()
        shape = None if self.dp_sync is None else self._dp_agree(decoding, chunks)  # [dp]
        if decoding or chunks:
            calls = None if shape is None else self._model_calls()  # [dp]
            try:
                step = self._launch(decoding, chunks, self._inflight, keep_logits, shape)
            except Exception as exc:
                launched = [*decoding, *(r for r, _ in chunks)]
                if shape is not None:  # [dp] run this step's collectives on padding, or stop
                    self._dp_recover(calls, shape, launched, exc)
                previous, self._inflight = self._inflight, None
                try:
                    self._read(previous)  # the previous step's tokens are kept
                except StepFailed as earlier:  # it failed too (an asynchronous device error): report both
                    failed = self._fail([r for r in launched if r.finish_reason is None], exc)
                    raise StepFailed(f"{earlier}; and then: {failed}", earlier.request_ids + failed.request_ids
                                     ) from exc
                raise self._fail([r for r in launched if r.finish_reason is None], exc) from exc
            previous, self._inflight = self._inflight, step
        else:
            previous, self._inflight = self._inflight, None
        self._read(previous)
        self._retire()
        self._release_windows(self._inflight)  # [window]
        if not self.running:
            self._sync()  # only finished requests are left in flight: wait, so an idle engine has nothing pending
        self.new_tokens, self._learned = self._learned, {}
        done, self._done = self._done, []
        return done

    def _launch(self, decoding: list[Request], chunks: list[tuple[Request, int]], previous: _InFlight | None,
                keep_logits: bool, shape: StepShape | None = None) -> _InFlight:
        """Launch a step whose decode rows take the previous step's tokens on the device where the host has
        not read them yet; register the prompt blocks it completes."""
        batch = self._rows
        if batch is not None and previous is None:  # every input id from the host: the kept rows are stale
            batch.clear()
            self._rows_at = None
        fed = {} if previous is None else _Fed(previous.yields)
        kw = {} if shape is None else {"shape": shape}  # [dp]
        rows = [*decoding, *(r for r, _ in chunks)]
        if batch is not None and not chunks:  # the decode rows kept between steps: only what changed is written
            self._arrange_rows(decoding, fed)
            self._grow_rows(decoding)  # [window]
            logits, tokens = self.runner.sample_step(batch, (), None, None, batch.fed[:len(batch)], **kw)
        else:
            if batch is not None:
                self._arrange_rows(decoding, fed)
                self._grow_rows(decoding)  # [window]
                dec, feed = batch.chunks(), batch.fed[:len(batch)].tolist()
            else:
                feed = [fed.get(r.id, -1) for r in decoding]
                dec = []
                for r, row in zip(decoding, feed):
                    pending = int(row >= 0)  # its last token is still on the device (0: a placeholder id)
                    token = 0 if pending else r.output[-1]
                    pos = len(r.prompt) + len(r.output) + pending - 1
                    self.blocks.grow(r.alloc, pos + 1)  # [window] a no-op unless a windowed allocation needs a block
                    dec.append(self.blocks.chunk(r.alloc, [token], pos, key=r.id))
            pre = [self.blocks.chunk(r.alloc, r.prompt[r.computed:r.computed + n], r.computed) for r, n in chunks]
            steps = [len(r.output) + (r.id in fed) for r in rows]  # the index of the token each row draws
            logits, tokens = self.runner.sample_step(dec, pre, [r.params for r in rows], steps, feed, **kw)
        self._returned = True  # [dp] the runner returned: every collective of its model step ran
        view = last = None
        if batch is not None and not chunks:  # its tokens are read in one vectorised pass (see _take_rows)
            view = self._decode_view(decoding)
            last = view.last_rows(batch.steps)
        if batch is not None:
            batch.advance(None, fed=True)  # the next step feeds each row this step's token, on the device
        host, ready = self._host_tokens.copy(tokens)
        kept = logits.detach().to(torch.float32, copy=True) if keep_logits else None
        if view is not None:
            return _InFlight(rows, view.yields, host, ready, kept, [], view, last, self._finishes)
        yields = list(enumerate(decoding))
        registered = []  # findable before the step is known to succeed: forgotten again if it fails (_read)
        for i, (r, n) in enumerate(chunks):
            r.computed += n
            registered.append(self.blocks.register(r.alloc, r.prompt[:r.computed]))
            if not r.prefilling:  # the chunk that completes the prompt yields the first token
                self.running.touch()  # it decodes from the next step on
                yields.append((len(decoding) + i, r))
        return _InFlight(rows, yields, host, ready, kept, registered)

    def _read(self, step: _InFlight | None) -> None:
        """Take a launched step's tokens (waiting for its copy): append them, finish the requests they end."""
        if step is None:
            return
        try:
            if step.ready is not None:
                step.ready.synchronize()  # an asynchronous device error of the step shows here
            sampled = step.tokens.tolist()
            if step.logits is not None:
                self.step_logits.append(step.logits.cpu())
        except Exception as exc:
            failed = [r for r in step.requests if r.finish_reason is None]
            made = list(step.registered)  # its prompt blocks may hold garbage
            later, self._inflight = self._inflight, None
            if later is not None and later is not step:  # launched on top of it (its tokens, its blocks): fail too
                made += later.registered
                failed += [r for r in later.requests if r.finish_reason is None and r not in failed]
            # and every request admitted on a prefix hit of those blocks (or snapshots), scheduled yet or not
            failed += [r for r in self.running if r not in failed and self.blocks.uses(r.alloc, made)]
            for m in made:  # no later prompt matches them
                self.blocks.forget(m)
            raise self._fail(failed, exc) from exc
        view = step.view
        if view is not None and (step.finishes == self._finishes or not any(map(_FINISH_REASON, view.requests))):
            # every request of this decode-only step is still unfinished: one vectorised pass
            for r in self._take_rows(view, step.tokens.numpy(), step.last, self._learned):
                self.running.drop(r)  # absent when it reached max_new_tokens (retired at the launch)
                self._finish(r, "stop" if r.stopped else "length")
                self._done.append(r)
            return
        for row, r in step.yields:
            if r.finish_reason is not None:
                continue  # it stopped in the step before (or failed) after this one was launched: drop the token
            r.output.append(sampled[row])
            self._learned.setdefault(r.id, []).append(sampled[row])
            if r.stopped or r.done:
                self.running.drop(r)
                self._finish(r, "stop" if r.stopped else "length")
                self._done.append(r)

    def _retire(self) -> None:
        """Requests whose last token (``max_new_tokens``) the step in flight draws leave the batch and free their
        blocks now, as they would after that step without overlap: any step that reuses the blocks is launched
        later, so the device runs it after this one."""
        step = self._inflight
        if step is None:
            return
        if step.view is not None:  # a decode-only step: the rows drawing their last token are known
            retiring = [r for r in map(step.view.requests.__getitem__, step.last)
                        if len(r.output) + 1 >= r.max_new_tokens and self.running.index_of(r) >= 0]
        else:
            yielding = {r.id for _, r in step.yields}
            retiring = [r for r in self.running if r.id in yielding and len(r.output) + 1 >= r.max_new_tokens]
        for r in retiring:
            self.running.drop(r)
            self.blocks.free(r.alloc)

    def _sync(self) -> None:
        """Overlap: wait for the step in flight and take its tokens (nothing to do without one)."""
        step, self._inflight = self._inflight, None
        self._read(step)


_VERSIONS = itertools.count()


class _Running(list):
    """The engine's running requests: a list whose :attr:`version` changes with every change of it (and with every
    request that starts decoding: :meth:`touch`, called by the engine), to a value no list of any engine had
    before, so work that depends only on it is redone only then."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.version = next(_VERSIONS)

    def touch(self) -> None:
        """Mark a change the list cannot see (a request's prefilling state)."""
        self.version = next(_VERSIONS)

    def index_of(self, item: Any) -> int:
        """The index of ``item`` itself, or -1: compared by identity (``in`` and ``remove`` compare by ``==``, which for
        a dataclass builds and compares the field tuples of every request before it)."""
        try:
            return list(map(is_, self, repeat(item))).index(True)
        except ValueError:
            return -1

    def drop(self, item: Any) -> bool:
        """Remove ``item`` itself (see :meth:`index_of`); returns whether it was there."""
        i = self.index_of(item)
        if i < 0:
            return False
        del self[i]
        return True

    def _changed(method):  # noqa: N805 - a decorator of the methods below
        def changed(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            self.version = next(_VERSIONS)
            return out
        changed.__name__ = method.__name__
        return changed

    append, remove, insert, pop, extend, clear = map(_changed, (list.append, list.remove, list.insert, list.pop,
                                                               list.extend, list.clear))
    sort, reverse = _changed(list.sort), _changed(list.reverse)
    __setitem__, __delitem__, __iadd__ = _changed(list.__setitem__), _changed(list.__delitem__), \
        _changed(list.__iadd__)
    del _changed


class _Fed(dict):
    """Request id -> the logits row of a launched step whose token is that request's next input, made from the
    step's ``yields`` on first use (most steps never look one up)."""

    def __init__(self, yields: list[tuple[int, Request]]) -> None:
        super().__init__()
        self._yields = yields

    def _fill(self) -> None:
        if self._yields is not None:
            self.update((r.id, row) for row, r in self._yields)
            self._yields = None

    def get(self, key, default=None):
        self._fill()
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._fill()
        return super().__contains__(key)


_ID, _OUTPUT, _MAX_NEW = attrgetter("id"), attrgetter("output"), attrgetter("max_new_tokens")
_STOPS, _FINISH_REASON = attrgetter("params.stop_token_ids"), attrgetter("finish_reason")


class _DecodeView(NamedTuple):
    """The decode rows of one ``decoding`` list (see ``Engine._decode_view``): the ``requests`` in row order, their
    ``(row, request)`` pairs, output lists and ids, the index of each one's last token (``max_new_tokens - 1``,
    int64 ``[n]``) and its stop token ids (int64 ``[n, k]``, -1 padded; None: no row has any)."""

    requests: list[Request]
    yields: list[tuple[int, Request]]
    outputs: list[list[int]]
    ids: list[int]
    final: np.ndarray
    stops: np.ndarray | None

    def last_rows(self, steps: np.ndarray) -> list[int]:
        """The rows that draw their request's last token (``max_new_tokens``) in a step where row ``i`` draws the
        token of index ``steps[i]`` (``DecodeRows.steps`` before the step's advance), ascending."""
        return (steps[:len(self.ids)] >= self.final).nonzero()[0].tolist()


@dataclass
class _InFlight:
    """An overlap step launched but not read: its ``requests`` (one per logits row), the ``(row, request)``
    pairs whose token is a new output token, its tokens in host memory once ``ready`` (a CUDA event; None:
    already there), a device copy of its float32 logits (``keep_logits``) or None, and the prompt blocks its
    launch made findable (what each ``blocks.register`` call returned; given to ``blocks.forget`` if it fails).
    A decode-only step of the engine's decode rows also has its ``view`` (``Engine._decode_view``), the rows that
    draw their request's last token (``last``) and the engine's count of finished requests at its launch, so its
    tokens are read in one pass (``Engine._take_rows``) when no request finished since."""

    requests: list[Request]
    yields: list[tuple[int, Request]]
    tokens: Tensor
    ready: Any
    logits: Tensor | None
    registered: list[Any]
    view: _DecodeView | None = None
    last: list[int] | None = None
    finishes: int = 0


class _HostTokens:
    """Host memory for the tokens of the last two steps (pinned for a CUDA device), used in turn: step n's
    tokens are read before step n+2 is launched, so a buffer is never overwritten before it was read."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._buffers: list[Tensor] = []
        self._turn = 0

    def copy(self, tokens: Tensor) -> tuple[Tensor, Any]:
        """Start copying int64 ``tokens`` ``[n]`` to the host (non-blocking); returns the host view and the CUDA
        event to wait on (None: the copy is done)."""
        cuda = tokens.device.type == "cuda"
        if not self._buffers:
            self._buffers = [torch.empty(self.rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        host = self._buffers[self._turn][:tokens.shape[0]]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        if not cuda:
            return host, None
        ready = torch.cuda.Event()
        ready.record()
        return host, ready
