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
with ``dp_sync`` too (its builder pads a step to the agreed tokens and rows).

``Engine(dp_sync=DPStepSync(...))`` serves one data-parallel attention group (:mod:`mla_compile.serving.dp_sync`):
every step's shape is agreed with the other groups' engines first and the step padded to it; a group with no
work runs padding-only steps while others have some; a step failing before its model runs a padding-only step in
its place. The lines marked ``[dp]`` do this, with :class:`~mla_compile.serving.engine_dp.DPSteps`; the overlap
steps are :class:`~mla_compile.serving.engine_overlap.OverlapSteps`, the row bookkeeping
:mod:`mla_compile.serving.engine_rows`, the request types :mod:`mla_compile.serving.requests`.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import deque
from typing import Iterator, Protocol, Sequence

from torch import Tensor

from mla_compile.serving.admission import RequestLimits, model_limits, validate_request
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.decode_rows import DecodeRows, RowState
from mla_compile.serving.block_manager import BlockManager, sink_window_of
from mla_compile.models.metadata import SeqChunk
from mla_compile.serving.dp_sync import DPStepFatal, DPStepSync
from mla_compile.serving.engine_dp import DPSteps
from mla_compile.serving.engine_overlap import HostTokens, InFlight, OverlapSteps
from mla_compile.serving.engine_rows import DecodeView, RunningList, decode_view, take_rows
from mla_compile.serving.requests import FINISH_REASONS, Request, StepFailed, StepOutput
from mla_compile.serving.sampling import SamplingParams, sample_rows
from mla_compile.serving.v4_blocks import V4BlockManager
from mla_compile.serving.v4_builder import V4DecodeBuilder

__all__ = ["Engine", "FINISH_REASONS", "Request", "StepFailed", "StepOutput", "StepRunner"]


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


class Engine(OverlapSteps, DPSteps):
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
        self._inflight: InFlight | None = None  # overlap: the launched step whose tokens are not read yet
        self._host_tokens = HostTokens(2 * self.max_batch)
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
        self._view: DecodeView | None = None  # see _decode_view
        self._finishes = 0  # requests finished so far (_finish calls): a step read notes if any finished since launch

    @property
    def running(self) -> list[Request]:
        """The admitted requests not finished yet, in batch order (prefilling ones included)."""
        return self._running

    @running.setter
    def running(self, requests: list[Request]) -> None:
        self._running = RunningList(requests)  # a version no list had before

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

    def _release_windows(self, in_flight: InFlight | None = None) -> None:
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

    def _decode_view(self, decoding: list[Request]) -> DecodeView:
        """:func:`~mla_compile.serving.engine_rows.decode_view` of ``decoding``, made once per ``decoding`` list
        (:meth:`_schedule` makes a new one whenever the running requests change)."""
        if self._view is None or self._view.requests is not decoding:
            self._view = decode_view(decoding)
        return self._view

    _take_rows = staticmethod(take_rows)

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
