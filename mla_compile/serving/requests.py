"""A serving request and what a step reports of it: :class:`Request` (one generation and its state),
:class:`StepOutput`, :class:`StepFailed` and the finish reasons. :class:`~mla_compile.serving.engine.Engine` moves
requests through their states."""

from __future__ import annotations

from dataclasses import dataclass, field

from mla_compile.serving.block_manager import Allocation
from mla_compile.serving.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class StepOutput:
    """What one step of :meth:`~mla_compile.serving.engine.Engine.stream` produced: ``tokens`` (request id -> the
    tokens it generated in the step, in order; requests still prefilling are absent) and the requests it
    ``finished``."""

    tokens: dict[int, list[int]]
    finished: list["Request"]


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
