"""Capture-safe step metadata: one persistent device arena filled per step by one copy.

:class:`MetadataBuilder` owns one device byte buffer (the arena) sized once for ``max_batch``,
``max_blocks_per_seq`` and ``max_tokens``. Each step it plans on the host (:func:`plan_step`), packs
every field into one pinned host buffer, copies it into the front of the arena with a single
``non_blocking`` copy (no device allocation, no host sync; one H2D transfer instead of one per field)
and hands out *views* of the arena, each at a 16-byte aligned offset. The layout depends only on the
step's sizes (tokens, logits rows, decode rows, prefill rows), so steps of one size always get the same
addresses, which is what a captured CUDA graph needs: fill, then replay. Decode chunks that carry a
``key`` (:class:`~mla_compile.models.metadata.SeqChunk`) keep their block tables on the host between
steps (:class:`~mla_compile.serving.host_tables.HostBlockTables`), so a decode step writes only the ids
that changed instead of re-packing every table.
"""

from __future__ import annotations

import math
from itertools import chain
from operator import attrgetter
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from mla_compile.models.metadata import (DecodeMetadata, MLAMetadata, PrefillMetadata, SeqChunk, StepInputs,
                                         chunk_block_counts, fill_block_table, plan_step)
from mla_compile.serving.decode_rows import DecodeRows
from mla_compile.serving.host_tables import HostBlockTables

_ALIGN = 16  # bytes: Inductor assumes 16-byte aligned inputs (it copies misaligned ones)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class _Field(NamedTuple):
    """One field of the arena: its name, its dtype and its largest shape for a builder."""

    name: str
    dtype: np.dtype
    largest: Callable[["MetadataBuilder"], tuple[int, ...]]


_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)

# The arena layout, declared once. A step lays out the fields it has in this order, each at the next
# 16-byte aligned offset (a decode-only step has no cu_seqlens, a prefill-only step no block table or
# seq_lens), so a step's addresses depend only on its sizes. The builder's capacity is the layout of
# every field at its largest shape.
_FIELDS = (
    _Field("input_ids", _I64, lambda b: (b.max_tokens,)),
    _Field("positions", _I64, lambda b: (b.max_tokens,)),
    _Field("slot_mapping", _I64, lambda b: (b.max_tokens,)),
    _Field("logits_indices", _I64, lambda b: (b.max_tokens,)),
    _Field("block_table", _I32, lambda b: (b.max_batch, b.max_blocks)),
    _Field("seq_lens", _I32, lambda b: (b.max_batch,)),
    _Field("cu_seqlens_q", _I32, lambda b: (b.max_batch + 1,)),
    _Field("cu_seqlens_k", _I32, lambda b: (b.max_batch + 1,)),
)


class _Span(NamedTuple):
    """Where one field of a step lies in the arena: bytes ``[start, stop)``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def _layout(shapes: Mapping[str, tuple[int, ...]]) -> tuple[list[_Span], int]:
    """The spans of a step with the fields named in ``shapes`` (in ``_FIELDS`` order) and the end of the
    last one, aligned."""
    assert shapes.keys() <= {f.name for f in _FIELDS}, f"unknown arena fields: {sorted(shapes)}"
    spans, end = [], 0
    for f in _FIELDS:
        shape = shapes.get(f.name)
        if shape is None:
            continue
        nbytes = f.dtype.itemsize * math.prod(shape)
        spans.append(_Span(f.name, f.dtype, tuple(shape), end, end + nbytes))
        end += _aligned(nbytes)
    return spans, end


def step_fields(step: StepInputs) -> dict[str, Tensor]:
    """The tensors of ``step`` that the arena holds, by ``_FIELDS`` name (the fields the step has)."""
    m = step.meta
    fields = {"input_ids": step.input_ids, "positions": step.positions, "slot_mapping": m.slot_mapping,
              "logits_indices": m.logits_indices}
    if m.decode is not None:
        fields.update(block_table=m.decode.block_table, seq_lens=m.decode.seq_lens)
    if m.prefill is not None:
        fields.update(cu_seqlens_q=m.prefill.cu_seqlens_q, cu_seqlens_k=m.prefill.cu_seqlens_k)
    return fields


class MetadataBuilder:
    """Persistent metadata buffers for steps of at most ``max_batch`` sequences and ``max_tokens`` tokens."""

    def __init__(self, *, max_batch: int, max_blocks_per_seq: int, max_tokens: int, block_size: int,
                 device: torch.device | str, query_len: int = 1, min_batch: int = 2,
                 decode_planner: Callable[[Tensor, Tensor], Any] | None = None,
                 context_chunk_tokens: int = 65536,
                 prefill_planner: Callable[[Tensor, Tensor], Any] | None = None) -> None:
        """``context_chunk_tokens``: the most cached-context rows a prefill gathers at once (per slice;
        see :func:`plan_step`). ``decode_planner``: called with each decode step's host ``block_table``
        and ``seq_lens`` before the step (and for each padding step at capture); what it returns rides
        along as ``DecodeMetadata.plan`` (e.g. ``ops.adapters.flashinfer.FlashInferDecodePlanner``, which
        returns itself, so compiled graphs see one constant object). ``prefill_planner``: the same for the
        prefill part, called with its host ``cu_seqlens_q`` / ``cu_seqlens_k``; its result rides along as
        ``PrefillMetadata.plan`` (``ops.adapters.flashinfer.FlashInferPrefillPlanner``)."""
        for name, value in (("max_batch", max_batch), ("max_blocks_per_seq", max_blocks_per_seq),
                            ("max_tokens", max_tokens), ("block_size", block_size), ("query_len", query_len),
                            ("context_chunk_tokens", context_chunk_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_batch < min_batch:
            raise ValueError(f"max_batch must be >= min_batch={min_batch}, got {max_batch}")
        if max_tokens < max_batch * query_len:
            raise ValueError(f"max_tokens must hold a full decode batch ({max_batch} x {query_len}), got {max_tokens}")
        self.device = torch.device(device)
        self.max_batch, self.max_blocks, self.max_tokens = max_batch, max_blocks_per_seq, max_tokens
        self.block_size, self.query_len, self.min_batch = block_size, query_len, min_batch
        _, capacity = _layout({f.name: f.largest(self) for f in _FIELDS})
        self.arena = torch.zeros(capacity, dtype=torch.uint8, device=self.device)
        self._pin = self.device.type == "cuda"
        self.decode_planner = decode_planner
        self.prefill_planner = prefill_planner
        self.context_chunk_tokens = context_chunk_tokens
        # two persistent pinned staging buffers, used in turn; each is reused only after its last copy
        # finished (an event query; a wait only when the host runs two steps ahead of the GPU)
        self._staging = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(2)] \
            if self._pin else []
        self._copied: list = [None, None]
        # one event per staging buffer, recorded again after each copy from it (only once _host found its last
        # copy finished): no event made per step
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self._pin else []
        self._turn = 0
        self._fronts: dict[tuple[int, int], Tensor] = {}  # see _front
        self._arena_fronts: dict[int, Tensor] = {}  # the arena's first ``end`` bytes by ``end`` (see _send)
        self._layouts: dict[int, _DecodeLayout] = {}  # decode-only steps by padded batch: see _build_decode
        # per persistent host buffer (``_host``'s id): the sizes of the decode step written last into it, whose
        # constant parts (logits rows, padding rows) are still there; dropped when another step writes it
        self._written: dict[int, tuple[int, int, bool]] = {}
        # block tables of keyed decode sequences (SeqChunk.key), kept between steps: see _build_decode
        self.host_tables = HostBlockTables(max_batch, max_blocks_per_seq)

    def _host(self, end: int) -> tuple[Tensor, int]:
        """The host bytes to pack the next step into and their id: pinned staging buffer 0/1 in turn, -1 the
        CPU arena itself, -2 a fresh buffer (devices without pinned staging)."""
        turn = -1
        if self._pin:
            turn, self._turn = self._turn, self._turn ^ 1
            done = self._copied[turn]
            if done is not None and not done.query():
                done.synchronize()  # the host is two steps ahead: wait for that step's copy to finish
            return self._front(turn, end), turn
        if self.arena.device.type == "cpu":
            return self._front(turn, end), turn  # a CPU arena is written in place
        return torch.empty(end, dtype=torch.uint8), -2  # another device without pinned staging: a fresh buffer

    def _front(self, turn: int, end: int) -> Tensor:
        """The first ``end`` bytes of persistent host buffer ``turn`` (staging buffer 0/1, -1 the CPU arena),
        sliced once per size."""
        front = self._fronts.get((turn, end))
        if front is None:
            front = self._fronts[(turn, end)] = (self.arena if turn == -1 else self._staging[turn])[:end]
        return front

    def _send(self, host: Tensor, turn: int, end: int) -> None:
        """Copy the packed bytes to the front of the arena (one async H2D copy from pinned staging)."""
        if self._pin:
            front = self._arena_fronts.get(end)
            if front is None:
                front = self._arena_fronts[end] = self.arena[:end]
            front.copy_(host, non_blocking=True)
            event = self._events[turn]
            event.record()
            self._copied[turn] = event
        elif self.arena.device.type != "cpu":  # another device without pinned memory
            self.arena[:end].copy_(host)

    def _view(self, span: _Span) -> Tensor:
        """The arena view of one field of a step."""
        return self.arena[span.start:span.stop].view(_TORCH[span.dtype]).view(span.shape)

    def _stage(self, arrays: Mapping[str, np.ndarray]) -> dict[str, Tensor]:
        """Pack host ``arrays`` (by field name) into one pinned buffer at their ``_layout`` offsets, copy
        it to the front of the arena in one (async) copy, and return the arena views by field name."""
        spans, end = _layout({name: a.shape for name, a in arrays.items()})
        if end > self.arena.numel():  # unreachable when the size checks in build() hold
            raise ValueError(f"step metadata needs {end} bytes; the builder's arena holds {self.arena.numel()}")
        host, turn = self._host(end)
        self._written.pop(turn, None)
        flat = host.numpy()
        for sp in spans:
            a = arrays[sp.name]
            assert a.dtype == sp.dtype, f"{sp.name}: planned as {a.dtype}, the arena holds {sp.dtype}"
            flat[sp.start:sp.stop] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self._send(host, turn, end)
        return {sp.name: self._view(sp) for sp in spans}

    def _decode_shapes(self, n_seq: int) -> dict[str, tuple[int, ...]]:
        """The field shapes of a decode-only step of ``n_seq`` (padded) sequences, one logits row each."""
        n = n_seq * self.query_len
        return {"input_ids": (n,), "positions": (n,), "slot_mapping": (n,), "logits_indices": (n_seq,),
                "block_table": (n_seq, self.max_blocks), "seq_lens": (n_seq,)}

    def build(self, decode: Sequence[SeqChunk] | DecodeRows, prefill: Sequence[SeqChunk] = (), *,
              decode_batch: int | None = None, logits: str = "last", tokens: int | None = None,
              rows: int | None = None) -> StepInputs:
        """Plan a step on the host and fill the arena; returns views of it as :class:`StepInputs`.

        ``decode``: the decode chunks, or a :class:`~mla_compile.serving.decode_rows.DecodeRows` batch (one token
        per row): a decode-only step (``logits="last"``, no ``tokens`` / ``rows`` beyond its own) is then built
        from its arrays with whole-batch numpy, any other from its :meth:`~DecodeRows.chunks`; the same
        tensors either way.

        ``decode_batch`` pads the decode part to a capture size (with no decode chunk: a decode part of padding
        sequences only). ``tokens`` / ``rows`` pad the step to exactly that many tokens / logits rows (see
        :func:`plan_step`; what data-parallel attention groups agree on). Raises before writing anything when
        the step does not fit the buffers.

        Every build keeps :attr:`host_tables` following the step's decode chunks: when each has a
        ``key`` their rows are brought up to date (keys absent from the step leave), and a decode-only
        step gathers its block table from them; a step whose decode chunks lack keys, a step without
        decode chunks, a step built from a :class:`DecodeRows` batch and a build that raises empty them (the next
        keyed step rewrites its rows).

        The returned tensors are views the builder owns: callers read them and may overwrite a decode
        step's real rows (as a token feed does with ``input_ids``), but must leave its padding rows and
        ``logits_indices`` as built (a CPU builder's arena is its host buffer, whose constant parts later
        steps of the same size do not write again). A decode-only step built from a :class:`DecodeRows` batch
        without a ``decode_planner`` is the same :class:`StepInputs` object as every earlier one of the same sizes
        (its views then hold the new step): use it before building the next step, as the views themselves.
        """
        try:
            return self._build(decode, prefill, decode_batch, logits, tokens, rows)
        except BaseException:
            self.host_tables.clear()
            raise

    def _build(self, decode: Sequence[SeqChunk] | DecodeRows, prefill: Sequence[SeqChunk],
               decode_batch: int | None, logits: str, tokens: int | None, rows: int | None) -> StepInputs:
        if type(decode) is DecodeRows and tokens is None and rows is None and not prefill and logits == "last" \
                and self.query_len == 1 and decode.n:  # the engine's decode-only step: checked in few operations
            n_dec = max(decode.n, self.min_batch) if decode_batch is None else decode_batch
            if max(decode.n, self.min_batch) <= n_dec <= self.max_batch:
                fast = self._build_rows(decode, n_dec)
                if fast is not None:
                    return fast
        n_dec = decode_batch if decode_batch is not None else max(len(decode), self.min_batch) if len(decode) else 0
        if n_dec > self.max_batch or len(prefill) > self.max_batch:
            raise ValueError(f"step has {max(n_dec, len(prefill))} sequences in one part; the builder holds "
                             f"max_batch={self.max_batch}")
        decode_only = n_dec and not prefill and logits == "last" and n_dec >= max(len(decode), self.min_batch) \
            and tokens in (None, n_dec * self.query_len) and rows in (None, n_dec)
        if isinstance(decode, DecodeRows):
            if decode_only and self.query_len == 1:
                fast = self._build_rows(decode, n_dec)
                if fast is not None:
                    return fast
            decode = decode.chunks()
        elif decode_only:
            fast = self._build_decode(decode, n_dec)
            if fast is not None:
                return fast
        plan = plan_step(decode, prefill, self.block_size, max_blocks=self.max_blocks, query_len=self.query_len,
                         logits=logits, min_batch=self.min_batch, decode_batch=decode_batch if n_dec else None,
                         context_chunk_tokens=self.context_chunk_tokens, tokens=tokens, rows=rows)
        if plan.input_ids.shape[0] > self.max_tokens or plan.meta.logits_indices.shape[0] > self.max_tokens:
            raise ValueError(f"step has {plan.input_ids.shape[0]} tokens; "
                             f"the builder holds max_tokens={self.max_tokens}")
        self._update_tables(decode)
        meta = plan.meta
        planned = None if meta.decode is None or self.decode_planner is None else \
            self.decode_planner(meta.decode.block_table, meta.decode.seq_lens)
        planned_prefill = None if meta.prefill is None or self.prefill_planner is None else \
            self.prefill_planner(meta.prefill.cu_seqlens_q, meta.prefill.cu_seqlens_k)
        v = self._stage({name: t.numpy() for name, t in step_fields(plan).items()})
        dec = pre = None
        if meta.decode is not None:
            dec = DecodeMetadata(v["block_table"], v["seq_lens"], self.query_len, planned)
        if meta.prefill is not None:
            # prefill runs uncaptured: its context metadata (sized by the context) is moved, not staged
            moved = meta.prefill.to(self.device)
            pre = PrefillMetadata(v["cu_seqlens_q"], v["cu_seqlens_k"], moved.block_table, moved.context,
                                  planned_prefill)
        meta_v = MLAMetadata(v["slot_mapping"], dec, pre, v["logits_indices"])
        return StepInputs(v["input_ids"], v["positions"], meta_v, plan.num_rows)

    def _build_decode(self, decode: Sequence[SeqChunk], n_seq: int) -> StepInputs | None:
        """The decode-only step (the one served every token): the same arena bytes and views as the
        general path, written straight into the staging buffer with whole-batch numpy and the views of
        its padded size reused. When every chunk has a ``key``, the block table rows are gathered from
        :attr:`host_tables`, updated only where a sequence changed, instead of re-packed from the chunks'
        block lists. What a step of the same sizes wrote last into the same staging buffer and no other
        step overwrote since (the logits rows, the padding rows) is not written again. ``None`` when a
        check fails (the general path then raises its error)."""
        q, bs, n = self.query_len, self.block_size, len(decode)
        blocks = list(map(_BLOCKS, decode))
        starts = np.fromiter(map(_START, decode), np.int64, n)
        nblk = np.fromiter(map(len, blocks), np.int64, n)
        if q == 1:
            try:
                flat = [t for (t,) in map(_TOKENS, decode)]  # raises unless each chunk has exactly one token
            except (TypeError, ValueError):
                return None
        else:
            tokens = list(map(_TOKENS, decode))
            if (np.fromiter(map(len, tokens), np.int64, n) != q).any():
                return None
            flat = list(chain.from_iterable(tokens))
        if ((starts < 0) | (nblk > self.max_blocks) | (starts + q > nblk * bs)).any():
            return None
        rows_of = self._update_tables(decode, blocks, nblk) if n else None  # padding_decode: tables untouched
        layout = self._layouts.get(n_seq)
        if layout is None:
            layout = self._layouts[n_seq] = _DecodeLayout(self, n_seq)
        host, turn = self._host(layout.end)
        ids, pos, slots, rows, table, lens = layout.fields(host, turn)[:6]
        if rows_of is None:
            fill_block_table(table, blocks, nblk)  # zero past the chunks' rows too
        else:
            np.take(self.host_tables.table, rows_of, axis=0, out=table[:n], mode="clip")  # rows in range
        nq = n * q
        ids[:nq] = flat
        if q == 1:
            pos[:n] = starts
            blk, off = np.divmod(starts, bs)
            at = layout.at
        else:
            p = (starts[:, None] + layout.steps).reshape(-1)
            pos[:nq] = p
            blk, off = np.divmod(p, bs)
            at = layout.at_tokens
        np.multiply(table[at[:nq], blk], bs, out=slots[:nq], dtype=np.int64)
        slots[:nq] += off
        np.add(starts, q, out=lens[:n], casting="unsafe")  # int64 -> int32: starts + q <= nblk * bs, checked
        if self._written.get(turn) != (n_seq, n, rows_of is not None):
            # rows past the chunks: padding (token 0, position 0, slot -1, seq_len 0, an empty table row)
            ids[nq:], pos[nq:], slots[nq:], lens[n:] = 0, 0, -1, 0
            if rows_of is not None:
                table[n:] = 0
            rows[:] = layout.rows
            if turn != -2:  # a persistent buffer: these stay written until another step of other sizes
                self._written[turn] = (n_seq, n, rows_of is not None)
        planned = None if self.decode_planner is None else \
            self.decode_planner(torch.from_numpy(table), torch.from_numpy(lens))
        self._send(host, turn, layout.end)
        v = layout.views
        meta = MLAMetadata(v[2], DecodeMetadata(v[4], v[5], q, planned), None, v[3])
        return StepInputs(v[0], v[1], meta, n)

    def _build_rows(self, batch: DecodeRows, n_seq: int) -> StepInputs | None:
        """The decode-only step of a :class:`DecodeRows` batch (``query_len`` 1): the arena bytes and views of
        :meth:`_build_decode`, each field written from the batch's arrays by a few numpy calls into the layout's
        scratch (no array allocated), and with no decode planner the same :class:`StepInputs` object for every step
        of the same sizes. ``None`` when a row's blocks do not hold its position or the batch's table is wider than
        the builder's (the general path then raises its error)."""
        n, bs = batch.n, self.block_size
        if batch.max_blocks > self.max_blocks or batch.block_size != bs:
            return None
        starts = batch.positions[:n]
        if n and (starts >= batch.capacity[:n]).any():  # positions >= 0: DecodeRows checks them
            return None
        if len(self.host_tables):
            self.host_tables.clear()  # the keyed tables follow keyed chunk steps only
        layout = self._layouts.get(n_seq)
        if layout is None:
            layout = self._layouts[n_seq] = _DecodeLayout(self, n_seq)
        host, turn = self._host(layout.end)
        ids, pos, slots, rows, table, lens, flat_table = layout.fields(host, turn)
        w = batch.max_blocks
        table[:n, :w] = batch.table[:n]
        if w < self.max_blocks:
            table[:n, w:] = 0
        ids[:n] = batch.tokens[:n]
        pos[:n] = starts
        # slot = table[row, start // bs] * bs + start % bs = (table[row, blk] - blk) * bs + start, blk = start // bs
        blk, at, slot = layout.blk[:n], layout.flat_at[:n], slots[:n]
        np.floor_divide(starts, bs, out=blk)
        np.add(layout.row_base[:n], blk, out=at)  # the flat index of each row's block in the table
        slot[:] = flat_table.take(at)  # int32 ids -> the int64 slots
        slot -= blk
        slot *= bs
        slot += starts
        lens[:n] = starts  # int64 -> int32: starts < block_counts * bs, checked
        lens[:n] += 1
        if self._written.get(turn) != (n_seq, n, True):
            # rows past the batch: padding (token 0, position 0, slot -1, seq_len 0, an empty table row)
            ids[n:], pos[n:], slots[n:], lens[n:] = 0, 0, -1, 0
            table[n:] = 0
            rows[:] = layout.rows
            if turn != -2:  # a persistent buffer: these stay written until another step of other sizes
                self._written[turn] = (n_seq, n, True)
        if self.decode_planner is not None:
            planned = self.decode_planner(torch.from_numpy(table), torch.from_numpy(lens))
            self._send(host, turn, layout.end)
            return layout.step(n, planned)
        self._send(host, turn, layout.end)
        step = layout.steps_by_rows.get(n)
        if step is None:
            step = layout.steps_by_rows[n] = layout.step(n, None)
        return step

    def _update_tables(self, decode: Sequence[SeqChunk], blocks: list[Sequence[int]] | None = None,
                       counts: np.ndarray | None = None) -> np.ndarray | None:
        """Bring :attr:`host_tables` up to date with the step's decode chunks, checked (``blocks``,
        ``counts``: their block lists and lengths, if already at hand); returns each chunk's row, or None
        (some chunk has no key, or there is none) after emptying the tables."""
        rows = None
        if decode and decode[0].key is not None:
            blocks = [c.blocks for c in decode] if blocks is None else blocks
            counts = chunk_block_counts(decode) if counts is None else counts
            rows = self.host_tables.update(list(map(_KEY, decode)), blocks, counts)
        if rows is None and len(self.host_tables):
            self.host_tables.clear()
        return rows

    def padding_decode(self, batch: int) -> StepInputs:
        """A decode step of ``batch`` padding sequences (reads and writes nothing): for graph capture.
        Its views are those of every later real decode step of ``batch`` sequences (the decode path with
        no real sequence: token 0, position 0, slot -1, seq_len 0, an empty table row)."""
        if not self.min_batch <= batch <= self.max_batch:
            raise ValueError(f"batch must be in [{self.min_batch}, {self.max_batch}], got {batch}")
        step = self._build_decode((), batch)
        assert step is not None  # no sequence, so no check can fail
        return step


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
_KEY, _BLOCKS, _TOKENS, _START = attrgetter("key"), attrgetter("blocks"), attrgetter("tokens"), attrgetter("start")


class _DecodeLayout:
    """Spans and arena views of a decode-only step of ``n_seq`` (padded) sequences (``_layout`` of
    ``MetadataBuilder._decode_shapes``, the offsets ``_stage`` gives the same arrays), so the addresses
    are the ones a captured graph of that size reads. Fields in ``_FIELDS`` order: ids, positions,
    slots, logits rows, block table, seq_lens."""

    def __init__(self, builder: MetadataBuilder, n_seq: int) -> None:
        n, q = n_seq * builder.query_len, builder.query_len
        self.spans, self.end = _layout(builder._decode_shapes(n_seq))
        self.rows = np.arange(q - 1, n, q, dtype=np.int64)
        self.at = np.arange(n_seq)  # each token's table row: one token per sequence ...
        self.at_tokens = np.repeat(self.at, q)  # ... or q
        self.steps = np.arange(q)
        self.views = [builder._view(sp) for sp in self.spans]
        self._fields: dict[int, list[np.ndarray]] = {}
        # MetadataBuilder._build_rows: host scratch (each row's block index, its flat index in the table), the
        # flat index of each table row's first entry, and the step of each real row count (no decode planner)
        self.blk, self.flat_at = np.zeros(n_seq, dtype=np.int64), np.zeros(n_seq, dtype=np.int64)
        self.row_base = np.arange(n_seq, dtype=np.int64) * builder.max_blocks
        self.steps_by_rows: dict[int, StepInputs] = {}

    def fields(self, host: Tensor, turn: int) -> list[np.ndarray]:
        """Numpy views, one per field, of the packed host bytes ``host`` (buffer id ``turn``, see
        ``MetadataBuilder._host``), made once per persistent buffer; then the block table flattened."""
        fields = self._fields.get(turn)
        if fields is None:
            flat = host.numpy()
            fields = [flat[sp.start:sp.stop].view(sp.dtype).reshape(sp.shape) for sp in self.spans]
            fields.append(fields[4].reshape(-1))
            if turn != -2:  # a persistent buffer
                self._fields[turn] = fields
        return fields

    def step(self, n: int, planned: Any) -> StepInputs:
        """The step's arena views as a decode-only :class:`StepInputs` of ``n`` real rows."""
        v = self.views
        return StepInputs(v[0], v[1], MLAMetadata(v[2], DecodeMetadata(v[4], v[5], 1, planned), None, v[3]), n)
