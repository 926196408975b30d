"""A small reference serving engine: prefix-cached block allocation, chunked prefill mixed with
decodes, per-request sampling (:mod:`mla_compile.serving.sampling`).

Each :meth:`Engine.step` is one model step under a token budget: every running request decodes one
token, and the rest of the budget goes to prompt chunks of requests being prefilled (a long prompt
spreads over several steps; each chunk attends to the cached context before it). Admission reserves
a request's blocks up front; full blocks of earlier prompts are shared through the prefix cache, so
a prefill starts after its cached prefix. A request stops at a stop token or ``max_new_tokens``. Steps go through a
runner (:class:`~mla_compile.graphs.cuda_graph.DecodeGraphRunner`): pure decode steps replay CUDA
graphs when the runner has captured them.

One client never takes down the others: requests are validated before they are queued
(:mod:`mla_compile.serving.admission`), any request can be aborted between steps, and a step whose runner
raises fails only the requests in that step (see :class:`Engine`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

from torch import Tensor

from mla_compile.serving.admission import RequestLimits, model_limits, validate_request
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.block_manager import Allocation, BlockManager, sink_window_of
from mla_compile.models.metadata import SeqChunk
from mla_compile.serving.sampling import SamplingParams, sample_rows

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
    tokens."""

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
    """

    def __init__(self, runner: StepRunner, *, num_blocks: int, max_tokens_per_step: int | None = None,
                 enable_prefix_caching: bool = True, vocab_size: int | None = None,
                 max_positions: int | None = None, seed: int = 0) -> None:
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
        # sink + window models (patch(..., sparse="sink_window")): blocks outside both are released as it moves
        self.blocks = BlockManager(num_blocks, self.block_size, enable_prefix_caching=enable_prefix_caching,
                                   sink_window=sink_window_of(runner))
        windowed = self.blocks.sink_window is not None
        self.limits = RequestLimits(vocab_size=vocab_size, max_seq_tokens=self.max_blocks * self.block_size,
                                    cache_tokens=self.blocks.usable_blocks * self.block_size,
                                    max_positions=max_positions, peak_tokens=self.blocks.peak_tokens if windowed else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.requests: dict[int, Request] = {}  # every admitted request by id
        self._ids = itertools.count()
        self._seeds = random.Random(seed)
        self.step_logits: list[Tensor] = []
        self.new_tokens: dict[int, list[int]] = {}  # the last step's tokens by request id (see stream)
        self.cached_prompt_tokens = 0

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
        ``ValueError``.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} is unknown: never added, or rejected at admission")
        if req.finish_reason is not None:
            return req
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return req

    def _finish(self, req: Request, reason: str) -> None:
        assert reason in FINISH_REASONS and req.finish_reason is None, (reason, req.finish_reason)
        req.finish_reason = reason
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
        """Run one step; returns the requests that finished in it.

        Raises :class:`StepFailed` when the runner raised: the step's requests are failed (see the
        class docstring) and the engine is ready for the next step.
        """
        self.new_tokens = {}
        self._admit()
        decoding = [r for r in self.running if not r.prefilling]
        # the decode part is padded to the builder's min_batch, so count its padded size
        budget = self.max_tokens - (max(len(decoding), self.runner.builder.min_batch) if decoding else 0)
        chunks = []
        for r in self.running:
            if r.prefilling and budget > 0:
                n = min(len(r.prompt) - r.computed, budget)
                chunks.append((r, n))
                budget -= n
        if not decoding and not chunks:
            return []
        for r in decoding:  # [window] a no-op unless a windowed allocation reaches a new block
            self.blocks.grow(r.alloc, r.length + 1)
        dec = [SeqChunk(r.blocks, [r.output[-1]], r.length) for r in decoding]
        pre = [SeqChunk(r.blocks, r.prompt[r.computed:r.computed + n], r.computed) for r, n in chunks]
        try:
            rows = [*decoding, *(r for r, _ in chunks)]
            decode_sampled = None if pre else getattr(self.runner, "decode_sampled", None)
            if decode_sampled is not None:  # the runner samples on the device, in the captured step if it can
                logits, tokens = decode_sampled(dec, [r.params for r in rows], [len(r.output) for r in rows])
            else:
                logits = self.runner.run(dec, pre) if pre else self.runner.decode(dec)
                tokens = self._sample(logits, rows)
            sampled = tokens.tolist()  # a host sync: an asynchronous device error shows here
            if keep_logits:
                self.step_logits.append(logits.float().cpu())
        except Exception as exc:
            raise self._fail([*decoding, *(r for r, _ in chunks)], exc) from exc
        for r, t in zip(decoding, sampled):
            r.output.append(t)
            self.new_tokens[r.id] = [t]
        for (r, n), t in zip(chunks, sampled[len(decoding):]):
            r.computed += n
            self.blocks.register(r.alloc, r.prompt[:r.computed])  # only now are these blocks complete
            if not r.prefilling:  # the chunk that completes the prompt yields the first token
                r.output.append(t)
                self.new_tokens[r.id] = [t]
        done = [r for r in self.running if r.stopped or r.done]
        for r in done:
            self.running.remove(r)
            self._finish(r, "stop" if r.stopped else "length")
        for r in self.running:  # [window] give back blocks no later query reads (a no-op for dense models)
            self.blocks.release_outside(r.alloc, r.computed if r.prefilling else r.length)
        return done

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
            self.running.remove(r)
            self._finish(r, "error")
        ids = [r.id for r in requests]
        return StepFailed(f"the step of requests {ids} failed ({type(exc).__name__}: {exc}); they are "
                          "finished with finish_reason 'error' and their blocks freed, the engine serves "
                          "the others", ids)

    def stream(self) -> Iterator[StepOutput]:
        """Step until no request is waiting or running, yielding after every step the tokens it produced per
        request id and the requests it finished (for streaming output). Between two items the caller may add
        or abort requests; a :class:`StepFailed` propagates (iterate a fresh :meth:`stream` to go on)."""
        while self.waiting or self.running:
            finished = self.step()
            yield StepOutput(dict(self.new_tokens), finished)
            if self.waiting and not self.running:
                self._admit()
                if not self.running:  # cannot happen for admitted requests: each fits the empty cache
                    raise RuntimeError("engine is stuck: a waiting request cannot be admitted into the "
                                       "empty cache (leaked blocks?)")

    def run(self) -> list[Request]:
        """Step until no request is waiting or running; returns all finished requests by id.

        A :class:`StepFailed` propagates; calling :meth:`run` again serves the remaining requests.
        """
        for _ in self.stream():
            pass
        return sorted(self.finished, key=lambda r: r.id)
