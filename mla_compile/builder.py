"""Capture-safe step metadata: one persistent device arena filled per step by one copy.

:class:`MetadataBuilder` owns one device byte buffer (the arena) sized once for ``max_batch``,
``max_blocks_per_seq`` and ``max_tokens``. Each step it plans on the host (:func:`plan_step`), packs
every field into one pinned host buffer, copies it into the front of the arena with a single
``non_blocking`` copy (no device allocation, no host sync; one H2D transfer instead of one per field)
and hands out *views* of the arena, each at a 16-byte aligned offset. The layout depends only on the
step's sizes (tokens, logits rows, decode rows, prefill rows), so steps of one size always get the same
addresses, which is what a captured CUDA graph needs: fill, then replay.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from mla_compile.metadata import (DecodeMetadata, MLAMetadata, PrefillMetadata, SeqChunk, StepInputs,
                                  chunk_block_counts, chunk_starts, fill_decode, plan_step)

_ALIGN = 16  # bytes: Inductor assumes 16-byte aligned inputs (it copies misaligned ones)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class MetadataBuilder:
    """Persistent metadata buffers for steps of at most ``max_batch`` sequences and ``max_tokens`` tokens."""

    def __init__(self, *, max_batch: int, max_blocks_per_seq: int, max_tokens: int, block_size: int,
                 device: torch.device | str, query_len: int = 1, min_batch: int = 2,
                 decode_planner: Callable[[Tensor, Tensor], Any] | None = None,
                 context_chunk_tokens: int = 65536) -> None:
        """``context_chunk_tokens``: the most cached-context rows a prefill gathers at once (per slice;
        see :func:`plan_step`). ``decode_planner``: called with each decode step's host ``block_table`` and ``seq_lens`` before
        the step (and for each padding step at capture); what it returns rides along as
        ``DecodeMetadata.plan`` (e.g. ``ops.adapters.flashinfer.FlashInferDecodePlanner``, which returns
        itself, so compiled graphs see one constant object)."""
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
        # ids, positions, slots, logits rows (int64) | block table, seq_lens, cu_seqlens_q, cu_seqlens_k (int32)
        capacity = (3 * _aligned(8 * max_tokens) + _aligned(8 * max_tokens) + _aligned(4 * max_batch * max_blocks_per_seq)
                    + _aligned(4 * max_batch) + 2 * _aligned(4 * (max_batch + 1)))
        self.arena = torch.zeros(capacity, dtype=torch.uint8, device=self.device)
        self._pin = self.device.type == "cuda"
        self.decode_planner = decode_planner
        self.context_chunk_tokens = context_chunk_tokens
        # two persistent pinned staging buffers, used in turn; each is reused only after its last copy
        # finished (an event query; a wait only when the host runs two steps ahead of the GPU)
        self._staging = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(2)] \
            if self._pin else []
        self._copied: list = [None, None]
        self._turn = 0
        self._layouts: dict[int, _DecodeLayout] = {}  # decode-only steps by padded batch: see _build_decode

    def _host(self, end: int) -> tuple[Tensor, int]:
        """The host bytes to pack the next step into and their id: pinned staging buffer 0/1 in turn, -1 the
        CPU arena itself, -2 a fresh buffer (devices without pinned staging)."""
        turn = -1
        if self._pin:
            turn, self._turn = self._turn, self._turn ^ 1
            done = self._copied[turn]
            if done is not None and not done.query():
                done.synchronize()  # the host is two steps ahead: wait for that step's copy to finish
            return self._staging[turn][:end], turn
        if self.arena.device.type == "cpu":
            return self.arena[:end], turn  # a CPU arena is written in place
        return torch.empty(end, dtype=torch.uint8), -2  # another device without pinned staging: a fresh buffer

    def _send(self, host: Tensor, turn: int, end: int) -> None:
        """Copy the packed bytes to the front of the arena (one async H2D copy from pinned staging)."""
        if self._pin:
            self.arena[:end].copy_(host, non_blocking=True)
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        elif self.arena.device.type != "cpu":  # another device without pinned memory
            self.arena[:end].copy_(host)

    def _stage(self, arrays: Sequence[np.ndarray]) -> list[Tensor]:
        """Pack host ``arrays`` into one pinned buffer, copy it to the front of the arena in one
        (async) copy, and return arena views with the arrays' dtypes and shapes."""
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += _aligned(a.nbytes)
        if end > self.arena.numel():  # unreachable when the size checks in build() hold
            raise ValueError(f"step metadata needs {end} bytes; the builder's arena holds {self.arena.numel()}")
        host, turn = self._host(end)
        flat = host.numpy()
        for a, off in zip(arrays, offsets):
            flat[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self._send(host, turn, end)
        return [self.arena[off:off + a.nbytes].view(_TORCH[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]

    def build(self, decode: Sequence[SeqChunk], prefill: Sequence[SeqChunk] = (), *,
              decode_batch: int | None = None, logits: str = "last") -> StepInputs:
        """Plan a step on the host and fill the arena; returns views of it as :class:`StepInputs`.

        ``decode_batch`` pads the decode part to a capture size. Raises before writing anything when the
        step does not fit the buffers.
        """
        n_dec = decode_batch if decode_batch is not None else max(len(decode), self.min_batch) if decode else 0
        if n_dec > self.max_batch or len(prefill) > self.max_batch:
            raise ValueError(f"step has {max(n_dec, len(prefill))} sequences in one part; the builder holds "
                             f"max_batch={self.max_batch}")
        if decode and not prefill and logits == "last" and n_dec >= max(len(decode), self.min_batch):
            fast = self._build_decode(decode, n_dec)
            if fast is not None:
                return fast
        plan = plan_step(decode, prefill, self.block_size, max_blocks=self.max_blocks, query_len=self.query_len,
                         logits=logits, min_batch=self.min_batch, decode_batch=decode_batch if decode else None,
                         context_chunk_tokens=self.context_chunk_tokens)
        if plan.input_ids.shape[0] > self.max_tokens or plan.meta.logits_indices.shape[0] > self.max_tokens:
            raise ValueError(f"step has {plan.input_ids.shape[0]} tokens; the builder holds max_tokens={self.max_tokens}")
        meta = plan.meta
        planned = None if meta.decode is None or self.decode_planner is None else \
            self.decode_planner(meta.decode.block_table, meta.decode.seq_lens)
        arrays = [plan.input_ids, plan.positions, meta.slot_mapping, meta.logits_indices]
        if meta.decode is not None:
            arrays += [meta.decode.block_table, meta.decode.seq_lens]
        if meta.prefill is not None:
            arrays += [meta.prefill.cu_seqlens_q, meta.prefill.cu_seqlens_k]
        views = self._stage([t.numpy() for t in arrays])
        ids, pos, slots, rows = views[:4]
        dec = pre = None
        if meta.decode is not None:
            dec = DecodeMetadata(views[4], views[5], self.query_len, planned)
        if meta.prefill is not None:
            # prefill runs uncaptured: its context metadata (sized by the context) is moved, not staged
            moved = meta.prefill.to(self.device)
            pre = PrefillMetadata(views[-2], views[-1], moved.block_table, moved.context)
        return StepInputs(ids, pos, MLAMetadata(slots, dec, pre, rows), plan.num_rows)

    def _build_decode(self, decode: Sequence[SeqChunk], n_seq: int) -> StepInputs | None:
        """The decode-only step (the one served every token): the same arena bytes and views as the
        general path, written straight into the staging buffer with whole-batch numpy and the views of
        its padded size reused. ``None`` when a check fails (the general path then raises its error)."""
        q, bs, n = self.query_len, self.block_size, len(decode)
        starts, nblk = chunk_starts(decode), chunk_block_counts(decode)
        ntok = np.fromiter((len(c.tokens) for c in decode), dtype=np.int64, count=n)
        if ((ntok != q) | (starts < 0) | (nblk > self.max_blocks) | (starts + q > nblk * bs)).any():
            return None
        layout = self._layouts.get(n_seq)
        if layout is None:
            layout = self._layouts[n_seq] = _DecodeLayout(self, n_seq)
        host, turn = self._host(layout.end)
        ids, pos, slots, rows, table, lens = layout.fields(host, turn)
        fill_decode(decode, starts, nblk, bs, ids, pos, slots, table, lens)
        rows[:] = layout.rows
        planned = None if self.decode_planner is None else \
            self.decode_planner(torch.from_numpy(table), torch.from_numpy(lens))
        self._send(host, turn, layout.end)
        v = layout.views
        meta = MLAMetadata(v[2], DecodeMetadata(v[4], v[5], q, planned), None, v[3])
        return StepInputs(v[0], v[1], meta, n)

    def padding_decode(self, batch: int) -> StepInputs:
        """A decode step of ``batch`` padding sequences (reads and writes nothing): for graph capture.
        Its views have the addresses of every later real decode step of ``batch`` sequences."""
        if not self.min_batch <= batch <= self.max_batch:
            raise ValueError(f"batch must be in [{self.min_batch}, {self.max_batch}], got {batch}")
        n = batch * self.query_len
        zeros = np.zeros(n, dtype=np.int64)
        arrays = [zeros, zeros, np.full(n, -1, dtype=np.int64), np.arange(self.query_len - 1, n, self.query_len),
                  np.zeros((batch, self.max_blocks), dtype=np.int32), np.zeros(batch, dtype=np.int32)]
        planned = None if self.decode_planner is None else \
            self.decode_planner(torch.from_numpy(arrays[4]), torch.from_numpy(arrays[5]))
        ids, pos, slots, rows, table, lens = self._stage(arrays)
        meta = MLAMetadata(slots, DecodeMetadata(table, lens, self.query_len, planned), None, rows)
        return StepInputs(ids, pos, meta, 0)


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class _DecodeLayout:
    """Offsets and arena views of a decode-only step of ``n_seq`` (padded) sequences: ids, positions,
    slots (int64, ``n_seq * query_len``), logits rows (int64, ``n_seq``), block table, seq_lens (int32);
    the order and 16-byte alignment of ``MetadataBuilder._stage``, so the addresses are the ones a
    captured graph of that size reads."""

    def __init__(self, builder: MetadataBuilder, n_seq: int) -> None:
        n, q = n_seq * builder.query_len, builder.query_len
        self.specs = [(np.dtype(np.int64), (n,))] * 3 + [(np.dtype(np.int64), (n_seq,)),
                      (np.dtype(np.int32), (n_seq, builder.max_blocks)), (np.dtype(np.int32), (n_seq,))]
        self.spans, end = [], 0
        for dtype, shape in self.specs:
            nbytes = dtype.itemsize * int(np.prod(shape))
            self.spans.append((end, end + nbytes))
            end += _aligned(nbytes)
        self.end = end
        self.rows = np.arange(q - 1, n, q, dtype=np.int64)
        self.views = [builder.arena[a:b].view(_TORCH[dt]).view(sh) for (dt, sh), (a, b) in zip(self.specs, self.spans)]
        self._fields: dict[int, list[np.ndarray]] = {}

    def fields(self, host: Tensor, turn: int) -> list[np.ndarray]:
        """Numpy views, one per field, of the packed host bytes ``host`` (buffer id ``turn``, see
        ``MetadataBuilder._host``), made once per persistent buffer."""
        fields = self._fields.get(turn)
        if fields is None:
            flat = host.numpy()
            fields = [flat[a:b].view(dt).reshape(sh) for (dt, sh), (a, b) in zip(self.specs, self.spans)]
            if turn != -2:  # a persistent buffer
                self._fields[turn] = fields
        return fields
