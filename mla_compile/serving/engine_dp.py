"""``Engine(dp_sync=...)``'s agreement with the other data-parallel attention groups (see
:class:`~mla_compile.serving.engine.Engine` and :mod:`mla_compile.serving.dp_sync`): every step's shape agreed
first, padding-only steps, and the recovery or the stop when a step fails. :class:`DPSteps` is a part of ``Engine``
(its methods use the engine's state)."""

from __future__ import annotations

import inspect

from mla_compile.models.metadata import step_size
from mla_compile.serving.dp_sync import DPStepFatal, StepDemand, StepShape
from mla_compile.serving.requests import Request


class DPSteps:
    """The ``[dp]`` steps of :class:`~mla_compile.serving.engine.Engine` (a base class of it, not used alone)."""

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
