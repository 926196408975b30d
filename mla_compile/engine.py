"""A small reference serving engine: prefix-cached block allocation, chunked prefill mixed with
decodes, greedy sampling.

Each :meth:`Engine.step` is one model step under a token budget: every running request decodes one
token, and the rest of the budget goes to prompt chunks of requests being prefilled (a long prompt
spreads over several steps; each chunk attends to the cached context before it). Admission reserves
a request's blocks up front; full blocks of earlier prompts are shared through the prefix cache, so
a prefill starts after its cached prefix. A request stops at ``max_new_tokens``. Steps go through a
runner (:class:`~mla_compile.graphs.cuda_graph.DecodeGraphRunner`): pure decode steps replay CUDA
graphs when the runner has captured them.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from torch import Tensor

from mla_compile.builder import MetadataBuilder
from mla_compile.block_manager import Allocation, BlockManager
from mla_compile.metadata import SeqChunk


class StepRunner(Protocol):
    """What the engine drives: ``mla_compile.graphs.cuda_graph.DecodeGraphRunner`` (the core does not
    import graphs; any object with these members works)."""

    builder: MetadataBuilder

    def decode(self, chunks: Sequence[SeqChunk]) -> Tensor: ...

    def run(self, decode: Sequence[SeqChunk], prefill: Sequence[SeqChunk] = ()) -> Tensor: ...


@dataclass
class Request:
    """One generation request and its state (``computed``: prompt tokens already in the cache)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    alloc: Allocation = field(default_factory=Allocation)
    computed: int = 0

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


class Engine:
    """Greedy serving over a patched model's paged cache, driven one step at a time."""

    def __init__(self, runner: StepRunner, *, num_blocks: int, max_tokens_per_step: int | None = None,
                 enable_prefix_caching: bool = True) -> None:
        self.runner = runner
        self.block_size = runner.builder.block_size
        self.max_batch = runner.builder.max_batch
        self.max_blocks = runner.builder.max_blocks
        self.max_tokens = min(max_tokens_per_step or runner.builder.max_tokens, runner.builder.max_tokens)
        if self.max_tokens <= self.max_batch:
            raise ValueError(f"max_tokens_per_step ({self.max_tokens}) must exceed max_batch ({self.max_batch}) "
                             "so prompts progress while a full batch decodes")
        self.blocks = BlockManager(num_blocks, self.block_size, enable_prefix_caching=enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._ids = itertools.count()
        self.step_logits: list[Tensor] = []
        self.cached_prompt_tokens = 0

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue a request; returns its id. Errors if it could never fit."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("prompt must be non-empty and max_new_tokens >= 1")
        total = len(prompt) + max_new_tokens
        if -(-total // self.block_size) > self.max_blocks:
            raise ValueError(f"prompt + max_new_tokens = {total} tokens exceed max_blocks_per_seq * block_size = "
                             f"{self.max_blocks * self.block_size}")
        req = Request(next(self._ids), list(prompt), max_new_tokens)
        self.waiting.append(req)
        return req.id

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
        """Run one step; returns the requests that finished in it."""
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
        dec = [SeqChunk(r.blocks, [r.output[-1]], r.length) for r in decoding]
        pre = [SeqChunk(r.blocks, r.prompt[r.computed:r.computed + n], r.computed) for r, n in chunks]
        logits = self.runner.run(dec, pre) if pre else self.runner.decode(dec)
        if keep_logits:
            self.step_logits.append(logits.float().cpu())
        sampled = logits.argmax(-1).tolist()
        for r, t in zip(decoding, sampled):
            r.output.append(t)
        for (r, n), t in zip(chunks, sampled[len(decoding):]):
            r.computed += n
            self.blocks.register(r.alloc, r.prompt[:r.computed])
            if not r.prefilling:  # the chunk that completes the prompt yields the first token
                r.output.append(t)
        done = [r for r in self.running if r.done]
        for r in done:
            self.running.remove(r)
            self.blocks.free(r.alloc)
        self.finished.extend(done)
        return done

    def run(self) -> list[Request]:
        """Step until no request is waiting or running; returns all finished requests by id."""
        while self.waiting or self.running:
            self.step()
            if self.waiting and not self.running:
                raise RuntimeError("engine is stuck: waiting requests cannot be admitted (cache too small?)")
        return sorted(self.finished, key=lambda r: r.id)
