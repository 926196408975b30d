"""An sm_90 Gluon sparse decode over the 656-byte fp8 (or the bf16) latent cache (``mla::sparse_decode``), 64 heads
a program.

The sparse twin of ``fp8_decode_gluon64`` (dense fp8 decode): the same shared memory (``Q [64, 576]`` bf16 once,
two bf16 tile slots ``K [64 keys, 576]`` and ``P [64, 64]`` with the 128-byte swizzle ``wgmma`` reads: 224 KB),
the same dequantization (``bf16(float32(e4m3 code) * scale)``, the rope as it is: one bf16 rounding of each key /
value element, relative ``2**-9``, as FlashMLA's fp8 kernels) and the same S / online softmax / P V pipeline over
8 warps (two warpgroups, ``O [64, 512]`` fp32 in registers, asynchronous ``wgmma``; the running maxima exchanged
across warpgroups through a ``[64, 2]`` buffer and raised only past ``TAU``: ``fp8_decode_gluon64``'s
``MAX_XCHG`` and ``RESCALE_SKIP``, on by default here; its opt-in ``CVT_BF16`` bf16x2 dequantization too;
and, on by default here alone, ``FOLD_SCALE``: a positive softmax scale folded into the exponent's FMA).
What differs is the loader:

- a program owns 64 heads of one query ``(b, i)`` (grid ``(cdiv(H, 64), splits, B * s_q)``; heads past ``H`` are
  zero rows, never stored) and one split of the query's index list ``indices[b, i, :]`` (``topk`` slots, 64 a
  tile): the 64 keys of a tile are arbitrary cache rows, so each thread loads its key's slot (``-1``, or anything
  outside ``[0, num_blocks * block_size)``, marks an invalid key) and its row ``(slot // BS, slot % BS)`` with
  16-byte loads (codes, scales, rope), one key a thread as in ``fp8_decode_gluon64``; invalid keys load as zeros
  (no byte of their rows is read: unwritten rows may hold NaN) and their scores are set to ``-inf``;
- the slots of tiles ``j + 2 .. j + 4`` are held in registers (one int32 each a thread), tile ``j + 5``'s are
  loaded during tile ``j``'s dots, tile ``j + 4``'s rows are sent toward L2 (``cp.async.bulk.prefetch.L2``, one
  per row) and tile ``j + 2``'s codes loaded into registers while the dots run, then dequantized into the slot
  ``P_j V_j`` released, as the dense kernel does with its pages;
- the validity of tile ``j + 1``'s keys in the score layout is reloaded (an L1 hit) while ``Q K_{j+1}^T`` runs;
- ``ROPE_ASYNC`` (off by default: slower on the H200 at 16 and 128 heads, BENCHMARKS run 132): tile ``j + 2``'s
  rope goes straight into slot j's rope buffer with ``cp.async`` as soon as the CTA barrier after ``P_j`` shows
  ``S_j`` done in both warpgroups (``P_j V_j`` reads the latent only), waited for one step later, so no rope load
  sits between ``P_j V_j`` and the dequantization. Every copy group is waited for before the program exits.

A bf16 cache (``[NB, BS, 576]``, ``FP8`` False) needs no dequantization: once ``P_j V_j`` releases slot j, tile
``j + 2``'s rows are copied straight into it with ``cp.async`` (16 bytes a copy, invalid keys zero-filled, no
registers held), and the copies are waited for (this thread's; the next CTA barrier: every thread's) before the
dots that read the slot, one step later.

With 128 heads two programs read each tile (adjacent in the grid: the second mostly from L2). A row whose slots
are all invalid has LSE -inf and output 0. With one split the program writes the result (output in q's dtype,
natural-log LSE); else each split writes its normalized rows and base-2 LSE to the workspaces of
``_plan.split_buffers`` and ``decode.reduce_splits`` merges them.

Contract of :func:`launch`: what :func:`eligible` accepts (sm_90, bf16 q ``[B, s_q, H, 576]``, a uint8 fp8 cache
``[NB, BS, 656]`` or a bf16 cache ``[NB, BS, 576]`` of any block size with row and page strides multiples of 16
bytes and a 16-byte aligned base, int32 or int64 indices ``[B, s_q, topk]``). :func:`sparse_decode_gluon64`
(``mla::sparse_decode_gluon64``) runs ``mla::sparse_decode_triton`` for other calls.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.sparse_decode import validate
from mla_compile.ops.triton._bf16_tma import row_blocks_descriptor
from mla_compile.ops.triton._common import check_config, last_dim_contiguous, num_sms
from mla_compile.ops.triton._fp8_tma import opaque_zero
from mla_compile.ops.triton._gluon import (O64, Q64, S64, alloc_tiles, online_softmax, store_query_rows,
                                           store_rows, store_rows_tma)
from mla_compile.ops.triton._plan import opaque_splits, split_buffers
from mla_compile.ops.triton.decode import _LOG2E, decode_outputs, reduce_splits
from mla_compile.ops.triton.fp8_decode_gluon64 import (CODE_L, ROPE_L, SCALE_L, XCH_S, WORD_L, _CVT_BF16,
                                                       _halves, _row_max_xchg, _store_tile, _store_tile_bf16)
from mla_compile.ops.triton.fp8_decode_gluon64 import smem_bytes  # noqa: F401  (the same buffers: Q, 2 slots, P)

BLOCK_M = 64  # heads a program (wgmma's M)
BLOCK_N = 64  # keys a tile
DC, DR = 512, 64
D = DC + DR
ROW_BYTES = DC + 4 * (DC // 128) + 2 * DR  # 656
NUM_WARPS = 8
PROGRAMS_PER_SM = 1
# the kernel's flags (``launch``'s config keys, as ``fp8_decode_gluon64.VARIANTS``) and their values unless the
# config says otherwise (``CVT_BF16``: bf16x2 dequantization, fp8 scales below 2**8; fp8 cache only)
# ``ROPE_ASYNC``: an fp8 tile's rope copied into its slot with ``cp.async`` as soon as the slot's S is done;
# ``FOLD_SCALE``: the softmax scale folded into the exponent's FMA (a positive scale)
VARIANTS = ("RESCALE_SKIP", "MAX_XCHG", "CVT_BF16", "ROPE_ASYNC", "FOLD_SCALE")
DEFAULTS = {"RESCALE_SKIP": True, "MAX_XCHG": True, "CVT_BF16": False, "ROPE_ASYNC": False, "FOLD_SCALE": True}


@gluon.jit
def _tile_slots(idx_row, tile, n_tiles, start, end, n_slots, layout: gl.constexpr):
    """The int32 cache slots of tile ``tile``'s 64 keys (positions ``start + 64 tile + k`` of the index row
    ``idx_row``) in ``layout`` (a 1-D slice), ``-1`` for an invalid key: a ``-1`` entry, a slot outside
    ``[0, n_slots)``, a position at or past ``end``, any key of a tile past ``n_tiles``."""
    pos = start + tile * 64 + gl.arange(0, 64, layout)
    slot = gl.load(idx_row + pos, mask=(pos < end) & (tile < n_tiles), other=-1)
    ok = (slot >= 0) & (slot < n_slots)
    return gl.where(ok, slot, -1).to(gl.int32)


@gluon.jit
def _row_ptrs(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr):
    """The first bytes of the cache rows of ``slot`` (slot 0's for invalid keys: masked, never read)."""
    s = gl.maximum(slot, 0)
    return kv_ptr + (s // BLOCK_SIZE).to(gl.int64) * stride_kb + (s % BLOCK_SIZE).to(gl.int64) * stride_kt


@gluon.jit
def _load_codes(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr, CVT_BF16: gl.constexpr):
    """A tile's codes ``[64, 512]`` uint8 (``CODE_L``; ``CVT_BF16``: as int32 words ``[64, 128]``, ``WORD_L``, the
    same 16-byte loads) and scales ``[64, 4]`` fp32 (``SCALE_L``) from the rows of ``slot``
    (``SliceLayout(1, CODE_L)``) into registers; invalid keys read as 0."""
    row = _row_ptrs(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE)
    ok = (slot >= 0)[:, None]
    if CVT_BF16:
        words = row.to(gl.pointer_type(gl.int32))
        words = gl.convert_layout(words, gl.SliceLayout(1, WORD_L))  # the same keys a thread
        ok_w = gl.convert_layout(slot, gl.SliceLayout(1, WORD_L)) >= 0
        codes = gl.load(words[:, None] + gl.arange(0, 128, gl.SliceLayout(0, WORD_L))[None, :],
                        mask=ok_w[:, None], other=0)
    else:
        codes = gl.load(row[:, None] + gl.arange(0, 512, gl.SliceLayout(0, CODE_L))[None, :], mask=ok, other=0)
    slot = gl.convert_layout(slot, gl.SliceLayout(1, SCALE_L))  # the same keys a thread: no data movement
    row = _row_ptrs(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE)
    sc = (row + 512).to(gl.pointer_type(gl.float32))
    sc = gl.load(sc[:, None] + gl.arange(0, 4, gl.SliceLayout(0, SCALE_L))[None, :], mask=(slot >= 0)[:, None],
                 other=0.0)
    return codes, sc


@gluon.jit
def _store(kc, kr, codes, sc, rope, CVT_BF16: gl.constexpr):
    """``fp8_decode_gluon64._store_tile_bf16`` (bf16x2 dequantization of code words) under ``CVT_BF16``, else
    ``_store_tile``."""
    if CVT_BF16:
        _store_tile_bf16(kc, kr, codes, sc, rope)
    else:
        _store_tile(kc, kr, codes, sc, rope)


@gluon.jit
def _dequant_store(kc, codes, sc, CVT_BF16: gl.constexpr):
    """Dequantize a tile's codes into a slot's latent ``kc [64, 512]`` (``fp8_decode_gluon64._store_tile`` /
    ``_store_tile_bf16`` without the rope)."""
    if CVT_BF16:
        w = gl.reshape(codes, [64, 4, 32])
        hh, ll = _halves(sc)
        hh = gl.convert_layout(hh, gl.SliceLayout(2, w.type.layout))  # no data movement
        ll = gl.convert_layout(ll, gl.SliceLayout(2, w.type.layout))
        w, hh = gl.broadcast(w, hh[:, :, None])
        w, ll = gl.broadcast(w, ll[:, :, None])
        h0, h1, h2, h3 = gl.inline_asm_elementwise(
            _CVT_BF16, "=h,=h,=h,=h,r,r,r", [w, hh, ll],
            dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
        x = gl.join(gl.join(h0, h1), gl.join(h2, h3))  # [64, 4, 32, i, j]: code 2 j + i of the word
        kc.store(gl.reshape(gl.permute(x, [0, 1, 2, 4, 3]), [64, 512]))
    else:
        x = gl.reshape(codes.to(gl.float8e4nv, bitcast=True).to(gl.float32), [64, 4, 128])
        sc = gl.convert_layout(sc, gl.SliceLayout(2, x.type.layout))  # no data movement
        kc.store(gl.reshape((x * sc[:, :, None]).to(gl.bfloat16), [64, 512]))


@gluon.jit
def _copy_rope(kr, kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr, ROPE_OFF: gl.constexpr):
    """Copy the rope columns of the rows of ``slot`` (``SliceLayout(1, CODE_L)``; at element ``ROPE_OFF`` of a row
    of ``kv_ptr``'s type, bf16 there) into ``kr [64, 64]`` with ``cp.async`` (16 bytes a copy, ``ROPE_L``; invalid
    keys zero-filled) and commit them as one group."""
    slot = gl.convert_layout(slot, gl.SliceLayout(1, ROPE_L))  # the same keys a thread: no data movement
    row = (_row_ptrs(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE) + ROPE_OFF).to(gl.pointer_type(gl.bfloat16))
    cols = gl.arange(0, 64, gl.SliceLayout(0, ROPE_L))
    async_copy.async_copy_global_to_shared(kr, row[:, None] + cols[None, :], mask=(slot >= 0)[:, None])
    async_copy.commit_group()


@gluon.jit
def _load_rope(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr):
    """A tile's rope columns ``[64, 64]`` bf16 (``ROPE_L``) from the rows of ``slot``; invalid keys read as 0."""
    slot = gl.convert_layout(slot, gl.SliceLayout(1, ROPE_L))
    row = _row_ptrs(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE)
    rope = (row + 528).to(gl.pointer_type(gl.bfloat16))
    return gl.load(rope[:, None] + gl.arange(0, 64, gl.SliceLayout(0, ROPE_L))[None, :], mask=(slot >= 0)[:, None],
                   other=0.0)


def _prefetch_asm(nbytes: int) -> str:
    return f"""{{
        .reg .pred p;
        setp.ge.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], {nbytes};
        mov.u32 $0, 0;
        }}"""


_PREFETCH_FP8 = gl.constexpr(_prefetch_asm(ROW_BYTES))
_PREFETCH_BF16 = gl.constexpr(_prefetch_asm(2 * D))


@gluon.jit
def _prefetch_rows(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr, FP8: gl.constexpr):
    """Start bringing the rows of ``slot`` (``SliceLayout(1, CODE_L)``) into L2, none for invalid keys: one
    ``cp.async.bulk.prefetch.L2`` a row (656 bytes fp8, 1152 bf16; a hint: no registers held, nothing to wait
    for)."""
    row = _row_ptrs(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE).to(gl.int64, bitcast=True)
    if FP8:
        gl.inline_asm_elementwise(_PREFETCH_FP8, "=r,l,r", [row, slot], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise(_PREFETCH_BF16, "=r,l,r", [row, slot], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _copy_tile(kc, kr, kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr):
    """bf16 cache: copy the rows of ``slot`` (``SliceLayout(1, CODE_L)``) into a slot's latent ``kc [64, 512]``
    and rope ``kr [64, 64]`` with ``cp.async`` (16 bytes a copy, ``ROPE_L``: no registers held; invalid keys
    zero-filled, none of their bytes read) and commit them as one group."""
    slot = gl.convert_layout(slot, gl.SliceLayout(1, ROPE_L))  # the same keys a thread: no data movement
    row = _row_ptrs(kv_ptr, slot, stride_kb, stride_kt, BLOCK_SIZE)
    ok = (slot >= 0)[:, None]
    cols = gl.arange(0, 512, gl.SliceLayout(0, ROPE_L))
    async_copy.async_copy_global_to_shared(kc, row[:, None] + cols[None, :], mask=ok)
    cols = gl.arange(0, 64, gl.SliceLayout(0, ROPE_L))
    async_copy.async_copy_global_to_shared(kr, row[:, None] + 512 + cols[None, :], mask=ok)
    async_copy.commit_group()


@gluon.jit
def sparse_decode_gluon64_kernel(
    q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt,
    stride_ib, stride_is,
    H, S_Q, topk, n_slots, n_splits,
    DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr, FP8: gl.constexpr,
    RESCALE_SKIP: gl.constexpr = True, MAX_XCHG: gl.constexpr = True, CVT_BF16: gl.constexpr = False,
    ROPE_ASYNC: gl.constexpr = False, FOLD_SCALE: gl.constexpr = False, TMA_OUT: gl.constexpr = False, desc_o=None,
):
    """Grid ``(cdiv(H, 64), n_splits, B * S_Q)``, 8 warps; bf16 q ``[B, S_Q, H, 576]`` (last dim contiguous); the
    cache ``kv_ptr`` (``FP8``: uint8 rows of 656 bytes, else bf16 rows of 576; rows at ``stride_kt``, blocks of
    ``BLOCK_SIZE`` rows at ``stride_kb``, in elements; ``n_slots`` rows in all); the slots ``idx_ptr``
    ``[B, S_Q, topk]`` (int32 or int64, last dim contiguous). ``DIRECT`` (one split): the result into ``o_ptr``
    (``[B * S_Q * H, 512]``, q's dtype) / ``lse_ptr`` (natural log); else each split's rows into the workspaces
    ``o_ptr`` / ``lse_ptr`` (``[B * S_Q * H, n_splits, 512]`` fp32, base-2 LSE). ``RESCALE_SKIP`` / ``MAX_XCHG`` /
    ``CVT_BF16``: as ``fp8_decode_gluon64``'s variants; ``ROPE_ASYNC`` (fp8): a tile's rope copied into its slot
    with ``cp.async`` right after the CTA barrier that follows P (no register load after P V); ``FOLD_SCALE`` (a
    positive scale): the row maximum taken on the raw scores, the scale folded into ``exp2(s * c - m)``.
    ``TMA_OUT`` (``DIRECT``, every row of a program the output's; GPU-tested, not timed): ``desc_o`` spans the
    output's rows as ``[8, rows, 64]`` column blocks (box ``[8, 64, 64]``), and the rows go through the query rows'
    buffer and one TMA copy (``_gluon.store_rows_tma``)."""
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    s_l: gl.constexpr = S64
    o_l: gl.constexpr = O64
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    key_l: gl.constexpr = gl.SliceLayout(1, CODE_L)
    q_l: gl.constexpr = Q64

    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64
    pid_h = gl.program_id(0)
    pid_s = gl.program_id(1)
    bq = gl.program_id(2).to(gl.int64)  # query (b, i) = (bq // S_Q, bq % S_Q)
    b = bq // S_Q
    i = bq % S_Q
    per_split = gl.cdiv(gl.cdiv(topk, n_splits), 64) * 64
    start = pid_s * per_split
    end = gl.minimum(start + per_split, topk)
    n_tiles = gl.maximum(gl.cdiv(end - start, 64), 0)
    idx_row = idx_ptr + b * stride_ib + i * stride_is

    q_s, qr_s, kc_s, kr_s, p_s = alloc_tiles(64, DC, DR)
    if MAX_XCHG:
        mx_s = gl.allocate_shared_memory(gl.float32, [64, 2], XCH_S)

    # tiles 0 and 1 into their slots (invalid keys and tiles past n_tiles read as zeros); tiles 2 and 3 toward L2
    for t in gl.static_range(2):
        slot_t = _tile_slots(idx_row, t, n_tiles, start, end, n_slots, key_l)
        if FP8:
            codes, sc = _load_codes(kv_ptr, slot_t, stride_kb, stride_kt, BLOCK_SIZE, CVT_BF16)
            rope = _load_rope(kv_ptr, slot_t, stride_kb, stride_kt, BLOCK_SIZE)
            _store(kc_s.index(t), kr_s.index(t), codes, sc, rope, CVT_BF16)
        else:
            _copy_tile(kc_s.index(t), kr_s.index(t), kv_ptr, slot_t, stride_kb, stride_kt, BLOCK_SIZE)
    slot2 = _tile_slots(idx_row, 2, n_tiles, start, end, n_slots, key_l)  # the slots of tiles j + 2 .. j + 4
    slot3 = _tile_slots(idx_row, 3, n_tiles, start, end, n_slots, key_l)
    slot4 = _tile_slots(idx_row, 4, n_tiles, start, end, n_slots, key_l)
    _prefetch_rows(kv_ptr, slot2, stride_kb, stride_kt, BLOCK_SIZE, FP8)
    _prefetch_rows(kv_ptr, slot3, stride_kb, stride_kt, BLOCK_SIZE, FP8)

    # the query rows (heads pid_h * 64 ...), 64 columns at a time (heads past H: zeros, never stored)
    h_q = pid_h * 64 + gl.arange(0, 64, gl.SliceLayout(1, q_l))
    q_row = q_ptr + b * stride_qb + i * stride_qs + h_q.to(gl.int64) * stride_qh
    store_query_rows(q_s, qr_s, q_row, h_q, H, DC, q_l)
    if not FP8:
        async_copy.wait_group(0)  # tiles 0 and 1 landed (this thread's copies; the barrier: every thread's)
    fence_async_shared()
    gl.thread_barrier()  # the query rows and tiles 0 and 1 stored (every warp) before any wgmma reads them

    zero_s = gl.zeros([64, 64], gl.float32, s_l)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_part = gl.zeros([64, 64], gl.float32, s_l)
    o = gl.zeros([64, DC], gl.float32, o_l)

    s = zero_s
    key_ok = _tile_slots(idx_row, 0, n_tiles, start, end, n_slots, col_s) >= 0
    if n_tiles > 0:
        s = warpgroup_mma(qr_s, kr_s.index(0).permute([1, 0]), zero_s)
        s = warpgroup_mma(q_s, kc_s.index(0).permute([1, 0]), s)
    for j in range(n_tiles):
        buf = j % 2
        k_cur = kc_s.index(buf)
        # online softmax of S_j (base 2); invalid keys -inf
        # FOLD_SCALE (a positive scale): the row maximum on the raw scores, the scale folded into the exponent's
        # FMA (exp2(s * c - m)), as the prefill kernel does; else the scores scaled first
        s = gl.where(key_ok[None, :], s if FOLD_SCALE else s * scale_log2, float("-inf"))
        if MAX_XCHG:
            row_max = _row_max_xchg(s, mx_s, row_s)
        else:
            row_max = gl.max(s, axis=1)
        m_new = gl.maximum(m_i, row_max * scale_log2 if FOLD_SCALE else row_max)
        p, m_i, l_part, o = online_softmax(s, m_i, m_new, l_part, o, scale_log2, row_o, FOLD_SCALE, RESCALE_SKIP)
        p_s.store(p.to(gl.bfloat16))
        if (not FP8) or ROPE_ASYNC:
            async_copy.wait_group(0)  # tile j + 1's copies (issued last step) landed
        fence_async_shared()  # P_j and (from the last step) the dequantized tile j + 1, for the async proxy
        gl.thread_barrier()  # every warp's P rows (and tile j + 1's rows) before either warpgroup's dots
        pv = warpgroup_mma(p_s, k_cur, o, is_async=True)
        # S_{j+1} from the other slot (a dead product past the last tile: that slot holds zeros)
        qk = warpgroup_mma(qr_s, kr_s.index(1 - buf).permute([1, 0]), zero_s, is_async=True)
        qk = warpgroup_mma(q_s, kc_s.index(1 - buf).permute([1, 0]), qk, is_async=True)
        if FP8 and ROPE_ASYNC:
            # tile j + 2's rope into slot j's rope now: S_j is done in both warpgroups (the barrier above) and
            # P_j V_j reads the latent only
            _copy_rope(kr_s.index(buf), kv_ptr, slot2, stride_kb, stride_kt, BLOCK_SIZE, DC + 16)
        # while the dots run: tile j + 4 toward L2, tile j + 2 (prefetched two steps ago) into registers,
        # tile j + 5's slots
        _prefetch_rows(kv_ptr, slot4, stride_kb, stride_kt, BLOCK_SIZE, FP8)
        if FP8:
            codes, sc = _load_codes(kv_ptr, slot2, stride_kb, stride_kt, BLOCK_SIZE, CVT_BF16)
        slot5 = _tile_slots(idx_row, j + 5, n_tiles, start, end, n_slots, key_l)
        o = warpgroup_mma_wait(2, deps=[pv])
        gl.thread_barrier()  # both warpgroups done with slot j and P
        # tile j + 2 into slot j while S_{j+1} runs (its rope loaded now: registers are short during P V)
        if FP8:
            if ROPE_ASYNC:
                _dequant_store(k_cur, codes, sc, CVT_BF16)
            else:
                rope = _load_rope(kv_ptr, slot2, stride_kb, stride_kt, BLOCK_SIZE)
                _store(k_cur, kr_s.index(buf), codes, sc, rope, CVT_BF16)
        else:
            _copy_tile(k_cur, kr_s.index(buf), kv_ptr, slot2, stride_kb, stride_kt, BLOCK_SIZE)
        key_ok = _tile_slots(idx_row, j + 1, n_tiles, start, end, n_slots, col_s) >= 0
        slot2 = slot3
        slot3 = slot4
        slot4 = slot5
        s = warpgroup_mma_wait(0, deps=[qk])

    if (not FP8) or ROPE_ASYNC:
        async_copy.wait_group(0)  # the last step's copies (of tiles past the end: zero-filled) before the CTA exits
    l_i = gl.sum(l_part, axis=1)
    # the program's rows and split again (an opaque zero: recomputed here, not held in registers across the loop)
    z = opaque_zero(n_tiles)
    rows = (gl.program_id(0) + z) * 64 + gl.arange(0, 64, row_s)
    row_ok = rows < H
    bq = gl.program_id(2).to(gl.int64) + z
    pid_s = gl.program_id(1) + z
    if TMA_OUT:
        store_rows_tma(o, l_i, m_i, rows, row_ok, bq, H, pid_s, n_splits, lse_ptr, q_s, desc_o,
                       (bq * H + (gl.program_id(0) + z) * 64).to(gl.int32), DC, o_l)
    else:
        store_rows(o_ptr, o, l_i, m_i, rows, row_ok, bq, H, pid_s, n_splits, lse_ptr, DC, DIRECT, o_l)


def eligible(q: Tensor, kv_cache: Tensor, indices: Tensor, kv_lora_rank: int) -> bool:
    """Whether :func:`launch` serves the call: an sm_90 GPU, bf16 q ``[B, s_q, H, 576]`` (``kv_lora_rank`` 512),
    int32 / int64 indices, a uint8 fp8 cache ``[NB, BS, 656]`` or a bf16 cache ``[NB, BS, 576]`` of any block size,
    dense elements within a row, row and page strides multiples of 16 bytes, a 16-byte aligned base, fewer than
    2**31 slots."""
    if q.device.type != "cuda" or kv_cache.device != q.device or indices.device != q.device:
        return False
    if q.dtype != torch.bfloat16 or kv_lora_rank != DC or indices.dtype not in (torch.int32, torch.int64):
        return False
    width = {torch.uint8: ROW_BYTES, torch.bfloat16: D}.get(kv_cache.dtype)
    if width is None or q.dim() != 4 or q.shape[-1] != D or kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        return False
    align = 16 // kv_cache.element_size()
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) % align or kv_cache.stride(0) % align:
        return False
    if kv_cache.data_ptr() % 16 or kv_cache.shape[0] * kv_cache.shape[1] >= 2 ** 31:
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0)


def launch(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float, kv_lora_rank: int,
           config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Run the kernel on a call :func:`eligible` accepts (``q [B, s_q, H, 576]``, ``indices [B, s_q, topk]``).
    ``config``: SPLITS (else the SMs filled in whole waves, ``_plan.opaque_splits``, at most one split per 4
    tiles of the list); several splits are merged by ``decode.reduce_splits``; the kernel's flags ``VARIANTS``
    (each a bool, ``DEFAULTS`` where absent; ``CVT_BF16`` and ``ROPE_ASYNC`` apply to an fp8 cache only;
    ``FOLD_SCALE`` to a positive ``scale`` only); TMA_OUT (default False; GPU-tested, not timed
    yet): one split and whole 64-row programs store the output by TMA."""
    config = check_config("mla.sparse_decode (gluon64)", config, set(VARIANTS) | {"SPLITS", "TMA_OUT"})
    cfg = {k: bool(config.get(k, DEFAULTS[k])) for k in VARIANTS}
    cfg["FOLD_SCALE"] = cfg["FOLD_SCALE"] and scale > 0  # the raw scores' maximum is the scaled one's only then
    B, s_q, H, _ = q.shape
    topk = indices.shape[2]
    out, lse = decode_outputs(q, kv_lora_rank)
    if B * s_q * H == 0:
        return out, lse
    hb = triton.cdiv(H, BLOCK_M)
    splits, direct = opaque_splits(config, B * s_q * hb, num_sms(q.device) * PROGRAMS_PER_SM, topk, BLOCK_N)
    o_buf, l_buf = split_buffers(out, lse, B * s_q * H, splits, DC, direct)
    q = last_dim_contiguous(q)
    indices = last_dim_contiguous(indices)
    tma_out = direct and H % BLOCK_M == 0 and bool(config.get("TMA_OUT", False))
    sparse_decode_gluon64_kernel[(hb, splits, B * s_q)](
        q, kv_cache, indices, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        indices.stride(0), indices.stride(1),
        H, s_q, topk, kv_cache.shape[0] * kv_cache.shape[1], splits,
        DC=DC, DR=DR, BLOCK_SIZE=kv_cache.shape[1], DIRECT=direct, FP8=kv_cache.dtype == torch.uint8,
        **cfg, TMA_OUT=tma_out, desc_o=row_blocks_descriptor(out, B * s_q * H) if tma_out else None,
        num_warps=NUM_WARPS,
    )
    reduce_splits(wrap_triton, o_buf, l_buf, out, lse, B * s_q * H, splits, splits, DC, DC, direct, pdl=True)
    return out, lse


@torch.library.custom_op("mla::sparse_decode_gluon64", mutates_args=(), tags=LAYOUT_TAGS)
def sparse_decode_gluon64(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float,
                          kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Gluon ``mla::sparse_decode`` with 64 heads a program (same contract as ``mla::sparse_decode_ref``; an
    opaque call to Inductor): :func:`launch` where :func:`eligible`, else ``mla::sparse_decode_triton``."""
    validate(q, kv_cache, indices, kv_lora_rank)
    if eligible(q, kv_cache, indices, kv_lora_rank):
        return launch(q, kv_cache, indices, scale, kv_lora_rank)
    import mla_compile.ops.triton.sparse_decode  # noqa: F401  (registers mla::sparse_decode_triton)
    return torch.ops.mla.sparse_decode_triton(q, kv_cache, indices, scale, kv_lora_rank)


@sparse_decode_gluon64.register_fake
def _(q, kv_cache, indices, scale, kv_lora_rank):
    validate(q, kv_cache, indices, kv_lora_rank)
    return decode_outputs(q, kv_lora_rank)
