"""Capture-safe step metadata: persistent device buffers filled per step with ``copy_``.

:class:`MetadataBuilder` owns one buffer per metadata field, sized once for ``max_batch``,
``max_blocks_per_seq`` and ``max_tokens``. Each step it plans on the host (:func:`plan_step`), copies
the host tensors into its buffers through pinned memory with ``non_blocking`` copies (no device
allocation, no host sync), and hands out *views* of the buffers. Views of one size always have the
same addresses, which is what a captured CUDA graph needs: fill, then replay.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from mla_compile.metadata import DecodeMetadata, MLAMetadata, PrefillMetadata, SeqChunk, StepInputs, plan_step


class MetadataBuilder:
    """Persistent metadata buffers for steps of at most ``max_batch`` sequences and ``max_tokens`` tokens."""

    def __init__(self, *, max_batch: int, max_blocks_per_seq: int, max_tokens: int, block_size: int,
                 device: torch.device | str, query_len: int = 1, min_batch: int = 2) -> None:
        for name, value in (("max_batch", max_batch), ("max_blocks_per_seq", max_blocks_per_seq),
                            ("max_tokens", max_tokens), ("block_size", block_size), ("query_len", query_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_batch < min_batch:
            raise ValueError(f"max_batch must be >= min_batch={min_batch}, got {max_batch}")
        if max_tokens < max_batch * query_len:
            raise ValueError(f"max_tokens must hold a full decode batch ({max_batch} x {query_len}), got {max_tokens}")
        self.device = torch.device(device)
        self.max_batch, self.max_blocks, self.max_tokens = max_batch, max_blocks_per_seq, max_tokens
        self.block_size, self.query_len, self.min_batch = block_size, query_len, min_batch
        i32, i64 = dict(dtype=torch.int32, device=self.device), dict(dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.slot_mapping = torch.full((max_tokens,), -1, **i64)
        self.logits_indices = torch.zeros(max_tokens, **i64)
        self.block_table = torch.zeros(max_batch, max_blocks_per_seq, **i32)
        self.seq_lens = torch.zeros(max_batch, **i32)
        self.cu_seqlens_q = torch.zeros(max_batch + 1, **i32)
        self.cu_seqlens_k = torch.zeros(max_batch + 1, **i32)
        self._pin = self.device.type == "cuda"

    def _put(self, buf: Tensor, src: Tensor) -> Tensor:
        """Copy host ``src`` into the front of ``buf`` (async through pinned memory); return that view."""
        view = buf[:src.shape[0]] if src.dim() == 1 else buf[:src.shape[0], :src.shape[1]]
        view.copy_(src.pin_memory() if self._pin else src, non_blocking=self._pin)
        return view

    def build(self, decode: Sequence[SeqChunk], prefill: Sequence[SeqChunk] = (), *,
              decode_batch: int | None = None, logits: str = "last") -> StepInputs:
        """Plan a step on the host and fill the buffers; returns views of them as :class:`StepInputs`.

        ``decode_batch`` pads the decode part to a capture size. Raises before writing anything when the
        step does not fit the buffers.
        """
        n_dec = decode_batch if decode_batch is not None else max(len(decode), self.min_batch) if decode else 0
        if n_dec > self.max_batch or len(prefill) > self.max_batch:
            raise ValueError(f"step has {max(n_dec, len(prefill))} sequences in one part; the builder holds "
                             f"max_batch={self.max_batch}")
        plan = plan_step(decode, prefill, self.block_size, max_blocks=self.max_blocks, query_len=self.query_len,
                         logits=logits, min_batch=self.min_batch, decode_batch=decode_batch if decode else None)
        if plan.input_ids.shape[0] > self.max_tokens:
            raise ValueError(f"step has {plan.input_ids.shape[0]} tokens; the builder holds max_tokens={self.max_tokens}")
        meta = plan.meta
        dec = pre = None
        if meta.decode is not None:
            dec = DecodeMetadata(self._put(self.block_table, meta.decode.block_table),
                                 self._put(self.seq_lens, meta.decode.seq_lens), self.query_len)
        if meta.prefill is not None:
            # prefill runs uncaptured: its context metadata (sized by the context) is moved, not buffered
            moved = meta.prefill.to(self.device)
            pre = PrefillMetadata(self._put(self.cu_seqlens_q, meta.prefill.cu_seqlens_q),
                                  self._put(self.cu_seqlens_k, meta.prefill.cu_seqlens_k),
                                  moved.block_table, moved.context_chunks, moved.chunk_tokens)
        out_meta = MLAMetadata(self._put(self.slot_mapping, meta.slot_mapping), dec, pre,
                               self._put(self.logits_indices, meta.logits_indices))
        return StepInputs(self._put(self.input_ids, plan.input_ids), self._put(self.positions, plan.positions),
                          out_meta, plan.num_rows)

    def padding_decode(self, batch: int) -> StepInputs:
        """A decode step of ``batch`` padding sequences (reads and writes nothing): for graph capture."""
        if not self.min_batch <= batch <= self.max_batch:
            raise ValueError(f"batch must be in [{self.min_batch}, {self.max_batch}], got {batch}")
        n = batch * self.query_len
        self.input_ids[:n].zero_()
        self.positions[:n].zero_()
        self.slot_mapping[:n].fill_(-1)
        self.block_table[:batch].zero_()
        self.seq_lens[:batch].zero_()
        self.logits_indices[:batch].copy_(torch.arange(self.query_len - 1, n, self.query_len, device=self.device))
        meta = MLAMetadata(self.slot_mapping[:n], DecodeMetadata(self.block_table[:batch], self.seq_lens[:batch],
                                                                 self.query_len), None, self.logits_indices[:batch])
        return StepInputs(self.input_ids[:n], self.positions[:n], meta, 0)
