"""``Engine(overlap=True)``'s steps (see :class:`~mla_compile.serving.engine.Engine`): plan and launch step n+1
while the device runs step n, read step n's tokens one step late. :class:`OverlapSteps` is a part of ``Engine``
(its methods use the engine's state); :class:`InFlight` is a launched step not read yet, :class:`HostTokens` the
host memory its tokens arrive in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mla_compile.serving.dp_sync import StepShape
from mla_compile.serving.engine_rows import DecodeView, FedRows, finish_reason_of
from mla_compile.serving.requests import Request, StepFailed


class OverlapSteps:
    """The overlap steps of :class:`~mla_compile.serving.engine.Engine` (a base class of it, not used alone)."""

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

    def _launch(self, decoding: list[Request], chunks: list[tuple[Request, int]], previous: InFlight | None,
                keep_logits: bool, shape: StepShape | None = None) -> InFlight:
        """Launch a step whose decode rows take the previous step's tokens on the device where the host has
        not read them yet; register the prompt blocks it completes."""
        batch = self._rows
        if batch is not None and previous is None:  # every input id from the host: the kept rows are stale
            batch.clear()
            self._rows_at = None
        fed = {} if previous is None else FedRows(previous.yields)
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
            return InFlight(rows, view.yields, host, ready, kept, [], view, last, self._finishes)
        yields = list(enumerate(decoding))
        registered = []  # findable before the step is known to succeed: forgotten again if it fails (_read)
        for i, (r, n) in enumerate(chunks):
            r.computed += n
            registered.append(self.blocks.register(r.alloc, r.prompt[:r.computed]))
            if not r.prefilling:  # the chunk that completes the prompt yields the first token
                self.running.touch()  # it decodes from the next step on
                yields.append((len(decoding) + i, r))
        return InFlight(rows, yields, host, ready, kept, registered)

    def _read(self, step: InFlight | None) -> None:
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
        if view is not None and (step.finishes == self._finishes or not any(map(finish_reason_of, view.requests))):
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


@dataclass
class InFlight:
    """An overlap step launched but not read: its ``requests`` (one per logits row), the ``(row, request)``
    pairs whose token is a new output token, its tokens in host memory once ``ready`` (a CUDA event; None:
    already there), a device copy of its float32 logits (``keep_logits``) or None, and the prompt blocks its
    launch made findable (what each ``blocks.register`` call returned; given to ``blocks.forget`` if it fails).
    A decode-only step of the engine's decode rows also has its ``view``
    (:func:`~mla_compile.serving.engine_rows.decode_view`), the rows that draw their request's last token
    (``last``) and the engine's count of finished requests at its launch, so its tokens are read in one pass
    (:func:`~mla_compile.serving.engine_rows.take_rows`) when no request finished since."""

    requests: list[Request]
    yields: list[tuple[int, Request]]
    tokens: Tensor
    ready: Any
    logits: Tensor | None
    registered: list[Any]
    view: DecodeView | None = None
    last: list[int] | None = None
    finishes: int = 0


class HostTokens:
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
