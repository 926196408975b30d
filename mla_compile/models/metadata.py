"""Step metadata: tensors that tell every layer where this step's tokens live in the paged cache.

A step's tokens are laid out decode first, then prefill: ``[B * s_q decode tokens | prefill tokens]``.
The split point is ``decode.block_table.shape[0] * decode.query_len``, a shape, so one compiled graph
serves every batch size. Metadata is passed explicitly to the model as an argument (never through
globals); every field that changes per step is a tensor, and the only Python values are static
(``query_len``). Host-side planning (:func:`plan_step`) happens before the step, outside compiled code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain
from operator import attrgetter
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch
from torch import Tensor


def _mapped(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor | None], Tensor | None]:
    return lambda t: None if t is None else fn(t)


def _moved(device: torch.device | str) -> Callable[[Tensor], Tensor]:
    return lambda t: t.to(device, non_blocking=True)


SCHEDULE_SLOTS = 2  # tensors a decode step schedule may hold in the flat form (FlashMLA's: tiles, splits)


@dataclass
class DecodeMetadata:
    """Decode part: ``block_table [B, max_blocks]`` int32, ``seq_lens [B]`` int32 (context incl. new tokens).

    ``query_len`` (static) is the number of new tokens per sequence (s_q; > 1 for MTP/speculative).
    """

    block_table: Tensor
    seq_lens: Tensor
    query_len: int = 1
    plan: Any = None  # a host-side planner object (FlashInfer), the same object every step: static, not a tensor
    # the decode backend's step schedule (FlashMLA's split schedule: ops.decode_step_schedule), made from seq_lens
    # inside the step before its layers (the model's forward), shared by every layer's call; None: each call
    # schedules itself
    schedule: tuple[Tensor, ...] | None = None

    @property
    def num_tokens(self):
        """Decode tokens in this step (a shape, symbolic under dynamic shapes)."""
        return self.block_table.shape[0] * self.query_len


@dataclass
class ContextSlices:
    """The cached context of the prefill sequences in ``C`` bounded slices (stacked, so the slice count
    is a tensor dimension and never a Python value a compiled graph guards on): in slice c, workspace rows
    ``cu_seqlens[c, i]:cu_seqlens[c, i+1]`` hold positions ``starts[c, i], ...`` of prefill sequence i
    (``cu_seqlens [C, N+1]``, ``starts [C, N]`` int32, on the step's device); ``rows [C]`` (int64,
    always on the host) is each slice's workspace size, at most the planner's ``context_chunk_tokens``."""

    cu_seqlens: Tensor
    starts: Tensor
    rows: Tensor

    @property
    def num_slices(self) -> int:
        """How many slices (a shape, symbolic under dynamic shapes)."""
        return self.cu_seqlens.shape[0]

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> "ContextSlices":
        """A copy with ``fn`` applied to the index tensors (``rows``, host sizes, kept as is)."""
        return ContextSlices(fn(self.cu_seqlens), fn(self.starts), self.rows)

    def to(self, device: torch.device | str) -> "ContextSlices":
        """A copy with the index tensors on ``device`` (``rows`` stays on the host)."""
        return self.map_tensors(_moved(device))


@dataclass
class PrefillMetadata:
    """Prefill part: ``cu_seqlens_q [N+1]`` int32 over the new prefill tokens, which attend causally to
    each other (``cu_seqlens_k`` = ``cu_seqlens_q``). Sequences with cached context (a prefix-cache hit
    or an earlier chunk of a chunked prefill) also attend to it: ``block_table [N, max_blocks]`` finds
    it, and ``context`` (None when no sequence has any) covers it in bounded slices, each gathered,
    up-projected, attended and merged by LSE (``mla_compile.ops.context_attention``). :func:`plan_step`
    always sets ``block_table`` (sparse V3.2 layers read the whole sequence's index keys and latents
    through it).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    block_table: Tensor | None = None
    context: ContextSlices | None = None
    plan: Any = None  # a host-side planner of the causal call (FlashInfer), the same object every step

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> "PrefillMetadata":
        """A copy with ``fn`` applied to every tensor (``context.rows`` kept as is)."""
        mv = _mapped(fn)
        ctx = None if self.context is None else self.context.map_tensors(fn)
        return PrefillMetadata(mv(self.cu_seqlens_q), mv(self.cu_seqlens_k), mv(self.block_table), ctx, self.plan)

    def to(self, device: torch.device | str) -> "PrefillMetadata":
        """A copy on ``device`` (``context.rows`` stays on the host)."""
        return self.map_tensors(_moved(device))


@dataclass
class MLAMetadata:
    """Everything a step needs: ``slot_mapping [T]`` (int64, -1 = padding, nothing written) for the
    cache write, the decode and/or prefill parts, and ``logits_indices [R]`` (rows whose logits the
    model returns; None = every token)."""

    slot_mapping: Tensor
    decode: DecodeMetadata | None = None
    prefill: PrefillMetadata | None = None
    logits_indices: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        """Every tensor in the metadata (for moving, marking dynamic, or copying into static buffers)."""
        out = []
        parts = [self, self.decode, self.prefill, self.prefill and self.prefill.context]
        for part in parts:
            if part is None:
                continue
            out.extend(v for f in fields(part) if isinstance(v := getattr(part, f.name), Tensor))
        return out

    def flat(self) -> tuple:
        """The metadata as a flat tuple of tensors, None and plain values (:meth:`from_flat` rebuilds it): what a
        nested compile region takes, so Dynamo can reuse one traced region for every layer."""
        d, p = self.decode, self.prefill
        c = p.context if p is not None else None
        if d is not None and d.schedule is not None and len(d.schedule) > SCHEDULE_SLOTS:
            raise ValueError(f"MLAMetadata.flat: decode.schedule holds {len(d.schedule)} tensors, the flat form "
                             f"has {SCHEDULE_SLOTS} slots")
        sched = tuple(d.schedule or ()) if d is not None else ()
        sched += (None,) * (SCHEDULE_SLOTS - len(sched))
        return (self.slot_mapping, self.logits_indices,
                d is not None, *(d and (d.block_table, d.seq_lens, d.query_len, d.plan) or (None,) * 4), *sched,
                p is not None, *(p and (p.cu_seqlens_q, p.cu_seqlens_k, p.block_table, p.plan) or (None,) * 4),
                c is not None, *(c and (c.cu_seqlens, c.starts, c.rows) or (None,) * 3))

    @staticmethod
    def from_flat(slot_mapping, logits_indices, has_decode, block_table, seq_lens, query_len, decode_plan, *rest
                  ) -> "MLAMetadata":
        """The metadata :meth:`flat` gave."""
        sched, rest = tuple(t for t in rest[:SCHEDULE_SLOTS] if t is not None), rest[SCHEDULE_SLOTS:]
        (has_prefill, cu_seqlens_q, cu_seqlens_k, prefill_table, prefill_plan, has_context, cu_seqlens, starts,
         rows) = rest
        ctx = ContextSlices(cu_seqlens, starts, rows) if has_context else None
        dec = DecodeMetadata(block_table, seq_lens, query_len, decode_plan, sched or None) if has_decode else None
        pre = PrefillMetadata(cu_seqlens_q, cu_seqlens_k, prefill_table, ctx, prefill_plan) if has_prefill else None
        return MLAMetadata(slot_mapping, dec, pre, logits_indices)

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> "MLAMetadata":
        """A copy with ``fn`` applied to every tensor but ``prefill.context.rows`` (host sizes, kept as is)."""
        mv = _mapped(fn)
        d = self.decode
        dec = d and DecodeMetadata(mv(d.block_table), mv(d.seq_lens), d.query_len, d.plan,
                                   d.schedule and tuple(mv(t) for t in d.schedule))
        pre = self.prefill and self.prefill.map_tensors(fn)
        return MLAMetadata(mv(self.slot_mapping), dec, pre, mv(self.logits_indices))

    def to(self, device: torch.device | str) -> "MLAMetadata":
        """A copy on ``device`` (host-side planning builds on CPU, then moves once)."""
        return self.map_tensors(_moved(device))


def query_parts(meta: MLAMetadata, positions: Tensor, live: Tensor | None = None
                ) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Where each query token of a step lives, part by part (decode, then prefill, the parts present):
    ``(block_table [B, max_blocks], seq_lens [B] int32, query_seq [n] int64, query_pos [n])`` with ``n`` the
    part's tokens, ``query_seq`` -1 for padding tokens and ``seq_lens`` each sequence's length after
    the step. ``live [T]`` (bool) marks the real tokens (default: slot >= 0; a cache split by token, where
    another rank's tokens have slot -1 here, passes its own). Tensor ops only (no host sync), so per-token
    layers (the V3.2 indexer, sink + window attention) derive it inside compiled code. Prefill needs
    ``meta.prefill.block_table`` (:func:`plan_step` sets it)."""
    live = meta.slot_mapping >= 0 if live is None else live  # padding tokens select nothing
    device = positions.device
    parts, n_dec = [], 0
    if meta.decode is not None:
        dm = meta.decode
        n_dec = dm.num_tokens
        seq = torch.arange(n_dec, device=device) // dm.query_len
        parts.append((dm.block_table, dm.seq_lens, torch.where(live[:n_dec], seq, -1), positions[:n_dec]))
    if meta.prefill is not None:
        pm = meta.prefill
        if pm.block_table is None:
            raise ValueError("per-token prefill (V3.2 indexer, sink + window attention) needs meta.prefill.block_table "
                             "(it reads the sequence's cache through it): plan the step with "
                             "mla_compile.models.metadata.plan_step")
        n_pre = positions.shape[0] - n_dec
        pos = positions[n_dec:]
        cu = pm.cu_seqlens_q.long()
        # a contiguous int64 copy: Inductor (2.11) cannot lower searchsorted over a slice view
        seq = torch.searchsorted(pm.cu_seqlens_q[1:].long().contiguous(), torch.arange(n_pre, device=device),
                                 right=True)
        seq = torch.where(live[n_dec:] & (seq < cu.shape[0] - 1), seq, -1)
        # each prefill sequence holds (last new position + 1) tokens after the step; empty rows 0
        last = pos[(cu[1:] - 1).clamp(min=0, max=n_pre - 1)]
        seq_lens = torch.where(cu[1:] > cu[:-1], last + 1, 0).to(torch.int32)
        parts.append((pm.block_table, seq_lens, seq, pos))
    return parts


def mark_dynamic(input_ids: Tensor, positions: Tensor, meta: MLAMetadata) -> None:
    """Mark every per-step size dynamic so one compiled graph serves all batch sizes and lengths."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (input_ids, positions, meta.slot_mapping):
        mark(t, 0)
    if meta.decode is not None:
        mark(meta.decode.block_table, 0)
        mark(meta.decode.block_table, 1)
        mark(meta.decode.seq_lens, 0)
    if meta.prefill is not None:
        mark(meta.prefill.cu_seqlens_q, 0)
        mark(meta.prefill.cu_seqlens_k, 0)
        if meta.prefill.block_table is not None:
            mark(meta.prefill.block_table, 0)
            mark(meta.prefill.block_table, 1)
        ctx = meta.prefill.context
        if ctx is not None:
            for t in (ctx.cu_seqlens, ctx.starts):
                mark(t, 0)
                mark(t, 1)
            mark(ctx.rows, 0)
    if meta.logits_indices is not None:
        mark(meta.logits_indices, 0)


@dataclass
class SeqChunk:
    """One sequence's part of a step: its cache ``blocks``, its new ``tokens`` and the position of the
    first new token (``start``; the sequence holds ``start + len(tokens)`` tokens after the step).

    ``key`` (optional, hashable): a stable name of the sequence across steps, e.g. its request id. When
    every decode chunk of a decode-only step has one, :class:`~mla_compile.serving.builder.MetadataBuilder`
    keeps the block tables on the host between steps and writes only what changed (see
    :class:`~mla_compile.serving.host_tables.HostBlockTables` for what a key's ``blocks`` may do between
    steps: stay the same list, be appended to or truncated in place, or be another list). Plans never
    depend on it: a keyed step builds the same tensors as an unkeyed one."""

    blocks: Sequence[int]
    tokens: Sequence[int]
    start: int = 0
    key: Hashable | None = None


@dataclass
class StepInputs:
    """What one model step takes: ``input_ids [T]``, ``positions [T]``, ``meta``; the first ``num_rows``
    rows of the returned logits are real (the rest are padding)."""

    input_ids: Tensor
    positions: Tensor
    meta: MLAMetadata
    num_rows: int

    def to(self, device: torch.device | str) -> "StepInputs":
        """A copy on ``device``."""
        return StepInputs(self.input_ids.to(device), self.positions.to(device), self.meta.to(device), self.num_rows)


def step_size(n_decode: int, prefill_tokens: int, n_prefill: int, *, query_len: int = 1, min_batch: int = 2,
              decode_batch: int | None = None) -> tuple[int, int]:
    """``(tokens, logits rows)`` of the step :func:`plan_step` plans (``logits="last"``, no ``tokens`` / ``rows``)
    for ``n_decode`` decode chunks and ``n_prefill`` prefill chunks of ``prefill_tokens`` new tokens in all:
    the padded decode part (``decode_batch``, else ``max(n_decode, min_batch)`` when there is one), one row per
    decode sequence and per prefill chunk, each total raised to ``min_batch``."""
    n_seq = decode_batch if decode_batch is not None else max(n_decode, min_batch) if n_decode else 0
    return max(n_seq * query_len + prefill_tokens, min_batch), max(n_seq + n_prefill, min_batch)


def plan_step(decode: Sequence[SeqChunk], prefill: Sequence[SeqChunk], block_size: int, *,
              max_blocks: int | None = None, num_blocks: int | None = None, query_len: int = 1,
              logits: str = "last", min_batch: int = 2, decode_batch: int | None = None,
              context_chunk_tokens: int = 65536, tokens: int | None = None, rows: int | None = None) -> StepInputs:
    """Host-side planning of one step (CPU tensors; move once with ``.to(device)``).

    Decode chunks carry ``query_len`` new tokens each. Prefill chunks carry new prompt tokens from
    ``start``: positions before ``start`` are cached context (a prefix-cache hit, or earlier chunks of
    a chunked prefill), attended in slices of at most ``context_chunk_tokens`` rows.
    ``logits``: "last" (one row per sequence) or "all" (one row per new token). Each non-empty part,
    the token count and the logits rows are padded up to ``min_batch`` with rows that read and write
    nothing (seq_len 0, slot -1), so sizes 0/1 never specialise a compiled graph; ``decode_batch``
    pads the decode part to exactly that many sequences (a CUDA-graph capture size; with no decode chunk, a
    decode part of padding sequences only). ``tokens`` / ``rows`` pad the whole step to exactly that many
    tokens / logits rows (at least what :func:`step_size` gives without them; data-parallel attention groups
    pad their steps to one shape): the extra tokens are padding tokens at the end (token 0, position 0,
    slot -1) in the prefill part, which is then made empty (no sequence) when the step has no prefill chunk;
    the extra rows repeat the last row. Validates block ids and capacities here, on host data, so the ops
    need no device-side checks.
    """
    if logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    chunks = list(decode) + list(prefill)
    if not chunks and not decode_batch and not tokens:
        raise ValueError("plan_step needs at least one decode or prefill sequence (or decode_batch / tokens "
                         "for a padding-only step)")
    max_blocks = max([len(c.blocks) for c in chunks] + [min_batch]) if max_blocks is None else max_blocks
    for i, c in enumerate(chunks):
        end = c.start + len(c.tokens)
        if c.start < 0 or end > len(c.blocks) * block_size:
            raise ValueError(f"sequence {i}: tokens up to position {end} need {-(-end // block_size)} blocks of "
                             f"{block_size}, but {len(c.blocks)} were given")
        if len(c.blocks) > max_blocks:
            raise ValueError(f"sequence {i}: {len(c.blocks)} blocks exceed max_blocks={max_blocks}")
        if num_blocks is not None and any(not 0 <= b < num_blocks for b in c.blocks):
            raise ValueError(f"sequence {i}: block ids {list(c.blocks)} must lie in [0, {num_blocks})")
    if decode_batch is not None and decode_batch < max(len(decode), min_batch):
        raise ValueError(f"decode_batch={decode_batch} must be >= the decode sequences ({len(decode)}) and min_batch ({min_batch})")
    for i, c in enumerate(decode):
        if len(c.tokens) != query_len:
            raise ValueError(f"decode sequence {i}: {len(c.tokens)} new tokens, expected query_len={query_len}")
    for i, c in enumerate(prefill):
        if not c.tokens:
            raise ValueError(f"prefill sequence {i}: needs at least one new token")
    if context_chunk_tokens < 1:
        raise ValueError(f"context_chunk_tokens must be positive, got {context_chunk_tokens}")
    # decode: whole-batch numpy (no per-token Python); prefill: a per-token loop (prompts are uncaptured)
    ids_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    row_parts: list[np.ndarray] = []
    pad_rows = np.zeros(0, dtype=np.int64)  # logits rows of padding decode sequences: after the real rows
    dec = None
    if decode or decode_batch:
        n_seq = decode_batch if decode_batch is not None else max(len(decode), min_batch)
        n, q = len(decode), query_len
        tok, pos, slots = (np.empty(n_seq * q, dtype=np.int64) for _ in range(3))
        table, seq_lens = np.empty((n_seq, max_blocks), dtype=np.int32), np.empty(n_seq, dtype=np.int32)
        fill_decode([c.blocks for c in decode], [c.tokens for c in decode], chunk_starts(decode),
                    chunk_block_counts(decode), block_size, tok, pos, slots, table, seq_lens)
        ids_parts.append(tok)
        pos_parts.append(pos)
        slot_parts.append(slots)
        every = logits == "all"
        row_parts.append(np.arange(n * q) if every else np.arange(q - 1, n * q, q))
        pad_rows = np.arange(n * q, n_seq * q) if every else np.arange(n * q + q - 1, n_seq * q, q)
        dec = DecodeMetadata(torch.from_numpy(table), torch.from_numpy(seq_lens), query_len)
    pre = None
    if prefill:
        offset = sum(len(a) for a in ids_parts)
        ids: list[int] = []
        pos_l: list[int] = []
        slots_l: list[int] = []
        pre_rows: list[int] = []
        cu = [0]
        for c in prefill:
            for j, t in enumerate(c.tokens):
                p = c.start + j
                ids.append(t)
                pos_l.append(p)
                slots_l.append(c.blocks[p // block_size] * block_size + p % block_size)
            n_tok = len(c.tokens)
            first = offset + len(ids) - n_tok
            pre_rows.extend(range(first, first + n_tok) if logits == "all" else [first + n_tok - 1])
            cu.append(cu[-1] + n_tok)
        ids_parts.append(np.asarray(ids, dtype=np.int64))
        pos_parts.append(np.asarray(pos_l, dtype=np.int64))
        slot_parts.append(np.asarray(slots_l, dtype=np.int64))
        row_parts.append(np.asarray(pre_rows, dtype=np.int64))
        n_pad = max(0, min_batch - len(prefill))
        cu += [cu[-1]] * n_pad
        cu_t = torch.tensor(cu, dtype=torch.int32)
        pre = PrefillMetadata(cu_t, cu_t.clone())
        starts_l = [c.start for c in prefill] + [0] * n_pad
        # always set: sparse (V3.2) layers read every prefill sequence's index keys through it
        pre.block_table = _block_table([c.blocks for c in prefill], len(starts_l), max_blocks)
        if any(starts_l):
            pre.context = context_slices(starts_l, context_chunk_tokens, min_batch)
    real_rows = np.concatenate(row_parts) if row_parts else np.zeros(0, dtype=np.int64)
    num_rows = len(real_rows)
    all_rows = np.concatenate([real_rows, pad_rows])
    total = sum(len(a) for a in ids_parts)
    natural_tokens, natural_rows = max(total, min_batch), max(len(all_rows), min_batch)
    for name, want, least in (("tokens", tokens, natural_tokens), ("rows", rows, natural_rows)):
        if want is not None and want < least:
            raise ValueError(f"{name}={want} is below the step's own {least} {name}: pad to at least that")
    tail = (natural_tokens if tokens is None else tokens) - total
    if tail and pre is None:  # padding tokens belong to the prefill part: an empty one (no sequence)
        cu_t = torch.zeros(min_batch + 1, dtype=torch.int32)
        pre = PrefillMetadata(cu_t, cu_t.clone(), torch.zeros((min_batch, max_blocks), dtype=torch.int32))
    ids_parts.append(np.zeros(tail, dtype=np.int64))
    pos_parts.append(np.zeros(tail, dtype=np.int64))
    slot_parts.append(np.full(tail, -1, dtype=np.int64))
    n_rows = natural_rows if rows is None else rows
    if len(all_rows) < n_rows:
        last = all_rows[-1] if len(all_rows) else 0
        all_rows = np.concatenate([all_rows, np.full(n_rows - len(all_rows), last, dtype=np.int64)])
    cat = lambda parts: torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))  # noqa: E731
    meta = MLAMetadata(cat(slot_parts), dec, pre, torch.from_numpy(all_rows.astype(np.int64, copy=False)))
    return StepInputs(cat(ids_parts), cat(pos_parts), meta, num_rows)


def chunk_starts(chunks: Sequence[SeqChunk]) -> np.ndarray:
    """Each chunk's ``start`` (int64)."""
    return np.fromiter(map(attrgetter("start"), chunks), dtype=np.int64, count=len(chunks))


def chunk_block_counts(chunks: Sequence[SeqChunk]) -> np.ndarray:
    """Each chunk's ``len(blocks)`` (int64)."""
    return np.fromiter((len(c.blocks) for c in chunks), dtype=np.int64, count=len(chunks))


def fill_decode(blocks: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]], starts: np.ndarray,
                block_counts: np.ndarray, block_size: int, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray,
                table: np.ndarray, seq_lens: np.ndarray, *, table_written: bool = False) -> None:
    """Write the decode part of a step into ``ids``/``pos``/``slots [n_seq * q]`` (int64), ``table [n_seq,
    max_blocks]`` and ``seq_lens [n_seq]`` (int32), q new tokens per sequence (``q = len(ids) // n_seq``):
    whole-batch numpy, no per-token Python. ``blocks``, ``tokens``, ``starts``, ``block_counts``: each
    decode chunk's ``blocks``, ``tokens``, ``start`` and ``len(blocks)``, checked by the caller. The rows
    past the chunks are padding (token 0, position 0, slot -1, seq_len 0, an empty table row).
    ``table_written``: the caller already wrote ``table`` (every row, padding rows included; e.g.
    gathered from persistent tables), so it is only read."""
    n, n_seq = len(tokens), seq_lens.shape[0]
    q = ids.shape[0] // n_seq
    if not table_written:
        fill_block_table(table, blocks, block_counts)
    ids[:n * q] = np.fromiter(chain.from_iterable(tokens), dtype=np.int64, count=n * q)
    p = (starts[:, None] + np.arange(q)).reshape(-1)
    pos[:n * q] = p
    slots[:n * q] = table[np.repeat(np.arange(n), q), p // block_size].astype(np.int64) * block_size + p % block_size
    ids[n * q:], pos[n * q:], slots[n * q:] = 0, 0, -1
    seq_lens[:n] = starts + q
    seq_lens[n:] = 0


def fill_block_table(table: np.ndarray, blocks: Sequence[Sequence[int]], counts: np.ndarray) -> None:
    """Zero ``table [rows, width]`` (int32) and write block list i into row i (``counts``: the lists'
    lengths, int64, each at most ``width``): one flat C-level pass over all ids and one masked store, not a
    Python loop over rows."""
    table.fill(0)
    flat = np.fromiter(chain.from_iterable(blocks), dtype=np.int32, count=int(counts.sum()))
    table[:len(counts)][np.arange(table.shape[1]) < counts[:, None]] = flat


def _block_table_np(blocks: list[Sequence[int]], rows: int, width: int) -> np.ndarray:
    """``[rows, width]`` int32 table of the given block lists, zero-padded."""
    table = np.empty((rows, width), dtype=np.int32)
    fill_block_table(table, blocks, np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks)))
    return table


def _block_table(blocks: list[Sequence[int]], rows: int, width: int) -> Tensor:
    """:func:`_block_table_np` as a tensor."""
    return torch.from_numpy(_block_table_np(blocks, rows, width))


def context_slices(context_lens: Sequence[int], budget: int, min_slices: int = 2) -> ContextSlices:
    """Cover every sequence's context ``[0, context_lens[i])`` in slices of at most ``budget`` rows, filled
    greedily in sequence order (every slice but the last non-empty one holds exactly ``budget`` rows).
    Empty slices pad the count up to ``min_slices``, so a count of 1 never specialises a compiled graph."""
    lens = np.asarray(context_lens, dtype=np.int64)
    total = int(lens.sum())
    n_slices = max(-(-total // budget), min_slices)
    # slice c covers the flat context positions [c * budget, (c + 1) * budget) of the sequences laid end to end
    seq_begin = np.concatenate([[0], np.cumsum(lens)])
    edges = np.minimum(np.arange(n_slices + 1) * budget, total)
    lo, hi = edges[:-1, None], edges[1:, None]
    begin = np.clip(seq_begin[None, :-1], lo, hi)
    end = np.clip(seq_begin[None, 1:], lo, hi)
    cu = np.zeros((n_slices, len(lens) + 1), dtype=np.int32)
    cu[:, 1:] = np.cumsum(end - begin, axis=1)
    starts = np.clip(begin - seq_begin[None, :-1], 0, lens[None, :]).astype(np.int32)  # 0..len: in range when empty
    return ContextSlices(torch.from_numpy(cu), torch.from_numpy(starts), torch.from_numpy(hi[:, 0] - lo[:, 0]))
