"""Input builders for the fp8-cache and sparse-decode kernel tests (interpreter and CUDA; not a test module).

fp8 caches are poisoned with 0xFF bytes (NaN in every field) wherever no token was written; block
tables are shuffled and their unused entries hold a huge invalid id that must never be read.
"""

from __future__ import annotations

import torch

from _triton_test_util import BAD_BLOCK, shuffled_table
from mla_compile.ops import lightning_index, sink_window_indices
from mla_compile.ops.fp8_cache import quantize_fp8_rows

POISON = 0xFF


def lens_with_empty(B: int, max_len: int, gen) -> list[int]:
    """Random sequence lengths in ``[0, max_len]``: the first is ``max_len``, the second (for B > 2) empty."""
    lens = torch.randint(0, max_len + 1, (B,), generator=gen)
    lens[0] = max_len
    if B > 2:
        lens[1] = 0
    return lens.tolist()


def fp8_width(dc: int, dr: int) -> int:
    return dc + dc // 32 + 2 * dr


def fp8_paged(lens, bs, dc, dr, device, gen, spare=3, table_cols=None):
    """``(cache uint8 [nb, bs, W], table int32 [B, cols], seq_lens int32 [B], rows float32 [nb, bs, dc + dr])``.

    Used positions hold quantized N(0, 1) bf16 tokens; ``rows`` holds the unquantized values (NaN elsewhere)
    for comparisons against the bf16 path.
    """
    table, nb, blocks, offs = shuffled_table(lens, bs, gen, spare, cols=table_cols)
    cache = torch.full((nb, bs, fp8_width(dc, dr)), POISON, dtype=torch.uint8)
    rows = torch.full((nb, bs, dc + dr), float("nan"))
    n = blocks.numel()
    lat = torch.randn(n, dc, generator=gen).bfloat16()
    kpe = torch.randn(n, dr, generator=gen).bfloat16()
    cache[blocks, offs] = quantize_fp8_rows(lat, kpe)
    rows[blocks, offs] = torch.cat([lat, kpe], 1).float()
    return (cache.to(device), table.to(device), torch.tensor(lens, dtype=torch.int32, device=device),
            rows.to(device))


def float_paged(lens, bs, D, dtype, device, gen, spare=3):
    """A NaN-poisoned float cache ``[nb, bs, D]`` with N(0, 1) rows at used positions, table, seq_lens."""
    table, nb, blocks, offs = shuffled_table(lens, bs, gen, spare)
    cache = torch.full((nb, bs, D), float("nan"), dtype=dtype)
    cache[blocks, offs] = torch.randn(blocks.numel(), D, generator=gen).to(dtype)
    return cache.to(device), table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def window_indices(table, seq_lens, bs, sink, window, max_kv):
    """``[B, 1, max_kv]`` int32 slots of the sink + sliding-window indexer (the reference op), -1 padded."""
    idx, _ = sink_window_indices(table, seq_lens, block_size=bs, sink=sink, window=window, max_kv=max_kv,
                                 backend="reference")
    return idx[:, None]


def topk_indices(table, seq_lens, bs, s_q, topk, gen, d_idx=32, heads=4):
    """``[B, s_q, topk]`` int32 slots from the lightning indexer (reference op) on a random index-key cache:
    query i of sequence b sees positions ``<= seq_len - s_q + i``; columns shuffled so -1 sits anywhere."""
    device = table.device
    B = table.shape[0]
    nb = int(table[table < BAD_BLOCK].max()) + 1 if B else 1
    k_idx = torch.randn(nb, bs, d_idx, generator=gen).bfloat16().to(device)
    q_idx = torch.randn(B * s_q, heads, d_idx, generator=gen).bfloat16().to(device)
    w = torch.rand(B * s_q, heads, generator=gen).to(device)
    seq = torch.arange(B, device=device).repeat_interleave(s_q)
    pos = seq_lens.long().repeat_interleave(s_q) - s_q + torch.arange(s_q, device=device).repeat(B)
    seq = torch.where(pos >= 0, seq, -1)  # a query before position 0 sees nothing: a padding token, all -1
    pos = pos.clamp(min=0)
    lens = seq_lens
    safe_table = torch.where(table >= BAD_BLOCK, 0, table)  # the indexer's table must hold real ids
    idx = lightning_index(q_idx, w, k_idx, safe_table, lens, seq.to(torch.int32), pos.to(torch.int32), topk=topk,
                          backend="reference")
    perm = torch.argsort(torch.rand(idx.shape, generator=gen), dim=1).to(device)
    return torch.gather(idx, 1, perm).view(B, s_q, topk).to(torch.int32)
