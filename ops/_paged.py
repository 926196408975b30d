"""Helpers for paged caches shared by the fp8-cache, sparse-index and sparse-decode references.

All of them are plain torch and sync-free: sizes come from shapes, never from tensor data.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_range
from mla_compile.ops._ragged import segments


def scatter_rows(cache: Tensor, slot_mapping: Tensor, rows: Tensor) -> None:
    """``cache[slot // bs, slot % bs] = rows[t]`` for every ``slot_mapping[t] != -1``, with no host sync.

    ``rows [T, W]`` already has the cache's dtype. Padding rows are pointed at the first real row's
    slot with that row's value (so every duplicate write is identical), or, when all rows are padding,
    at slot 0 with the value it already holds.
    """
    if rows.shape[0] == 0:
        return
    block_size = cache.shape[1]
    slots = slot_mapping.long()
    valid = slots >= 0
    first = torch.argmax(valid.to(torch.int32)).view(1)  # index_select, not slots[first]: a 0-d tensor
    any_valid = valid.any()                                # index is read on the host (a sync)
    picked = slots.index_select(0, first)
    pad_slot = torch.where(any_valid, picked, torch.zeros_like(picked))
    pad_row = torch.where(any_valid, rows.index_select(0, first), cache[0, 0])
    target = torch.where(valid, slots, pad_slot)
    values = torch.where(valid[:, None], rows, pad_row)
    cache.index_put_((target // block_size, target % block_size), values)


def decode_shape(q4: Tensor, kv_cache: Tensor, block_table: Tensor, kv_lora_rank: int) -> tuple:
    """A paged decode call's ``shape()`` for :func:`~mla_compile.ops.select.resolve`: ``(heads, (kv_lora_rank,
    rope dims), s_q, None, capacity)`` of ``q4 [B, s_q, H, D]``, capacity = the block table's width times the page
    size (the most tokens a sequence can hold; an IndexError for a malformed call, which the caller's
    validation then names)."""
    return (q4.shape[2], (kv_lora_rank, q4.shape[3] - kv_lora_rank), q4.shape[1], None,
            block_table.shape[1] * kv_cache.shape[1])


def sequence_slots(block_table: Tensor, seq_lens: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Physical slots ``[B, L]`` (int64, 0 where invalid) of every position of every sequence,
    the validity mask ``pos < seq_lens[b]`` ``[B, L]`` and the positions ``[L]`` (L = max_blocks * block_size)."""
    L = block_table.shape[1] * block_size
    pos = torch.arange(L, device=block_table.device)
    valid = pos[None, :] < seq_lens[:, None].long()
    blocks = torch.where(valid, block_table.long()[:, pos // block_size], 0)
    return torch.where(valid, blocks * block_size + (pos % block_size)[None, :], 0), valid, pos


def attend(q: Tensor, rows: Tensor, visible: Tensor, scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Masked softmax attention in ``rows``' dtype (float32 or float64).

    ``q [B, s_q, H, D]``; ``rows [B, s_q or 1, L, D]`` (zero where not visible, so nothing NaN leaks);
    ``visible [B, s_q, L]`` bool. The values are ``rows[..., :kv_lora_rank]``. Returns ``out
    [B, s_q, H, kv_lora_rank]`` (q's dtype) and ``lse [B, s_q, H]`` (float32, natural log); a query that
    sees nothing gets 0 and -inf.
    """
    B, s_q, H, D = q.shape
    rows = rows.expand(B, s_q, rows.shape[2], D)
    scores = torch.einsum("bqhd,bqld->bqhl", q.to(rows.dtype), rows) * scale
    vis = visible[:, :, None, :]
    scores = scores.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.where(vis, torch.exp(scores - lse[..., None]), 0.0)
    out = torch.einsum("bqhl,bqld->bqhd", probs, rows[..., :kv_lora_rank])
    return out.to(q.dtype).contiguous(), lse.to(torch.float32).contiguous()


def check_paged_data(op: str, block_table: Tensor, seq_lens: Tensor, block_size: int, num_blocks: int | None) -> None:
    """Data checks (sync): ``seq_lens`` fit the table; block ids of used blocks lie in ``[0, num_blocks)``.

    With ``num_blocks`` None (no cache argument to size against) only negative ids are refused.
    """
    capacity = block_table.shape[1] * block_size
    check_range(op, "seq_lens", seq_lens, 0, capacity + 1, what=f"at most max_blocks * block_size = {capacity}")
    pos = torch.arange(capacity, device=seq_lens.device)
    used = (pos[None, :] < seq_lens[:, None].long())[:, ::block_size]
    high = 2**62 if num_blocks is None else num_blocks
    what = "block ids of used blocks" + ("" if num_blocks is None else f", num_blocks = {num_blocks}")
    check_range(op, "block_table", block_table[used], 0, high, what=what)


def ragged_rows(block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor, n_rows: int,
                block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Cache coordinates of ``n_rows`` ragged workspace rows: row ``cu_seqlens[i] + j`` is position
    ``seq_starts[i] + j`` of sequence i. Returns ``(block ids, offsets, live)`` (``[n_rows]`` each; rows
    past ``cu_seqlens[-1]`` are not live and point at block 0, offset 0). Needs at least one sequence."""
    n_seq = block_table.shape[0]
    seq, loc = segments(cu_seqlens, n_rows)
    live = seq < n_seq
    s = seq.clamp(max=n_seq - 1)
    pos = torch.where(live, seq_starts.long()[s] + loc, 0)
    blocks = torch.where(live, block_table.long()[s, (pos // block_size).clamp(max=block_table.shape[1] - 1)], 0)
    return blocks, pos % block_size, live
