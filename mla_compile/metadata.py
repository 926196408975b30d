"""Step metadata: tensors that tell every layer where this step's tokens live in the paged cache.

A step's tokens are laid out decode first, then prefill: ``[B * s_q decode tokens | prefill tokens]``.
The split point is ``decode.block_table.shape[0] * decode.query_len``, a shape, so one compiled graph
serves every batch size. Metadata is passed explicitly to the model as an argument (never through
globals); every field that changes per step is a tensor, and the only Python values are static
(``query_len``). Host-side planning (:func:`plan_step`) happens before the step, outside compiled code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np
import torch
from torch import Tensor


def _to(t: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if t is None else t.to(device, non_blocking=True)


@dataclass
class DecodeMetadata:
    """Decode part: ``block_table [B, max_blocks]`` int32, ``seq_lens [B]`` int32 (context incl. new tokens).

    ``query_len`` (static) is the number of new tokens per sequence (s_q; > 1 for MTP/speculative).
    """

    block_table: Tensor
    seq_lens: Tensor
    query_len: int = 1

    @property
    def num_tokens(self):
        """Decode tokens in this step (a shape, symbolic under dynamic shapes)."""
        return self.block_table.shape[0] * self.query_len


@dataclass
class ContextChunk:
    """One bounded slice of the cached context: workspace rows ``cu_seqlens[i]:cu_seqlens[i+1]`` hold
    positions ``seq_starts[i], ...`` of prefill sequence i (``[N+1]`` and ``[N]`` int32)."""

    cu_seqlens: Tensor
    seq_starts: Tensor


@dataclass
class PrefillMetadata:
    """Prefill part: ``cu_seqlens_q [N+1]`` int32 over the new prefill tokens, which attend causally to
    each other (``cu_seqlens_k`` = ``cu_seqlens_q``). Sequences with cached context (a prefix-cache hit
    or an earlier chunk of a chunked prefill) also attend to it: ``block_table [N, max_blocks]`` finds
    it, and ``context_chunks`` cover it in slices of at most ``chunk_tokens`` rows (a static workspace
    size), each gathered, up-projected, attended and merged by LSE. :func:`plan_step` always sets
    ``block_table`` (sparse V3.2 layers read the whole sequence's index keys and latents through it).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    block_table: Tensor | None = None
    context_chunks: list[ContextChunk] = field(default_factory=list)
    chunk_tokens: int = 0

    def to(self, device: torch.device | str) -> "PrefillMetadata":
        """A copy on ``device``."""
        mv = lambda t: _to(t, device)  # noqa: E731
        return PrefillMetadata(mv(self.cu_seqlens_q), mv(self.cu_seqlens_k), mv(self.block_table),
                               [ContextChunk(mv(c.cu_seqlens), mv(c.seq_starts)) for c in self.context_chunks],
                               self.chunk_tokens)


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
        parts = [self, self.decode, self.prefill] + (self.prefill.context_chunks if self.prefill else [])
        for part in parts:
            if part is None:
                continue
            out.extend(v for f in fields(part) if isinstance(v := getattr(part, f.name), Tensor))
        return out

    def to(self, device: torch.device | str) -> "MLAMetadata":
        """A copy on ``device`` (host-side planning builds on CPU, then moves once)."""
        mv = lambda t: _to(t, device)  # noqa: E731
        dec = self.decode and DecodeMetadata(mv(self.decode.block_table), mv(self.decode.seq_lens), self.decode.query_len)
        pre = self.prefill and self.prefill.to(device)
        return MLAMetadata(mv(self.slot_mapping), dec, pre, mv(self.logits_indices))


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
        for c in meta.prefill.context_chunks:
            mark(c.cu_seqlens, 0)
            mark(c.seq_starts, 0)
    if meta.logits_indices is not None:
        mark(meta.logits_indices, 0)


@dataclass
class SeqChunk:
    """One sequence's part of a step: its cache ``blocks``, its new ``tokens`` and the position of the
    first new token (``start``; the sequence holds ``start + len(tokens)`` tokens after the step)."""

    blocks: Sequence[int]
    tokens: Sequence[int]
    start: int = 0


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


def plan_step(decode: Sequence[SeqChunk], prefill: Sequence[SeqChunk], block_size: int, *,
              max_blocks: int | None = None, num_blocks: int | None = None, query_len: int = 1,
              logits: str = "last", min_batch: int = 2, decode_batch: int | None = None,
              context_chunk_tokens: int = 65536) -> StepInputs:
    """Host-side planning of one step (CPU tensors; move once with ``.to(device)``).

    Decode chunks carry ``query_len`` new tokens each. Prefill chunks carry new prompt tokens from
    ``start``: positions before ``start`` are cached context (a prefix-cache hit, or earlier chunks of
    a chunked prefill), attended in slices of at most ``context_chunk_tokens`` rows.
    ``logits``: "last" (one row per sequence) or "all" (one row per new token). Each non-empty part,
    the token count and the logits rows are padded up to ``min_batch`` with rows that read and write
    nothing (seq_len 0, slot -1), so sizes 0/1 never specialise a compiled graph; ``decode_batch``
    pads the decode part to exactly that many sequences (a CUDA-graph capture size). Validates block
    ids and capacities here, on host data, so the ops need no device-side checks.
    """
    if logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
    chunks = list(decode) + list(prefill)
    if not chunks:
        raise ValueError("plan_step needs at least one decode or prefill sequence")
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
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    rows: list[int] = []

    def add(c: SeqChunk) -> None:
        for j, t in enumerate(c.tokens):
            p = c.start + j
            ids.append(t)
            pos.append(p)
            slots.append(c.blocks[p // block_size] * block_size + p % block_size)
        n = len(c.tokens)
        rows.extend(range(len(ids) - n, len(ids)) if logits == "all" else [len(ids) - 1])

    def pad_tokens(n: int) -> None:
        ids.extend([0] * n)
        pos.extend([0] * n)
        slots.extend([-1] * n)

    pad_rows: list[int] = []  # logits rows of padding decode sequences: after the real rows
    dec = None
    if decode:
        n_seq = decode_batch if decode_batch is not None else max(len(decode), min_batch)
        for c in decode:
            add(c)
        table = _block_table([c.blocks for c in decode], n_seq, max_blocks)
        seq_lens = torch.tensor([c.start + len(c.tokens) for c in decode] + [0] * (n_seq - len(decode)),
                                dtype=torch.int32)
        n_pad = (n_seq - len(decode)) * query_len
        pad_tokens(n_pad)
        last = range(len(ids) - n_pad, len(ids))
        pad_rows = list(last) if logits == "all" else list(last)[query_len - 1::query_len]
        dec = DecodeMetadata(table, seq_lens, query_len)
    pre = None
    if prefill:
        cu = [0]
        for c in prefill:
            add(c)
            cu.append(cu[-1] + len(c.tokens))
        n_pad = max(0, min_batch - len(prefill))
        cu += [cu[-1]] * n_pad
        cu_t = torch.tensor(cu, dtype=torch.int32)
        pre = PrefillMetadata(cu_t, cu_t.clone())
        starts = [c.start for c in prefill] + [0] * n_pad
        # always set: sparse (V3.2) layers read every prefill sequence's index keys through it
        pre.block_table = _block_table([c.blocks for c in prefill], len(starts), max_blocks)
        if any(starts):
            pre.chunk_tokens = min(context_chunk_tokens, sum(starts))
            pre.context_chunks = _context_chunks(starts, pre.chunk_tokens)
    num_rows = len(rows)
    rows += pad_rows
    pad_tokens(max(0, min_batch - len(ids)))
    rows += [rows[-1]] * max(0, min_batch - len(rows))
    meta = MLAMetadata(torch.tensor(slots, dtype=torch.int64), dec, pre, torch.tensor(rows, dtype=torch.int64))
    return StepInputs(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta, num_rows)


def _block_table(blocks: list[Sequence[int]], rows: int, width: int) -> Tensor:
    """``[rows, width]`` int32 table of the given block lists, zero-padded (filled in numpy: the host
    cost of a 256 x 64 table is ~1 ms this way against ~2.7 ms through nested lists)."""
    table = np.zeros((rows, width), dtype=np.int32)
    for i, b in enumerate(blocks):
        table[i, :len(b)] = b
    return torch.from_numpy(table)


def _context_chunks(context_lens: list[int], budget: int) -> list[ContextChunk]:
    """Cover every sequence's context ``[0, context_lens[i])`` in slices of at most ``budget`` rows."""
    chunks, done = [], [0] * len(context_lens)
    while any(d < n for d, n in zip(done, context_lens)):
        room, cu, starts = budget, [0], []
        for i, n in enumerate(context_lens):
            take = min(n - done[i], room)
            starts.append(done[i])
            cu.append(cu[-1] + take)
            done[i] += take
            room -= take
        chunks.append(ContextChunk(torch.tensor(cu, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)))
    return chunks
