"""Triton ``mla::lightning_index``: the V3.2 indexer scores in one kernel, then the top-k and the slot translation.

The kernel writes ``scores float32 [T, L]`` (L = max_blocks * block_size): ``score(t, j) = sum_h
weights[t, h] * relu(q_idx[t, h] . k_idx[j])`` for the positions ``j <= query_pos[t]``, ``j < seq_len``
of query t's sequence, -inf elsewhere (padding tokens: every position). One program scores BLOCK_N
positions of one query token as one ``[heads, d] x [d, BLOCK_N]`` dot, for ``TILES`` consecutive tiles
(q and the weights loaded once); tiles past the visible range load nothing. fp8 index rows are read
in-kernel: the e4m3 codes go into the dot (exact in bf16/fp16) and each key's float32 scale multiplies
its column afterwards (scales are positive, so relu commutes).
Half-precision queries over a half cache of the same dtype (or fp8) use the tensor cores with float32
accumulation; everything else runs an IEEE float32 dot.

The slot translation is the reference's own helper (``positions_to_slots`` in ``mla_compile.ops.sparse_index``).
The top-k: for a static ``L <= TOPK_ANY_L`` at any row count (and up to ``TOPK_MAX_L`` at a few static rows), one
program a query sorts the row's ``select_topk`` keys (the score's order-preserving bits above the reversed position:
unique, so equal scores resolve exactly as there) with Triton's bitonic top-k in registers, in place of
``torch.topk``'s radix select and its sort of the k winners; other rows use ``select_topk`` itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.sparse_index import positions_to_slots, select_topk, validate_lightning
from mla_compile.ops.triton._common import last_dim_contiguous, pow2

_HALF = (torch.float16, torch.bfloat16)
TOPK_MAX_L = 4096  # the longest static row the in-register top-k sorts (int64 keys: 8 a thread at 16 warps)
# Rows of at most TOPK_ANY_L take it at any row count, a symbolic one too (2-6x faster than torch.topk from 1 to 16384
# rows); longer ones only at a static T <= TOPK_MAX_T (at 4096 entries it equals torch.topk there and, at 16 warps,
# loses from ~1024 rows; BENCHMARKS.md, sixtieth session)
TOPK_ANY_L = 2048
TOPK_MAX_T = 8


@triton.jit
def _topk_positions_kernel(s_ptr, o_ptr, L, K, s_s, s_o, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row t's top-K positions of ``scores`` by ``select_topk``'s keys, in its order (descending key)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK_L)
    ok = pos < L
    s = tl.load(s_ptr + t * s_s + pos, mask=ok, other=0.0)
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)  # -0.0 -> +0.0: they tie
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float value
    ordered = tl.where(ok, ordered, -2147483648).to(tl.int64)  # past L: below every real key
    low = tl.where(ok, L - 1 - pos, 0).to(tl.int64)  # equal scores: the lower position has the larger key
    top = tl.topk(ordered * 4294967296 + low, BLOCK_K)
    offs = tl.arange(0, BLOCK_K)
    tl.store(o_ptr + t * s_o + offs, (L - 1) - (top & 0xFFFFFFFF), mask=offs < K)


def kernel_sorts(T, L) -> bool:
    """Whether :func:`topk_positions` sorts ``T`` rows of ``L`` scores in the kernel: a static ``0 < L <= TOPK_ANY_L``
    at any ``T``, or a static ``L <= TOPK_MAX_L`` at a static ``T <= TOPK_MAX_T``. Never compares a symbolic size."""
    if not isinstance(L, int) or L == 0:
        return False
    return L <= TOPK_ANY_L or (L <= TOPK_MAX_L and isinstance(T, int) and T <= TOPK_MAX_T)


def topk_positions(scores: Tensor, topk: int, *, num_warps: int | None = None) -> Tensor:
    """:func:`~mla_compile.ops.sparse_index.select_topk` of float32 ``scores [T, L]``: the kernel above (one program a
    row; the interpreter on CPU tensors too) where :func:`kernel_sorts`, else ``select_topk``. No guard on a symbolic
    size."""
    T, L = scores.shape
    if scores.dtype != torch.float32 or not kernel_sorts(T, L):
        return select_topk(scores, topk)
    k = min(topk, L)
    out = torch.empty((T, k), dtype=torch.int64, device=scores.device)
    if isinstance(T, int) and T == 0:
        return out
    wrap_triton(_topk_positions_kernel)[(T,)](scores, out, L, k, scores.stride(0), out.stride(0),
                                             BLOCK_L=pow2(L), BLOCK_K=pow2(k),
                                             num_warps=num_warps or (16 if L > 1024 else 8))
    return out


@triton.jit
def _lightning_score_kernel(
    q_ptr, w_ptr, cache_ptr, table_ptr, lens_ptr, qseq_ptr, qpos_ptr, out_ptr,
    H, L,
    s_qt, s_qh, s_wt, s_wh, s_cb, s_ct, s_bt, s_ot,
    D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, FP8: tl.constexpr, HALF: tl.constexpr,
    PAGE_TILES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * (BLOCK_N * TILES)
    seq = tl.load(qseq_ptr + t).to(tl.int64)
    live = seq >= 0
    seq = tl.where(live, seq, 0)
    limit = tl.minimum(tl.load(lens_ptr + seq).to(tl.int64), tl.load(qpos_ptr + t).to(tl.int64) + 1)
    limit = tl.where(live, limit, 0)  # visible positions: [0, limit)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if PAGE_TILES:  # D == BLOCK_D (the launch checks): row masks only
        d_ok = tl.full([BLOCK_D], 1, tl.int1)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    any_vis = first < limit  # nothing to load past the visible range
    q = tl.load(q_ptr + t * s_qt + offs_h[:, None] * s_qh + offs_d[None, :],
                mask=(h_ok & any_vis)[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + t * s_wt + offs_h * s_wh, mask=h_ok & any_vis, other=0.0).to(tl.float32)
    for i in range(TILES):  # q and w are loaded once for TILES tiles
        n0 = first + i * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        vis = offs_n < limit
        scores = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if n0 < limit:
            if PAGE_TILES:  # the tile lies in one page: one block-table entry, affine rows
                blk = tl.load(table_ptr + seq * s_bt + n0 // BLOCK_SIZE).to(tl.int64)
                row = cache_ptr + blk * s_cb + ((n0 % BLOCK_SIZE) + tl.arange(0, BLOCK_N)).to(tl.int64) * s_ct
            else:
                blk = tl.load(table_ptr + seq * s_bt + offs_n // BLOCK_SIZE, mask=vis, other=0).to(tl.int64)
                row = cache_ptr + blk * s_cb + (offs_n % BLOCK_SIZE) * s_ct
            kmask = vis[:, None] & d_ok[None, :]
            if FP8:
                codes = tl.load(row[:, None] + offs_d[None, :], mask=kmask, other=0)
                k = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                b = tl.arange(0, 4)
                sb = tl.load(row[:, None] + D + b[None, :], mask=vis[:, None], other=0).to(tl.int32)
                scale = tl.sum(sb << (8 * b)[None, :], axis=1).to(tl.float32, bitcast=True)  # little-endian float32
            else:
                k = tl.load(row[:, None] + offs_d[None, :], mask=kmask, other=0.0)
            if HALF:
                logits = tl.dot(q, tl.trans(k.to(q.dtype)))
            else:
                logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            if FP8:
                logits = logits * scale[None, :]
            s = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
            scores = tl.where(vis, s, float("-inf"))
        tl.store(out_ptr + t * s_ot + offs_n, scores, mask=offs_n < L)


def lightning_scores(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                     query_seq: Tensor, query_pos: Tensor, block_n: int = 64, out: Tensor | None = None) -> Tensor:
    """The kernel's ``scores float32 [T, max_blocks * block_size]`` (-inf where not visible), written into
    ``out`` when given (contiguous); any device under the interpreter. Needs ``block_table.shape[0] > 0``."""
    T, H, d = q_idx.shape
    bs = k_idx_cache.shape[1]
    L = block_table.shape[1] * bs
    if out is None:
        scores = torch.empty((T, L), dtype=torch.float32, device=q_idx.device)
    else:
        assert out.shape == (T, L) and out.dtype == torch.float32 and out.is_contiguous()
        scores = out
    if T == 0 or L == 0:
        return scores
    if k_idx_cache.stride(-1) != 1:
        raise ValueError(f"mla.lightning_index (triton): k_idx_cache needs a unit stride in its last dim, got "
                         f"strides {tuple(k_idx_cache.stride())}; allocate it contiguous or use backend='reference'")
    q_idx, block_table = last_dim_contiguous(q_idx), last_dim_contiguous(block_table)
    fp8 = k_idx_cache.dtype == torch.uint8
    half = q_idx.dtype in _HALF and (fp8 or k_idx_cache.dtype == q_idx.dtype)
    # a few tiles per program (q and w loaded once), keeping >= 16 programs per query (a symbolic L, from
    # a dynamic block table under torch.compile, keeps one tile: no guard); tiles inside one page when
    # block_n divides the block size (affine rows, one block-table entry per tile)
    tiles = max(1, min(8, L // (16 * block_n))) if isinstance(L, int) else 1
    page_tiles = bs % block_n == 0 and pow2(d) == d
    grid = (T, triton.cdiv(L, block_n * tiles))
    wrap_triton(_lightning_score_kernel)[grid](
        q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos, scores,
        H, L,
        q_idx.stride(0), q_idx.stride(1), weights.stride(0), weights.stride(1),
        k_idx_cache.stride(0), k_idx_cache.stride(1), block_table.stride(0), scores.stride(0),
        D=d, BLOCK_SIZE=bs, BLOCK_H=pow2(H), BLOCK_D=pow2(d), BLOCK_N=block_n, TILES=tiles, FP8=fp8, HALF=half,
        PAGE_TILES=page_tiles, num_warps=4,
    )
    return scores


def _launch(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
            query_seq: Tensor, query_pos: Tensor, topk: int, block_n: int = 64) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too): ``indices int32 [T, topk]`` as the reference op."""
    T = q_idx.shape[0]
    if block_table.shape[0] == 0:  # no sequences: every token is padding
        return torch.full((T, topk), -1, dtype=torch.int32, device=q_idx.device)
    scores = lightning_scores(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos, block_n)
    return positions_to_slots(topk_positions(scores, topk), block_table, seq_lens, query_seq, query_pos,
                              k_idx_cache.shape[1], topk)


@triton_op("mla::lightning_index_triton", mutates_args=())
def lightning_index_triton(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                           query_seq: Tensor, query_pos: Tensor, topk: int) -> Tensor:
    """Triton ``mla::lightning_index`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    if q_idx.device.type != "cuda" or torch.float64 in (q_idx.dtype, weights.dtype, k_idx_cache.dtype):
        return torch.ops.mla.lightning_index_ref(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq,
                                                 query_pos, topk)
    validate_lightning(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos, topk)
    return _launch(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos, topk)
