"""Serving under data-parallel attention: every attention group's engine runs each step with one agreed shape.

With ``ParallelConfig(dp_attention=D)`` each attention group serves its own requests with its own latent cache
(one :class:`~mla_compile.serving.engine.Engine` per group, the same on every rank of the group), while the
MLPs, MoE and ``lm_head`` all-gather every group's tokens (:func:`mla_compile.parallel.layers.gathered`). So
every rank must run every step (the collectives are inside the model), and every group's step must have the
same number of tokens and of logits rows.

:class:`DPStepSync` makes that so on the host, before each step is planned (never inside compiled code): each
engine states what it would run (:class:`StepDemand`: its decode rows, whether it prefills, its step's padded
tokens and rows), one all-reduce (max) of those few ints over a CPU (gloo) process group gives every group the
same :class:`StepAgreement`, and each engine pads its step to the agreed :class:`StepShape` with tokens and rows
that read and write nothing (slot -1, sequence length 0; :func:`mla_compile.models.metadata.plan_step`):

- no group prefills: a decode-only step whose decode part holds the most decode rows of any group (each runner
  pads it to the same CUDA-graph capture size; every rank's runner must have the same capture sizes);
- some group prefills: a mixed step of the most tokens and the most logits rows of any group.

A group with nothing to run while others step runs a padding-only step of that shape; the engines stop only
when the agreement says no group has any request left (``StepAgreement.active``).

A step that fails on one rank (see :class:`~mla_compile.serving.engine.Engine`) is recovered where every rank can
still run the same collectives: a failure before that rank's model started (planning, building, a runner that
raises before calling the model) is followed by a padding-only step of the agreed shape on that rank, and one after
its runner returned (sampling, reading the tokens) needs nothing more; that rank fails the step's requests and every
rank goes on. A failure once its model started (its collectives may have run on some ranks and not on others)
cannot be recovered: it raises :class:`DPStepFatal` on that rank, whose engine then stops, and the peers, left
waiting in a collective of the model or of the next agreement, raise :class:`DPStepFatal` when that collective
fails or times out (the process groups' ``timeout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from mla_compile.parallel.groups import current


class DPStepFatal(RuntimeError):
    """Data-parallel serving cannot go on: a step failed where the ranks' collectives may no longer match (inside
    a model step, or a padding step that could not run), or a collective of the agreement or of the model failed or
    timed out (a peer failed so, stopped stepping or died). The engine that raised it fails all its requests
    (``request_ids``, finished with ``finish_reason == "error"``) and raises it again from every later step; the
    other ranks raise it too, at the latest when their process group's timeout runs out. Not a ``StepFailed``:
    a loop that catches those and steps on still stops."""

    def __init__(self, message: str, request_ids: list[int] | None = None) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids or [])


@dataclass(frozen=True)
class StepShape:
    """The padded shape every attention group runs a step with.

    ``decode_only``: a decode step whose decode part holds at least ``decode_rows`` sequences (a runner pads it
    to its capture size of that, the same on every rank). Otherwise a mixed step of exactly ``tokens`` tokens and
    ``rows`` logits rows (``MetadataBuilder.build(..., tokens=, rows=)``, ``V4DecodeBuilder.build`` alike)."""

    decode_only: bool
    decode_rows: int = 0
    tokens: int = 0
    rows: int = 0


@dataclass(frozen=True)
class StepDemand:
    """What one group would run this step: ``active`` (it has requests waiting, running or in flight), its real
    ``decode`` rows, whether it has ``prefill`` chunks, and its step's padded ``tokens`` and logits ``rows``
    (:func:`mla_compile.models.metadata.step_size`; 0 and 0 when it has no chunk)."""

    active: bool
    decode: int
    prefill: bool
    tokens: int
    rows: int

    def vector(self) -> list[int]:
        """The ints the groups reduce (by max), in :func:`agree_shape`'s order."""
        busy = self.decode > 0 or self.prefill
        return [int(self.active), int(busy), self.decode, int(self.prefill), self.tokens if busy else 0,
                self.rows if busy else 0]


@dataclass(frozen=True)
class StepAgreement:
    """What every group learns before a step: whether some group still has requests (``active``: keep
    stepping) and the ``shape`` of this step (None: no group has anything to run, so no rank runs a step)."""

    active: bool
    shape: StepShape | None


def agree_shape(maxima: Sequence[int]) -> StepAgreement:
    """The agreement from the element-wise maxima of every group's :meth:`StepDemand.vector`."""
    active, busy, decode, prefill, tokens, rows = (int(v) for v in maxima)
    if not busy:
        return StepAgreement(bool(active), None)
    if not prefill:
        return StepAgreement(True, StepShape(True, decode_rows=decode))
    return StepAgreement(True, StepShape(False, tokens=tokens, rows=rows))


class DPStepSync:
    """Host-side agreement of data-parallel attention groups on each step's shape (see the module docstring).

    ``group``: a CPU-capable (gloo) process group over every rank that runs an engine (default: a new gloo group
    over the whole world, made here with ``timeout``, a timedelta or seconds, by default the one given to
    :func:`mla_compile.parallel.init`, else torch's default; every rank must construct its ``DPStepSync`` at the
    same point, as ``new_group`` is collective). Every rank must then call :meth:`agree` once per engine step, in
    lockstep: :class:`~mla_compile.serving.engine.Engine` does it in each
    :meth:`~mla_compile.serving.engine.Engine.step`.
    A failed or timed-out all-reduce (a peer stopped stepping or died) raises :class:`DPStepFatal`.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: timedelta | float | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DPStepSync needs torch.distributed: call mla_compile.parallel.init(config) first")
        if timeout is None:
            try:
                timeout = current().timeout
            except RuntimeError:  # torch.distributed set up without mla_compile.parallel.init
                pass
        if timeout is not None and not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        self.group = dist.new_group(backend="gloo", timeout=timeout) if group is None else group
        self.steps = 0  # agreements made (one per engine step)

    def _max(self, values: Sequence[int]) -> list[int]:
        vec = torch.tensor(list(values), dtype=torch.int64)
        try:
            dist.all_reduce(vec, dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:  # gloo's timeout or a closed connection
            raise DPStepFatal(f"DPStepSync: the all-reduce of the step agreement failed ({type(exc).__name__}: "
                              f"{exc}): a peer engine stopped stepping (a fatal step failure, an exception in its "
                              "serving loop) or died; data-parallel serving cannot go on") from exc
        return vec.tolist()

    def agree(self, demand: StepDemand) -> StepAgreement:
        """This step's :class:`StepAgreement` from every group's ``demand`` (one all-reduce of six ints)."""
        self.steps += 1
        return agree_shape(self._max(demand.vector()))

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank (one all-reduce; e.g. a driver loop: some rank still expects
        requests)."""
        return bool(self._max([int(flag)])[0])

    def check_same(self, what: str, values: Sequence[int]) -> None:
        """Raise ``ValueError`` on every rank unless every rank passed the same ``values`` (the same length
        everywhere); ``what`` names them in the error."""
        vals = [int(v) for v in values]
        hi = self._max(vals)
        lo = [-v for v in self._max([-v for v in vals])]
        if hi != lo:
            raise ValueError(f"DPStepSync: {what} differ across ranks (this rank {vals}, max {hi}, min {lo}): every "
                             "data-parallel attention group must build its engine and runner alike")
