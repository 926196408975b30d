"""Step inputs for DeepSeek-V4 in persistent buffers, for :class:`mla_compile.graphs.DecodeGraphRunner`.

:class:`V4DecodeBuilder` plans a step on the host from :class:`V4Chunk` s (a sequence's new tokens, its
start position, its token blocks, its compressed-entry blocks per rate and its compressor-state row) and
hands the model :class:`~mla_compile.models.v4_model.V4Metadata`. Decode steps padded to a capture size
(``decode_batch``) are written into persistent device buffers and returned as views of them, the same
views every time for a size, so a captured graph replays them; padding rows are token 0 at position 0
with ``query_seq = -1`` and slot -1 (they read and write nothing). Other steps (prefill, mixed, or
no ``decode_batch``) get fresh tensors and run uncaptured.

The chunks' block lists come from :class:`mla_compile.serving.v4_blocks.V4BlockManager`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from mla_compile.models.metadata import StepInputs
from mla_compile.models.v4_model import V4Metadata


@dataclass
class V4Chunk:
    """One sequence's part of a step: ``tokens`` from position ``start``, its token-row ``blocks``, its
    compressed-entry blocks per rate ``entry_blocks`` and its compressor-state row ``state_slot``."""

    tokens: Sequence[int]
    start: int
    blocks: Sequence[int]
    entry_blocks: dict[int, Sequence[int]] = field(default_factory=dict)
    state_slot: int = 0


class V4DecodeBuilder:
    """Builds V4 steps; decode steps of a capture size live in persistent buffers on ``device``."""

    query_len = 1  # one token per decode row (what DecodeGraphRunner's token feed needs)

    def __init__(self, *, max_batch: int, max_blocks_per_seq: int, max_entry_blocks: int, rates: Sequence[int],
                 block_size: int, device: torch.device | str, min_batch: int = 2, max_tokens: int = 2048) -> None:
        """``max_tokens``: the most tokens one step may hold (what :class:`~mla_compile.serving.engine.Engine`
        schedules under); decode steps of a capture size sit in persistent buffers, other steps are built fresh."""
        if not 1 <= min_batch <= max_batch:
            raise ValueError(f"need 1 <= min_batch <= max_batch, got min_batch={min_batch}, max_batch={max_batch}")
        if not isinstance(max_tokens, int) or max_tokens < max_batch:
            raise ValueError(f"max_tokens must hold a full decode batch ({max_batch}), got {max_tokens!r}")
        self.max_batch, self.min_batch, self.max_tokens = max_batch, min_batch, max_tokens
        self.max_blocks, self.max_entry_blocks, self.block_size = max_blocks_per_seq, max_entry_blocks, block_size
        self.rates = tuple(sorted(rates))
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self._buf = dict(input_ids=torch.zeros(max_batch, dtype=torch.long, device=self.device),
                         positions=torch.zeros(max_batch, **i32), query_seq=torch.zeros(max_batch, **i32),
                         seq_lens=torch.zeros(max_batch, **i32),
                         block_table=torch.zeros(max_batch, max_blocks_per_seq, **i32),
                         slot_mapping=torch.zeros(max_batch, dtype=torch.long, device=self.device),
                         state_slot=torch.zeros(max_batch, **i32),
                         logits_indices=torch.zeros(max_batch, dtype=torch.long, device=self.device))
        for r in self.rates:
            self._buf[f"entry_{r}"] = torch.zeros(max_batch, max_entry_blocks, **i32)

    def _host(self, chunks: Sequence[V4Chunk], n_seq: int, tokens: int | None = None,
              rows: int | None = None) -> dict[str, Tensor]:
        """The step's tensors on the host (CPU), ``n_seq`` batch rows (the chunks, then padding rows: one padding
        token each); ``tokens`` / ``rows``: then padding tokens up to that many tokens, and logits rows up to that
        many repeating the last one (a padding token's when there is no chunk)."""
        bs = self.block_size
        ids, pos, qseq, slots, last = [], [], [], [], []
        table = torch.zeros(n_seq, self.max_blocks, dtype=torch.int32)
        entries = {r: torch.zeros(n_seq, self.max_entry_blocks, dtype=torch.int32) for r in self.rates}
        lens = torch.zeros(n_seq, dtype=torch.int32)
        state = torch.zeros(n_seq, dtype=torch.int32)
        for b, c in enumerate(chunks):
            end = c.start + len(c.tokens)
            if len(c.blocks) > self.max_blocks or end > len(c.blocks) * bs or not c.tokens:
                raise ValueError(f"chunk {b}: needs 1+ tokens and blocks for positions < {end} (block size {bs}), "
                                 f"at most {self.max_blocks} blocks; got {len(c.tokens)} tokens, {len(c.blocks)} blocks")
            table[b, :len(c.blocks)] = torch.tensor(list(c.blocks), dtype=torch.int32)
            for r in self.rates:
                eb = list(c.entry_blocks.get(r, ()))
                if len(eb) > self.max_entry_blocks or (end // r) > len(eb) * bs:
                    raise ValueError(f"chunk {b}: entry_blocks[{r}] must hold {end // r} entries in at most "
                                     f"{self.max_entry_blocks} blocks, got {len(eb)} blocks")
                entries[r][b, :len(eb)] = torch.tensor(eb, dtype=torch.int32)
            lens[b], state[b] = end, c.state_slot
            for i, t in enumerate(c.tokens):
                p = c.start + i
                ids.append(t), pos.append(p), qseq.append(b), slots.append(int(c.blocks[p // bs]) * bs + p % bs)
            last.append(len(ids) - 1)
        for _ in range(n_seq - len(chunks)):  # padding rows: one token each, reads and writes nothing
            ids.append(0), pos.append(0), qseq.append(-1), slots.append(-1), last.append(len(ids) - 1)
        for _ in range((tokens or 0) - len(ids)):  # padding tokens of no sequence: read and write nothing
            ids.append(0), pos.append(0), qseq.append(-1), slots.append(-1)
        last += [last[-1] if last else 0] * ((rows or 0) - len(last))
        out = dict(input_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(pos, dtype=torch.int32),
                   query_seq=torch.tensor(qseq, dtype=torch.int32), seq_lens=lens, block_table=table,
                   slot_mapping=torch.tensor(slots, dtype=torch.long), state_slot=state,
                   logits_indices=torch.tensor(last, dtype=torch.long))
        out.update({f"entry_{r}": t for r, t in entries.items()})
        return out

    @staticmethod
    def _step(v: dict[str, Tensor], rates: Sequence[int], num_rows: int) -> StepInputs:
        meta = V4Metadata(v["query_seq"], v["seq_lens"], v["block_table"], v["slot_mapping"], v["state_slot"],
                          {r: v[f"entry_{r}"] for r in rates}, v["logits_indices"])
        return StepInputs(v["input_ids"], v["positions"], meta, num_rows)

    def build(self, decode: Sequence[V4Chunk], prefill: Sequence[V4Chunk] = (), *,
              decode_batch: int | None = None, tokens: int | None = None, rows: int | None = None) -> StepInputs:
        """A step of ``decode`` chunks (one token each) then ``prefill`` chunks. With ``decode_batch`` (decode
        only) it is padded to that many rows and written into the persistent buffers. ``tokens`` / ``rows`` (not
        with ``decode_batch``) pad a fresh step to exactly that many tokens and logits rows, as data-parallel
        attention groups pad their steps to one shape (:mod:`mla_compile.serving.dp_sync`): padding tokens of no
        sequence at the end, the extra logits rows repeating the last one; a step of no chunk keeps one padding
        sequence row."""
        chunks = list(decode) + list(prefill)
        n_tokens = sum(len(c.tokens) for c in chunks)
        if n_tokens > self.max_tokens:
            raise ValueError(f"a step of {n_tokens} tokens exceeds the builder's max_tokens={self.max_tokens}")
        if tokens is not None or rows is not None:
            if decode_batch is not None:
                raise ValueError("tokens= / rows= pad a fresh step; a decode_batch step pads its rows itself")
            n_seq = max(len(chunks), 1)
            need = (n_tokens + n_seq - len(chunks), n_seq)
            if (tokens or need[0]) < need[0] or (rows or need[1]) < need[1] or (tokens or 0) > self.max_tokens:
                raise ValueError(f"tokens={tokens} / rows={rows}: a step of these chunks needs at least {need[0]} "
                                 f"tokens and {need[1]} rows, at most max_tokens={self.max_tokens} tokens")
            host = self._host(chunks, n_seq, tokens, rows)
            return self._step({k: t.to(self.device) for k, t in host.items()}, self.rates, len(chunks))
        if decode_batch is None or prefill:
            return self._step({k: t.to(self.device) for k, t in self._host(chunks, len(chunks)).items()},
                              self.rates, len(chunks))
        if not max(len(decode), 1) <= decode_batch <= self.max_batch:
            raise ValueError(f"decode_batch must be in [{len(decode)}, {self.max_batch}], got {decode_batch}")
        if any(len(c.tokens) != 1 for c in decode):
            raise ValueError("a padded decode step takes one token per sequence")
        host = self._host(decode, decode_batch)
        views = {}
        for k, t in host.items():
            view = self._buf[k][:decode_batch]
            view.copy_(t, non_blocking=True)
            views[k] = view
        return self._step(views, self.rates, len(decode))

    def padding_decode(self, batch: int) -> StepInputs:
        """A decode step of ``batch`` padding rows (for graph capture): the views later steps of ``batch`` reuse."""
        if not self.min_batch <= batch <= self.max_batch:
            raise ValueError(f"batch must be in [{self.min_batch}, {self.max_batch}], got {batch}")
        return self.build((), decode_batch=batch)
