"""Independent references for the fp8-cache and sparse-MLA ops, and the builders their tests share.

The e4m3 encoder searches the table of all 256 codes (no float8 cast); the indexers and the sparse
attention loop in Python over sequences, tokens and slots. Unwritten fp8 rows are 0xFF bytes, which
read back as NaN in every field (e4m3 0xFF, float32 and bfloat16 all-ones are NaN).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .ref64 import F64, NEG_INF, Paged, randn

GROUP = 128
POISON = 0xFF


# ---------------------------------------------------------------------------------------------- e4m3

def _e4m3_table() -> tuple[Tensor, Tensor]:
    """Finite non-negative e4m3fn values (sorted, float64) and their codes, from the bit patterns."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN; 0x80.. are the negatives
    return codes.view(torch.float8_e4m3fn).to(F64), codes


E4M3_VALUES, E4M3_CODES = _e4m3_table()


def e4m3_encode(x: Tensor) -> Tensor:
    """Round-to-nearest-even e4m3fn codes (uint8) of float64 ``x`` with ``|x| <= 448``, by table search."""
    mag = x.abs().flatten()
    hi = torch.searchsorted(E4M3_VALUES, mag).clamp(max=len(E4M3_VALUES) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - E4M3_VALUES[lo], E4M3_VALUES[hi] - mag
    # ties go to the even code (mantissa LSB 0)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (E4M3_CODES[hi] % 2 == 0))
    code = torch.where(pick_hi, E4M3_CODES[hi], E4M3_CODES[lo])
    sign = torch.signbit(x.flatten()).to(torch.uint8) * 0x80  # -0 and negatives that round to 0 keep the sign
    return (code | sign).reshape(x.shape)


def fp8_expected_rows(latent: Tensor, k_pe: Tensor) -> Tensor:
    """uint8 rows ``[n, W]`` of tokens ``latent [n, Dc]``, ``k_pe [n, Dr]`` from the documented formulas:
    table-searched e4m3 codes of ``x / s_g`` (float32 division), float32 scales, bf16 rope, concatenated."""
    n, Dc = latent.shape
    groups = latent.float().reshape(n, Dc // GROUP, GROUP)
    scale = torch.clamp_min(groups.abs().amax(dim=-1) / 448.0, 2.0 ** -64)
    quotient = (groups / scale[..., None]).clamp(-448.0, 448.0)
    codes = e4m3_encode(quotient.to(F64)).reshape(n, Dc)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return torch.cat([codes, scale.contiguous().view(torch.uint8), rope], dim=1)


def poisoned_fp8_cache(num_blocks: int, block_size: int, width: int) -> Tensor:
    return torch.full((num_blocks, block_size, width), POISON, dtype=torch.uint8)


def fill_fp8_cache(layout: Paged, rank: int, rope: int, gen: torch.Generator,
                   latent_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """A poisoned fp8 cache whose rows of every sequence's tokens ``< seq_len`` hold quantized random data."""
    width = rank + rank // 32 + 2 * rope
    cache = poisoned_fp8_cache(layout.num_blocks, layout.block_size, width)
    for b, n_tok in enumerate(layout.seq_lens):
        latent, k_pe = randn(gen, n_tok, rank, dtype=latent_dtype), randn(gen, n_tok, rope, dtype=latent_dtype)
        rows = fp8_expected_rows(latent, k_pe)
        for p in range(n_tok):
            cache[layout.where(b, p)] = rows[p]
    return cache


def dequantize64(cache: Tensor, rank: int) -> Tensor:
    """Float64 ``[..., rank + rope]`` of fp8 rows ``[..., W]``, field by field (NaN where the bytes are poison)."""
    flat = cache.reshape(-1, cache.shape[-1])
    G = rank // GROUP
    codes = flat[:, :rank].contiguous().view(torch.float8_e4m3fn).to(F64)
    scales = flat[:, rank:rank + 4 * G].contiguous().view(torch.float32).to(F64)
    k_pe = flat[:, rank + 4 * G:].contiguous().view(torch.bfloat16).to(F64)
    # the format dequantizes in float32: the exact float64 product rounded once to float32
    latent = (codes.reshape(-1, G, GROUP) * scales[..., None]).reshape(-1, rank).float().to(F64)
    return torch.cat([latent, k_pe], dim=1).reshape(*cache.shape[:-1], -1)


# ---------------------------------------------------------------------------------------------- indexers

def sink_window_ref(layout: Paged, sink: int, window: int) -> list[list[int]]:
    """Per sequence: the physical slots of positions ``[0, sink) U [L - window, L)`` in position order."""
    result = []
    for b, n_tok in enumerate(layout.seq_lens):
        positions = sorted(set(range(min(sink, n_tok))) | set(range(max(n_tok - window, 0), n_tok)))
        result.append([layout.where(b, p)[0] * layout.block_size + layout.where(b, p)[1] for p in positions])
    return result


def lightning_ref(q_idx: Tensor, weights: Tensor, k_cache: Tensor, layout: Paged, query_seq: list[int],
                  query_pos: list[int], topk: int) -> list[list[int]]:
    """Per query token: the top-``topk`` slots by (score desc, position asc) over visible positions, -1 padded."""
    q64, w64, k64 = (x.detach().to(F64) for x in (q_idx, weights, k_cache))
    result = []
    for t, (b, qp) in enumerate(zip(query_seq, query_pos)):
        chosen: list[int] = []
        if b >= 0:
            scored = []
            for p in range(min(qp + 1, layout.seq_lens[b])):
                blk, off = layout.where(b, p)
                score = sum(float(w64[t, h]) * max(float(q64[t, h] @ k64[blk, off]), 0.0) for h in range(q64.shape[1]))
                scored.append((-score, p, blk * layout.block_size + off))
            chosen = [slot for _, _, slot in sorted(scored)[:topk]]
        result.append(chosen + [-1] * (topk - len(chosen)))
    return result


# ---------------------------------------------------------------------------------------------- sparse attention

def sparse_decode_ref64(q: Tensor, rows: Tensor, slots: list[list[list[int]]], scale: float,
                        rank: int) -> tuple[Tensor, Tensor]:
    """Float64 attention of ``q [B, s_q, H, D]`` over ``rows [num_slots, D]`` at each query's listed slots
    (-1 skipped). Returns ``out [B, s_q, H, rank]`` and ``lse [B, s_q, H]``; no slot: 0 and -inf."""
    q64, r64 = q.detach().to(F64), rows.detach().to(F64)
    B, s_q, H, _ = q.shape
    out = torch.zeros(B, s_q, H, rank, dtype=F64)
    lse = torch.full((B, s_q, H), NEG_INF, dtype=F64)
    for b in range(B):
        for i in range(s_q):
            listed = [s for s in slots[b][i] if s != -1]
            if not listed:
                continue
            keys = r64[listed]
            for h in range(H):
                scores = (keys @ q64[b, i, h]) * scale
                m = float(scores.max())
                weights = torch.exp(scores - m)
                total = float(weights.sum())
                out[b, i, h] = (weights @ keys[:, :rank]) / total
                lse[b, i, h] = m + math.log(total)
    return out, lse
