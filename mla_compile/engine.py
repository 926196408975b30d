"""A small reference serving engine: block allocation, admission, prefill-then-decode, greedy sampling.

Each :meth:`Engine.step` is one model step: if requests are waiting and fit (token budget, batch
and free blocks), they are prefilled together; otherwise every running request decodes one token.
New requests join running ones between steps; a request stops at ``max_new_tokens``. Steps go
through a runner (:class:`~mla_compile.graphs.cuda_graph.DecodeGraphRunner`), so decode steps replay
CUDA graphs when the runner has captured them.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from torch import Tensor

from mla_compile.builder import MetadataBuilder
from mla_compile.generate import BlockAllocator
from mla_compile.metadata import SeqChunk


class StepRunner(Protocol):
    """What the engine drives: ``mla_compile.graphs.cuda_graph.DecodeGraphRunner`` (the core does not
    import graphs; any object with these members works)."""

    builder: MetadataBuilder

    def decode(self, chunks: Sequence[SeqChunk]) -> Tensor: ...

    def run(self, decode: Sequence[SeqChunk], prefill: Sequence[SeqChunk] = ()) -> Tensor: ...


@dataclass
class Request:
    """One generation request and its state."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Tokens in the cache after the last step (prompt plus generated, minus the unfed last token)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def done(self) -> bool:
        """Whether it has produced ``max_new_tokens`` tokens."""
        return len(self.output) >= self.max_new_tokens


class Engine:
    """Greedy serving over a patched model's paged cache, driven one step at a time."""

    def __init__(self, runner: StepRunner, *, num_blocks: int, max_tokens_per_step: int | None = None) -> None:
        self.runner = runner
        self.block_size = runner.builder.block_size
        self.max_batch = runner.builder.max_batch
        self.max_blocks = runner.builder.max_blocks
        self.max_tokens = min(max_tokens_per_step or runner.builder.max_tokens, runner.builder.max_tokens)
        self.allocator = BlockAllocator(num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._ids = itertools.count()
        self.step_logits: list[Tensor] = []

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue a request; returns its id. Errors if it could never fit."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("prompt must be non-empty and max_new_tokens >= 1")
        total = len(prompt) + max_new_tokens
        if -(-total // self.block_size) > self.max_blocks:
            raise ValueError(f"prompt + max_new_tokens = {total} tokens exceed max_blocks_per_seq * block_size = "
                             f"{self.max_blocks * self.block_size}")
        if len(prompt) > self.max_tokens:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds the step token budget {self.max_tokens}")
        req = Request(next(self._ids), list(prompt), max_new_tokens)
        self.waiting.append(req)
        return req.id

    def _blocks_for(self, req: Request, tokens: int) -> None:
        need = -(-tokens // self.block_size) - len(req.blocks)
        if need > 0:
            req.blocks.extend(self.allocator.take(need))

    def _admit(self) -> list[Request]:
        batch, tokens = [], 0
        while self.waiting and len(batch) < self.max_batch and len(self.running) + len(batch) < self.max_batch:
            req = self.waiting[0]
            need = -(-len(req.prompt) // self.block_size)
            if tokens + len(req.prompt) > self.max_tokens or need > len(self.allocator.free):
                break
            self.waiting.popleft()
            self._blocks_for(req, len(req.prompt))
            batch.append(req)
            tokens += len(req.prompt)
        return batch

    def step(self, keep_logits: bool = False) -> list[Request]:
        """Run one step; returns the requests that finished in it."""
        prefill = self._admit()
        if prefill:
            logits = self.runner.run([], [SeqChunk(r.blocks, r.prompt) for r in prefill])
            batch = prefill
            self.running.extend(prefill)
        elif self.running:
            batch = self.running
            for r in batch:
                self._blocks_for(r, r.length + 1)
            logits = self.runner.decode([SeqChunk(r.blocks, [r.output[-1]], r.length) for r in batch])
        else:
            return []
        if keep_logits:
            self.step_logits.append(logits.float().cpu())
        for r, t in zip(batch, logits.argmax(-1).tolist()):
            r.output.append(t)
        done = [r for r in self.running if r.done]
        for r in done:
            self.running.remove(r)
            self.allocator.release(r.blocks)
            r.blocks = []
        self.finished.extend(done)
        return done

    def run(self) -> list[Request]:
        """Step until no request is waiting or running; returns all finished requests by id."""
        while self.waiting or self.running:
            if not self.step() and not self.running and self.waiting:
                raise RuntimeError("engine is stuck: waiting requests cannot be admitted (cache too small?)")
        return sorted(self.finished, key=lambda r: r.id)
