"""CUDA-graph capture of whole decode steps, one graph per capture size, sharing one memory pool.

The step function (usually ``torch.compile(model)`` with dynamic shapes, so one compiled graph serves
every size) reads its inputs from a :class:`~mla_compile.serving.builder.MetadataBuilder`'s persistent
buffers. Capture runs a padding step of each size (largest first, as peers do, so smaller graphs
reuse the pool). At run time the builder fills the buffers for the real batch, padded to the smallest
captured size that fits, and the graph is replayed. Larger batches, prefill and mixed steps run the
step function directly. Without CUDA (or with ``enabled=False``) the same padded steps run directly,
which is how the logic is tested on CPU.

With a :class:`TokenFeed` (:meth:`DecodeGraphRunner.enable_token_feed`, what ``Engine(overlap=True)`` turns on)
every step first gathers the input ids of its decode rows from the previous step's sampled tokens on the
device (inside the captured graph for replayed steps), so the next step can be launched before the host has
seen those tokens.
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.decode_rows import DecodeRows
from mla_compile.serving.dp_sync import StepShape
from mla_compile.models.metadata import MLAMetadata, SeqChunk, StepInputs, mark_dynamic
from mla_compile.serving.host_upload import HostUpload
from mla_compile.serving.sampling import SamplingParams, SamplingRows, sample, sample_columns, sample_rows

StepFn = Callable[[Tensor, Tensor, MLAMetadata], Tensor]


class TokenFeed:
    """Sampled tokens fed back as the next step's inputs on the device, with no host round trip.

    ``tokens`` (int64 ``[2 * max_batch]``): the last step's sampled token of each logits row (decode rows, then
    prefill rows). ``index`` (int64 ``[max_batch]``): for decode row ``i`` of the next step, the row of
    ``tokens`` that is its input id, or -1 to keep the id the builder wrote from the host. Both are persistent
    (fixed addresses for captured graphs); ``index`` is filled per step by one non-blocking copy from pinned
    host memory (two host buffers used in turn, each reused only after its copy finished). Decode rows have
    one token each (the builder's ``query_len`` must be 1)."""

    def __init__(self, max_batch: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.tokens = torch.zeros(2 * max_batch, dtype=torch.int64, device=self.device)
        self.index = torch.full((max_batch,), -1, dtype=torch.int64, device=self.device)
        self._upload = HostUpload(self.index, fill=-1)

    def fill(self, rows: Sequence[int] | np.ndarray) -> None:
        """Set ``index``: decode row ``i < len(rows)`` reads ``tokens[rows[i]]`` (-1: the host id), every
        later row keeps its host id."""
        if len(rows) > self.max_batch:
            raise ValueError(f"TokenFeed.fill: {len(rows)} decode rows, the feed holds max_batch={self.max_batch}")
        if isinstance(rows, np.ndarray):
            bad = len(rows) and (rows.min() < -1 or rows.max() >= self.tokens.numel())
        else:
            bad = any(not -1 <= r < self.tokens.numel() for r in rows)
        if bad:
            raise ValueError(f"TokenFeed.fill: rows {list(rows)} must be -1 or in [0, {self.tokens.numel()})")
        host = self._upload.begin()
        host[len(rows):] = -1
        host[:len(rows)] = rows
        self._upload.upload()

    def apply(self, input_ids: Tensor, n: int) -> None:
        """Overwrite the first ``n`` input ids (the decode rows) where ``index`` names a row of ``tokens``
        (tensor ops only: capturable)."""
        if n == 0:
            return
        index = self.index[:n]
        fed = self.tokens.index_select(0, index.clamp(min=0))
        input_ids[:n].copy_(torch.where(index >= 0, fed, input_ids[:n]))

    def store(self, tokens: Tensor) -> Tensor:
        """Keep a step's sampled ``tokens`` (int64 ``[n]``) for the next step; returns their persistent view."""
        kept = self.tokens[:tokens.shape[0]]
        kept.copy_(tokens)
        return kept


def default_capture_sizes(max_batch: int, min_batch: int = 2) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to ``max_batch`` (sizes below ``min_batch`` raised to it)."""
    if max_batch < min_batch:
        raise ValueError(f"max_batch must be >= min_batch={min_batch}, got {max_batch}")
    sizes = {max(s, min_batch) for s in (1, 2, 4, 8) if s <= max_batch}
    sizes.update(range(16, max_batch + 1, 8))
    sizes.add(max_batch)
    return sorted(sizes)


class DecodeGraphRunner:
    """Replays captured decode steps of ``step_fn``; falls back to calling it for anything else.

    :meth:`decode`, :meth:`decode_sampled`, :meth:`sample_step` and :meth:`run` take the decode part as
    :class:`~mla_compile.serving.decode_rows.DecodeRows` as well as chunks (``takes_decode_rows``): what an
    ``Engine`` hands over for its decode-only steps. :attr:`model_calls` counts the model runs it started (a host
    int: no sync)."""

    takes_decode_rows = True

    def __init__(self, step_fn: StepFn, builder: MetadataBuilder, capture_sizes: Sequence[int] | None = None, *,
                 enabled: bool | None = None, warmup: int = 2, strict_sync: bool = False,
                 sampling: bool = False) -> None:
        """``sampling``: each captured graph also samples one token per row (:func:`mla_compile.serving.sampling.sample`
        over persistent :class:`~mla_compile.serving.sampling.SamplingRows`), so :meth:`decode_sampled` replays the
        step and the draw as one graph: the logits never leave the device before the tokens exist."""
        self.step_fn = step_fn
        self.builder = builder
        sizes = sorted(set(capture_sizes or default_capture_sizes(builder.max_batch, builder.min_batch)))
        bad = [s for s in sizes if not builder.min_batch <= s <= builder.max_batch]
        if bad:
            raise ValueError(f"capture_sizes {bad} are outside [min_batch={builder.min_batch}, "
                             f"max_batch={builder.max_batch}] of the builder")
        self.capture_sizes = sizes
        self.enabled = builder.device.type == "cuda" if enabled is None else enabled
        if self.enabled and builder.device.type != "cuda":
            raise ValueError(f"CUDA-graph capture needs a CUDA builder, got device {builder.device}")
        self.warmup = warmup
        self.strict_sync = strict_sync  # fill + replay under torch.cuda.set_sync_debug_mode("error")
        # backend selection of a captured model: only decode paths that replay correctly. Set also when
        # capture is off, so the same padded steps run directly pick (and compile) exactly the same code.
        model = getattr(step_fn, "_orig_mod", step_fn)  # torch.compile's wrapper keeps the module there
        if callable(getattr(model, "set_cuda_graph", None)):
            model.set_cuda_graph(True)
        self.sampling_rows = SamplingRows(builder.max_batch, builder.device) if sampling else None
        self.token_feed: TokenFeed | None = None  # see enable_token_feed
        self._rows_after: SamplingRows | None = None  # sample_step's parameters when it samples after the step
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor | None]] = {}
        self.pool = None
        self.replays = 0
        self.fallbacks = 0
        # how often this runner started its model (a step_fn call or a graph replay; capture's runs too): a host
        # counter an Engine under dp_sync reads to tell a step that failed before its model ran any collective
        self.model_calls = 0

    def enable_token_feed(self) -> TokenFeed:
        """Give every later step a :class:`TokenFeed` (idempotent; returns it): the decode rows' input ids are
        gathered on the device from the previous step's tokens where :meth:`sample_step` is told to. Graphs
        captured before are dropped and captured again, with the feed, on the next decode step."""
        if self.token_feed is None:
            if self.builder.query_len != 1:
                raise ValueError(f"the token feed needs one token per decode row; the builder has "
                                 f"query_len={self.builder.query_len}")
            self.token_feed = TokenFeed(self.builder.max_batch, self.builder.device)
            self._rows_after = SamplingRows(2 * self.builder.max_batch, self.builder.device)
            self.graphs, self.pool = {}, None
        return self.token_feed

    def _call(self, step: StepInputs, fed_rows: int = 0) -> Tensor:
        """The step's logits; with a token feed, its first ``fed_rows`` input ids are fed first."""
        own = getattr(step.meta, "mark_dynamic", None)  # metadata that marks itself (DeepSeek-V4's V4Metadata)
        if own is not None:
            own(step.input_ids, step.positions)
        else:
            mark_dynamic(step.input_ids, step.positions, step.meta)
        with torch.no_grad():
            self.model_calls += 1
            if self.token_feed is not None:
                self.token_feed.apply(step.input_ids, fed_rows)
            return self.step_fn(step.input_ids, step.positions, step.meta)

    def _call_sampled(self, step: StepInputs, size: int) -> tuple[Tensor, Tensor | None]:
        """The padded decode step of ``size`` rows: its logits and, with sampling on, the tokens drawn from its
        rows under the parameters in :attr:`sampling_rows` (kept in the token feed when there is one). Tensor
        ops only: capturable."""
        logits = self._call(step, size)
        if self.sampling_rows is None:
            return logits, None
        with torch.no_grad():
            tokens = sample(logits[:size], **self.sampling_rows.views(size))
            if self.token_feed is not None:
                tokens = self.token_feed.store(tokens)
            return logits, tokens

    def capture(self) -> None:
        """Capture one graph per capture size (largest first) into one shared memory pool.

        The model's caches must be allocated before, and never replaced after: graphs hold their addresses.
        Called on the first decode step if not called before; the token feed's tokens (an earlier step's draws that
        this step feeds on) are kept across the warm-up runs.
        """
        if not self.enabled:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("DecodeGraphRunner.capture() cannot run inside another CUDA-graph capture")
        self.pool = torch.cuda.graph_pool_handle()
        # the warm-up runs below sample into the token feed: keep the tokens an earlier step left there for the
        # step that triggered this capture (the engine captures lazily, with that step's feed pending)
        kept = None if self.token_feed is None else self.token_feed.tokens.clone()
        for size in reversed(self.capture_sizes):
            step = self.builder.padding_decode(size)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            if self.sampling_rows is not None:
                self.sampling_rows.fill((), (), size)
            if self.token_feed is not None:
                self.token_feed.fill(())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self._call_sampled(step, size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out, tokens = self._call_sampled(step, size)
            self.graphs[size] = (graph, out, tokens)
        if kept is not None:
            self.token_feed.tokens.copy_(kept)
        torch.cuda.synchronize()

    def graph_size(self, batch: int) -> int | None:
        """The smallest capture size that holds ``batch`` decode sequences (None: run uncaptured)."""
        i = bisect.bisect_left(self.capture_sizes, max(batch, self.builder.min_batch))
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def decode(self, chunks: Sequence[SeqChunk] | DecodeRows, shape: StepShape | None = None) -> Tensor:
        """Logits ``[len(chunks), vocab]`` of one decode step (``chunks``: decode chunks, or a
        :class:`~mla_compile.serving.decode_rows.DecodeRows` batch, built from its arrays). A replayed graph's output is a view that
        the next replay overwrites: consume (or clone) it before the next step. ``shape`` (a decode-only
        :class:`~mla_compile.serving.dp_sync.StepShape`): pad to the size every data-parallel attention group
        runs (``chunks`` may then be empty: a padding-only step)."""
        return self._decode(chunks, None, None, shape=shape)[0]

    def decode_sampled(self, chunks: Sequence[SeqChunk] | DecodeRows, params: Sequence[SamplingParams] | None,
                       steps: Sequence[int] | None, shape: StepShape | None = None) -> tuple[Tensor, Tensor]:
        """One decode step and its tokens: logits ``[n, vocab]`` and int64 ``[n]`` tokens on the device, row
        ``i`` drawn under ``params[i]`` at generation step ``steps[i]`` (every seed set). Replayed as one graph
        with the step when the runner was made with ``sampling=True``; otherwise sampled after the step.
        Both outputs are views the next replay overwrites. ``shape``: as for :meth:`decode`. ``chunks`` a
        :class:`~mla_compile.serving.decode_rows.DecodeRows` batch: ``params`` and ``steps`` None, each row
        samples under the batch's own columns (:meth:`DecodeRows.sampling`)."""
        if isinstance(chunks, DecodeRows):
            if params is not None or steps is not None:
                raise ValueError("decode_sampled: a DecodeRows batch samples under its own columns; pass "
                                 "params=None and steps=None")
        elif params is None or steps is None or len(params) != len(chunks) or len(steps) != len(chunks):
            raise ValueError(f"decode_sampled: {len(chunks)} chunks need as many params and steps, got "
                             f"{None if params is None else len(params)} and {None if steps is None else len(steps)}")
        logits, tokens = self._decode(chunks, params, steps, shape=shape, sampled=True)
        if tokens is None:
            tokens = sample_columns(logits, chunks.sampling()) if isinstance(chunks, DecodeRows) else \
                sample_rows(logits, params, steps)
        return logits, tokens

    def _decode(self, chunks: Sequence[SeqChunk] | DecodeRows, params: Sequence[SamplingParams] | None,
                steps: Sequence[int] | None, feed: Sequence[int] | np.ndarray = (),
                shape: StepShape | None = None, sampled: bool = False) -> tuple[Tensor, Tensor | None]:
        if self.enabled and not self.graphs:  # capture lazily, on the first decode step
            self.capture()
        if shape is not None and not shape.decode_only:
            raise ValueError("a decode step takes a decode-only StepShape")
        n = len(chunks) if shape is None else max(len(chunks), shape.decode_rows)  # [dp] every group's rows
        size = self.graph_size(n)
        rows = self.sampling_rows if sampled else None
        if size is None:
            self.fallbacks += 1
            step = self.builder.build(chunks, decode_batch=None if shape is None else max(n, self.builder.min_batch))
            self._fill_feed(feed)
            return self._call(step, len(chunks))[:step.num_rows], None
        if not self.enabled:  # no CUDA: the same padded step, run directly
            step = self.builder.build(chunks, decode_batch=size)
            self._fill_feed(feed)
            if rows is None:
                return self._call(step, size)[:step.num_rows], None
            self._fill_rows(rows, chunks, params, steps, size)
            logits, tokens = self._call_sampled(step, size)
            return logits[:step.num_rows], tokens[:step.num_rows]
        graph, out, tokens = self.graphs[size]
        previous = torch.cuda.get_sync_debug_mode()
        if self.strict_sync:
            torch.cuda.set_sync_debug_mode("error")
        try:
            step = self.builder.build(chunks, decode_batch=size)
            if rows is not None:
                self._fill_rows(rows, chunks, params, steps, size)
            self._fill_feed(feed)
            self.model_calls += 1
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        self.replays += 1
        return out[:step.num_rows], None if rows is None else tokens[:step.num_rows]

    @staticmethod
    def _fill_rows(rows: SamplingRows, chunks: Sequence[SeqChunk] | DecodeRows,
                   params: Sequence[SamplingParams] | None, steps: Sequence[int] | None, n: int) -> dict[str, Tensor]:
        """Fill ``rows`` for ``n`` rows: from a DecodeRows batch's columns, else from ``params`` / ``steps``."""
        if isinstance(chunks, DecodeRows) and params is None:
            return rows.fill_packed(chunks.sampling_packed(), n)
        return rows.fill(params, steps, n)

    def run(self, decode: Sequence[SeqChunk], prefill: Sequence[SeqChunk] = (),
            shape: StepShape | None = None) -> Tensor:
        """Any step: pure decode goes through :meth:`decode`; prefill and mixed steps run uncaptured. ``shape``
        (:class:`~mla_compile.serving.dp_sync.StepShape`, what data-parallel attention groups agreed on): a
        decode-only one goes through :meth:`decode`, padded to its rows; any other pads the step to its tokens
        and rows (the chunks may be empty: a padding-only step)."""
        if shape is not None and shape.decode_only:
            if prefill:
                raise ValueError("a decode-only StepShape was given with prefill chunks")
            return self.decode(decode, shape)
        if decode and not prefill and shape is None:
            return self.decode(decode)
        step = self.builder.build(decode, prefill, **_padding(shape))
        self._fill_feed(())
        return self._call(step, len(decode))[:step.num_rows]

    def _fill_feed(self, feed: Sequence[int]) -> None:
        """With a token feed, set the rows this step feeds (none: every input id from the host)."""
        if self.token_feed is not None:
            self.token_feed.fill(feed)
        elif len(feed):
            raise ValueError("a step with fed rows needs the token feed: call enable_token_feed() first")

    def sample_step(self, decode: Sequence[SeqChunk] | DecodeRows, prefill: Sequence[SeqChunk],
                    params: Sequence[SamplingParams] | None, steps: Sequence[int] | None,
                    feed: Sequence[int] | np.ndarray, shape: StepShape | None = None) -> tuple[Tensor, Tensor]:
        """Any step, its tokens sampled on the device and kept in the token feed (:meth:`enable_token_feed`) for
        the next step: what ``Engine(overlap=True)`` drives.

        ``params[i]`` / ``steps[i]``: how logits row ``i`` (decode rows, then one row per prefill chunk) samples
        (every seed set). ``feed[i]`` (one per decode chunk): the row of the previous ``sample_step``'s tokens
        that is decode row ``i``'s input id (the id in its chunk is then only a placeholder), or -1 for the id in
        its chunk. Returns the logits ``[n, vocab]`` and the int64 ``[n]`` tokens, both on the device without a host sync: pure decode
        steps replay their graph (sampling inside it with ``sampling=True``); the tokens are a view the next
        step overwrites (copy them before, in stream order). ``shape``: as for :meth:`run`. ``decode`` a
        :class:`~mla_compile.serving.decode_rows.DecodeRows` batch (no prefill chunks): ``params`` and ``steps``
        None, each row samples under the batch's own columns; ``feed`` may be a numpy array."""
        n = len(decode) + len(prefill)
        batch = decode if isinstance(decode, DecodeRows) else None
        if batch is not None:
            if prefill or params is not None or steps is not None:
                raise ValueError("sample_step: a DecodeRows batch takes no prefill chunks and samples under its own "
                                 "columns (params=None, steps=None)")
            if len(feed) != n:
                raise ValueError(f"sample_step: {n} decode rows need as many feed rows, got {len(feed)}")
        elif params is None or steps is None:
            raise ValueError("sample_step: chunks need params and steps")
        elif len(params) != n or len(steps) != n or len(feed) != len(decode):
            raise ValueError(f"sample_step: {len(decode)} decode and {len(prefill)} prefill chunks need {n} params "
                             f"and steps and {len(decode)} feed rows, got {len(params)}, {len(steps)} and {len(feed)}")
        if self.token_feed is None:
            raise ValueError("sample_step needs the token feed: call enable_token_feed() first")
        if (shape.decode_only and not prefill) if shape is not None else (len(decode) and not prefill):
            logits, tokens = self._decode(decode, params, steps, feed, shape, sampled=True)
            if tokens is not None:
                return logits, tokens  # sampled (and kept) inside the step
        else:
            step = self.builder.build(decode, prefill, **_padding(shape))
            self._fill_feed(feed)
            logits = self._call(step, len(decode))[:step.num_rows]
        with torch.no_grad():  # parameters by a non-blocking copy from pinned memory, as inside the graphs
            tokens = sample(logits, **self._fill_rows(self._rows_after, decode, params, steps, n))
        return logits, self.token_feed.store(tokens)


def _padding(shape: StepShape | None) -> dict:
    """``MetadataBuilder.build`` keywords of a mixed ``shape`` (none without one)."""
    if shape is None:
        return {}
    if shape.decode_only:
        raise ValueError("a step with prefill chunks takes a mixed StepShape (tokens and rows), not a decode-only one")
    return dict(tokens=shape.tokens, rows=shape.rows)
