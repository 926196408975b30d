"""An sm_90 Gluon decode over the 656-byte fp8 latent cache (``mla::decode_fp8``), 64 query rows a program.

The fp8 twin of ``decode_gluon.decode_gluon_kernel`` (bf16 cache): the same program layout (the ``s_q * H``
query rows of a sequence folded into one row axis, row r is query ``r // H``, head ``r % H``, and sees the
positions before ``seq_len - (s_q - 1 - r // H)``; a program owns 64 rows and one split of the positions,
grid ``(cdiv(s_q * H, 64), splits, B)``), the same shared memory (``Q [64, 576]`` bf16 once, two bf16 tile
slots ``K [64 keys, 576]``, ``P [64, 64]``, all with the 128-byte swizzle ``wgmma`` reads: 224 KB) and the
same S / softmax / P V pipeline over 8 warps (two warpgroups; ``O [64, 512]`` fp32 in registers, each
warpgroup owning 256 columns). What differs is how a tile reaches its slot:

- the threads load a tile's fp8 rows straight into registers with 16-byte loads (its codes ``[64, 512]``,
  16 bytes a thread per 64 columns, one key a thread; its four fp32 scales a key; its rope ``[64, 64]``
  bf16) and store it dequantized (shared memory has no room for a raw staging ring: the bf16 slots take
  it all);
- dequantization writes ``bf16(float32(code) * scale[group])`` into the slot, with the rope columns as
  they are. Against the float64 dequantized cache that is one bf16 rounding (relative 2**-9) of the float32
  product (itself exact unless the scale's low bits reach past float32's 24: then within 2**-24), so each
  key / value element is within ``2**-9 + 2**-24`` of it, relative (about 0.2%: scores move by about
  ``2**-9 / sqrt(3) * ||q * k||``, 0.025 for N(0, 1) data before the softmax scale); FlashMLA's fp8 kernels
  likewise dequantize to bf16 before their dots. The group-split and TMA fp8 kernels keep exact codes with
  fp32 scales (LSE ~1e-6); this one trades that for the bf16 pipeline of ``decode_gluon``;
- keys at or past the split's end are zeroed as they are loaded (masked loads: a page's rows past a
  sequence may hold anything, NaN codes and scales included), so ``0 * NaN`` never reaches P V.

Steps of tile j (slot ``j % 2``): the online softmax of ``S_j`` (base 2, ``scale * log2 e`` applied before
the maxima, so any scale), ``P_j`` to shared memory, then ``P_j V_j`` and ``Q K_{j+1}^T`` issued back to back
(asynchronous ``wgmma``); while they run, the L2 prefetch of tile j + 4 and the register loads of tile j + 2's
codes and scales (prefetched two steps ago: mostly L2 hits) are issued; once ``P_j V_j`` is done in both
warpgroups (a CTA barrier) the threads load tile j + 2's rope and dequantize the tile into slot j while
``Q K_{j+1}^T`` runs on the tensor cores. The next tile's ``fence.proxy.async`` and CTA barrier (after
``P_{j+1}`` is stored) order those shared-memory stores before the ``wgmma`` that reads slot j. Tiles 0 and 1
are stored before the loop. The L2 prefetch is ``cp.async.bulk.prefetch.L2``, one per row (a hint: no
registers held, nothing to wait for); the register tile is loaded only during the dots, as two warpgroups'
``O [64, 512]`` leave no registers to hold a tile across the softmax. There are no mbarriers and no TMA
copies: every synchronization is a CTA barrier that all 256 threads reach (the tile count is uniform in a
program), so a split with no tile skips the loop and writes its empty rows.

Variants (``VARIANTS``: constexpr flags from :func:`launch`'s config; ``DEFAULTS`` holds the ones on unless the
config says otherwise, ``RESCALE_SKIP`` and ``MAX_XCHG``, faster on the H200 at every timed shape and exact at
any scale): ``RESCALE_SKIP`` raises a row's running maximum only when a tile's passes it by more
than ``TAU`` (2**8 in P at most) and lets a warp none of whose rows moved skip O's 128 multiplies a thread (a
warp vote and a warp-uniform branch, no CTA barrier); ``MAX_XCHG`` exchanges the two warpgroups' partial row
maxima through a ``[64, 2]`` buffer with one CTA barrier (Triton's cross-warp reduction takes three);
``CVT_BF16`` dequantizes with bf16x2 arithmetic (``_CVT_BF16``: 2.5 instructions a code against 3; fp8
scales below 2**8).

A row that sees no key has LSE -inf and output 0. With one split the program writes the result (output in
q's dtype, natural-log LSE); else each split writes its normalized rows and base-2 LSE to the workspaces of
``_plan.split_buffers`` and ``decode.reduce_splits`` merges them.

Contract of :func:`launch`: what :func:`eligible` accepts (sm_90, bf16 q ``[B, s_q, H, 576]``, a uint8 cache
``[NB, BS, 656]`` with ``BS`` a multiple of 64, row and page strides multiples of 16 bytes, a 16-byte aligned
base; pages inside a larger buffer too: no TMA descriptor spans the cache). :func:`decode_fp8_gluon64`
(``mla::decode_fp8_gluon64``) runs ``mla::decode_fp8_gluon`` (or the Triton kernel) for other calls.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from mla_compile.ops.fp8_cache import gluon_eligible, validate_decode
from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton._bf16_tma import row_blocks_descriptor
from mla_compile.ops.triton._common import last_dim_contiguous, num_sms
from mla_compile.ops.triton._fp8_tma import opaque_zero
from mla_compile.ops.triton._gluon import (O64, Q64, S64, alloc_tiles, causal_rows, mask_scores,
                                           online_softmax, pdl_start, split_range, stage_query_rows, store_rows,
                                           store_rows_tma, tile_page)
from mla_compile.ops.triton._pdl import launch_kwargs
from mla_compile.ops.triton._plan import opaque_splits, split_buffers
from mla_compile.ops.triton.decode import _LOG2E, decode_outputs, reduce_splits

BLOCK_M = 64  # query rows a program (wgmma's M)
BLOCK_N = 64  # keys a tile
DC, DR = 512, 64
D = DC + DR
ROW_BYTES = DC + 4 * (DC // 128) + 2 * DR  # 656
NUM_WARPS = 8
PROGRAMS_PER_SM = 1
# the kernel's variants (constexpr flags; ``launch``'s config keys) and the ones on unless the config says otherwise
VARIANTS = ("RESCALE_SKIP", "MAX_XCHG", "CVT_BF16")
DEFAULTS = {"RESCALE_SKIP": True, "MAX_XCHG": True, "CVT_BF16": False}
# the codes [64 keys, 512]: 16 bytes a thread a repetition (columns 16 t + 64 r), 8 keys x 64 bytes a warp
# instruction, one key a thread
CODE_L = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0]))
# the scales [64 keys, 4 groups]: each thread its key's four (the codes' key distribution)
SCALE_L = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [8, 1], [1, 0]))
# the rope [64 keys, 64] bf16: 16 bytes a thread a repetition
ROPE_L = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0]))
# variant CVT_BF16: the codes as int32 words [64 keys, 128] (CODE_L's bytes: 4 words a thread a repetition)
WORD_L = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [8, 1], [1, 0]))
# variant MAX_XCHG: the two warpgroups' partial row maxima [64 rows, 2] read back with both in each thread, its
# rows those of the score accumulator's row slice (registers: row + 8, the warpgroup; lanes 4 and up: rows;
# warps: rows 16 and 32, the warpgroup bit replicated)
XCH_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [0, 1]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0], [0, 0]], block_bases=[], shape=[64, 2]))
XCH_S = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
# variant CVT_BF16: four e4m3 codes (one word) to bf16 times a scale given as two bf16 halves (hi + lo, each
# times 2**120). prmt puts each code's byte in the low byte of a bf16 lane and its sign in the high byte; shifted
# left by 4 and masked, a lane holds the sign and the code's 7 magnitude bits under bf16's exponent and mantissa:
# the bf16 equal to the code times 2**-120 (e4m3 subnormals become bf16 subnormals, exactly); then
# fma(c, hi, c * lo) rounds once to bf16(code * (hi + lo) * 2**-120), hi + lo within 2**-16 of scale * 2**120.
# 2.5 instructions a code, against 3 (e4m3 -> f16 -> f32, the fp32 product, the bf16 pack). Scales must stay
# below 2**8 (scale * 2**120 within bf16's range; the quantizer's amax / 448 for latents below 114688)
_CVT_BF16 = gl.constexpr("""{
        .reg .b32 a, b, t;
        prmt.b32 a, $4, 0, 0x9180;
        prmt.b32 b, $4, 0, 0xB3A2;
        shl.b32 a, a, 4;
        shl.b32 b, b, 4;
        and.b32 a, a, 0x87F087F0;
        and.b32 b, b, 0x87F087F0;
        mul.rn.bf16x2 t, a, $6;
        fma.rn.bf16x2 a, a, $5, t;
        mul.rn.bf16x2 t, b, $6;
        fma.rn.bf16x2 b, b, $5, t;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        }""")


@gluon.jit
def _load_tile(kv_ptr, page, tile, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr):
    """Tile ``tile``'s codes ``[64, 512]`` uint8 (``CODE_L``) and scales ``[64, 4]`` fp32 (``SCALE_L``), on block
    ``page``, into registers; keys at or past ``end`` (and every key of a tile past ``n_tiles``) read as 0."""
    n0 = start + tile * 64
    live = tile < n_tiles
    base = kv_ptr + page * stride_kb + (n0 % BLOCK_SIZE).to(gl.int64) * stride_kt
    key = gl.arange(0, 64, gl.SliceLayout(1, CODE_L))
    ok = ((n0 + key < end) & live)[:, None]
    row = base + key.to(gl.int64)[:, None] * stride_kt
    codes = gl.load(row + gl.arange(0, 512, gl.SliceLayout(0, CODE_L))[None, :], mask=ok, other=0)
    key = gl.arange(0, 64, gl.SliceLayout(1, SCALE_L))
    ok = ((n0 + key < end) & live)[:, None]
    sc = (base + key.to(gl.int64)[:, None] * stride_kt + 512).to(gl.pointer_type(gl.float32))
    sc = gl.load(sc + gl.arange(0, 4, gl.SliceLayout(0, SCALE_L))[None, :], mask=ok, other=0.0)
    return codes, sc


@gluon.jit
def _load_words(kv_ptr, page, tile, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr):
    """``_load_tile`` with the codes as int32 words ``[64, 128]`` (``WORD_L``: the same 16-byte loads)."""
    n0 = start + tile * 64
    live = tile < n_tiles
    base = kv_ptr + page * stride_kb + (n0 % BLOCK_SIZE).to(gl.int64) * stride_kt
    key = gl.arange(0, 64, gl.SliceLayout(1, WORD_L))
    ok = ((n0 + key < end) & live)[:, None]
    row = (base + key.to(gl.int64)[:, None] * stride_kt).to(gl.pointer_type(gl.int32))
    words = gl.load(row + gl.arange(0, 128, gl.SliceLayout(0, WORD_L))[None, :], mask=ok, other=0)
    key = gl.arange(0, 64, gl.SliceLayout(1, SCALE_L))
    ok = ((n0 + key < end) & live)[:, None]
    sc = (base + key.to(gl.int64)[:, None] * stride_kt + 512).to(gl.pointer_type(gl.float32))
    sc = gl.load(sc + gl.arange(0, 4, gl.SliceLayout(0, SCALE_L))[None, :], mask=ok, other=0.0)
    return words, sc


@gluon.jit
def _load_codes(kv_ptr, page, tile, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr,
                CVT_BF16: gl.constexpr):
    """``_load_words`` under ``CVT_BF16``, else ``_load_tile``."""
    if CVT_BF16:
        return _load_words(kv_ptr, page, tile, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE)
    else:
        return _load_tile(kv_ptr, page, tile, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE)


@gluon.jit
def _load_rope(kv_ptr, page, tile, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr):
    """Tile ``tile``'s rope columns ``[64, 64]`` bf16 (keys at or past ``end``, tiles past ``n_tiles``: 0)."""
    n0 = start + tile * 64
    base = kv_ptr + page * stride_kb + (n0 % BLOCK_SIZE).to(gl.int64) * stride_kt
    key = gl.arange(0, 64, gl.SliceLayout(1, ROPE_L))
    ok = ((n0 + key < end) & (tile < n_tiles))[:, None]
    rope = (base + key.to(gl.int64)[:, None] * stride_kt + 528).to(gl.pointer_type(gl.bfloat16))
    return gl.load(rope + gl.arange(0, 64, gl.SliceLayout(0, ROPE_L))[None, :], mask=ok, other=0.0)


@gluon.jit
def _prefetch_tile(kv_ptr, page, tile, n_tiles, start, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr):
    """Start bringing tile ``tile``'s 64 rows (on block ``page``) into L2 (none past ``n_tiles``): one
    ``cp.async.bulk.prefetch.L2`` of 656 bytes a row (a hint: no registers held, nothing to wait for; rows
    past a sequence's end are inside its page). The instruction takes uniform operands, so ptxas loops over
    a warp's distinct rows (the four lanes holding one row of ``CODE_L``'s key slice issue it once)."""
    n0 = start + tile * 64
    base = kv_ptr + page * stride_kb + (n0 % BLOCK_SIZE).to(gl.int64) * stride_kt
    key = gl.arange(0, 64, gl.SliceLayout(1, CODE_L))
    row = (base + key.to(gl.int64) * stride_kt).to(gl.int64, bitcast=True)
    live = gl.full([64], 0, gl.int32, gl.SliceLayout(1, CODE_L)) + (tile < n_tiles).to(gl.int32)
    gl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.ne.s32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], 656;
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [row, live], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _store_tile(kc, kr, codes, sc, rope):
    """Dequantize a tile's codes into a slot's latent ``kc [64, 512]``, ``bf16(float32(e4m3 code) * scale)``, and
    store its rope into ``kr [64, 64]`` (the rope last, so that its load has the dequantization's time to
    arrive); one store each (the barrier pass puts a CTA barrier between stores into one buffer)."""
    x = gl.reshape(codes.to(gl.float8e4nv, bitcast=True).to(gl.float32), [64, 4, 128])
    sc = gl.convert_layout(sc, gl.SliceLayout(2, x.type.layout))  # no data movement (checked by the compile)
    kc.store(gl.reshape((x * sc[:, :, None]).to(gl.bfloat16), [64, 512]))
    kr.store(rope)


@gluon.jit
def _halves(sc):
    """fp32 scales times 2**120 as two bf16 halves ``hi = bf16(x)``, ``lo = bf16(x - hi)``, each duplicated in both
    lanes of an int32 (a ``bf16x2`` operand of ``_CVT_BF16``)."""
    x = sc * 1.329227995784916e36  # 2**120, exact
    hi = x.to(gl.bfloat16)
    lo = (x - hi.to(gl.float32)).to(gl.bfloat16)
    hb = hi.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    lb = lo.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return hb | (hb << 16), lb | (lb << 16)


@gluon.jit
def _store_tile_bf16(kc, kr, words, sc, rope):
    """``_store_tile`` from code words (variant ``CVT_BF16``): each word's four codes dequantized with bf16x2
    arithmetic (``_CVT_BF16``; scales below 2**8) into ``kc``."""
    w = gl.reshape(words, [64, 4, 32])
    hh, ll = _halves(sc)
    hh = gl.convert_layout(hh, gl.SliceLayout(2, w.type.layout))  # no data movement (checked by the compile)
    ll = gl.convert_layout(ll, gl.SliceLayout(2, w.type.layout))
    w, hh = gl.broadcast(w, hh[:, :, None])
    w, ll = gl.broadcast(w, ll[:, :, None])
    h0, h1, h2, h3 = gl.inline_asm_elementwise(
        _CVT_BF16, "=h,=h,=h,=h,r,r,r", [w, hh, ll],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    x = gl.join(gl.join(h0, h1), gl.join(h2, h3))  # [64, 4, 32, i, j]: code 2 j + i of the word
    kc.store(gl.reshape(gl.permute(x, [0, 1, 2, 4, 3]), [64, 512]))
    kr.store(rope)


@gluon.jit
def _row_max_xchg(s, mx_s, row_l: gl.constexpr):
    """The row maxima of the scores ``s [64, 64]`` (``row_l``: its row slice) with one CTA barrier: each warpgroup
    reduces its 32 keys within its warps, writes the partial ``[64, 2]`` and reads both back (the generic
    cross-warp reduction takes three). The previous tile's reads of ``mx_s`` are behind the loop's other
    barriers, so the store needs none before it."""
    part = gl.max(gl.reshape(s, [64, 2, 32]), axis=2)
    mx_s.store(part)
    gl.thread_barrier()
    both = mx_s.load(XCH_L)
    return gl.convert_layout(gl.max(both, axis=1), row_l, assert_trivial=True)


@gluon.jit
def _store(kc, kr, codes, sc, rope, CVT_BF16: gl.constexpr):
    """``_store_tile_bf16`` under ``CVT_BF16``, else ``_store_tile``."""
    if CVT_BF16:
        _store_tile_bf16(kc, kr, codes, sc, rope)
    else:
        _store_tile(kc, kr, codes, sc, rope)


@gluon.jit
def decode_fp8_gluon64_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt,
    stride_bt,
    M, H, S_Q, n_splits,
    DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr,
    RESCALE_SKIP: gl.constexpr = False, MAX_XCHG: gl.constexpr = False, CVT_BF16: gl.constexpr = False,
    PDL: gl.constexpr = False, TMA_OUT: gl.constexpr = False, desc_o=None,
):
    """Grid ``(cdiv(M, 64), n_splits, B)``, 8 warps; bf16 q ``[B, S_Q, H, 576]`` (last dim contiguous); the fp8
    cache ``kv_ptr`` (uint8, rows of 656 bytes at ``stride_kt``, blocks at ``stride_kb``); ``BLOCK_SIZE`` a
    multiple of 64. ``DIRECT`` (one split): the result into ``o_ptr`` (``[B * M, 512]``, q's dtype) / ``lse_ptr``
    (natural log); else each split's rows into the workspaces ``o_ptr`` / ``lse_ptr`` (``[B * M, n_splits, 512]``
    fp32, base-2 LSE). Variants (each off unless set; :func:`launch` sets ``DEFAULTS``): ``RESCALE_SKIP`` keeps
    each row's running maximum until a tile's maximum passes it by more than ``TAU`` (a CTA-uniform test: O and
    the row sums are rescaled only on those tiles), ``CVT_BF16`` dequantizes with bf16x2 arithmetic
    (``_store_tile_bf16``). ``PDL``: launched with PDL, every program waits for the kernel before it first.
    ``TMA_OUT`` (``DIRECT``, every row of a program the output's; GPU-tested, not timed): ``desc_o`` spans the
    output's rows as ``[8, rows, 64]`` column blocks (box ``[8, 64, 64]``), and the rows go through the query rows'
    buffer and one TMA copy (``_gluon.store_rows_tma``)."""
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    gl.static_assert(BLOCK_SIZE % 64 == 0)
    pdl_start(PDL)
    s_l: gl.constexpr = S64
    o_l: gl.constexpr = O64
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    q_l: gl.constexpr = Q64

    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64
    pid_h = gl.program_id(0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, 64)

    q_s, qr_s, kc_s, kr_s, p_s = alloc_tiles(64, DC, DR)
    if MAX_XCHG:
        mx_s = gl.allocate_shared_memory(gl.float32, [64, 2], XCH_S)

    # tiles 0 and 1 into their slots (every tile past n_tiles reads as zeros); tiles 2 and 3 toward L2
    for t in gl.static_range(2):
        page = tile_page(bt_row, t, n_tiles, start, BLOCK_SIZE, 64)
        codes, sc = _load_codes(kv_ptr, page, t, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE, CVT_BF16)
        rope = _load_rope(kv_ptr, page, t, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE)
        _store(kc_s.index(t), kr_s.index(t), codes, sc, rope, CVT_BF16)
    page2 = tile_page(bt_row, 2, n_tiles, start, BLOCK_SIZE, 64)  # block-table entries of tiles j + 2 .. j + 4
    page3 = tile_page(bt_row, 3, n_tiles, start, BLOCK_SIZE, 64)
    page4 = tile_page(bt_row, 4, n_tiles, start, BLOCK_SIZE, 64)
    _prefetch_tile(kv_ptr, page2, 2, n_tiles, start, stride_kb, stride_kt, BLOCK_SIZE)
    _prefetch_tile(kv_ptr, page3, 3, n_tiles, start, stride_kb, stride_kt, BLOCK_SIZE)

    # the query rows, 64 columns at a time (rows past M: zeros, never stored)
    stage_query_rows(q_ptr, q_s, qr_s, b, pid_h, M, H, stride_qb, stride_qs, stride_qh, 64, DC, q_l)
    fence_async_shared()
    gl.thread_barrier()  # the query rows and tiles 0 and 1 stored (every warp) before any wgmma reads them

    rows, row_ok, limit, lim_min = causal_rows(pid_h, 64, M, H, S_Q, seq_len, row_s)
    offs_n = gl.arange(0, 64, gl.SliceLayout(0, s_l))
    zero_s = gl.zeros([64, 64], gl.float32, s_l)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_part = gl.zeros([64, 64], gl.float32, s_l)
    o = gl.zeros([64, DC], gl.float32, o_l)

    s = zero_s
    if n_tiles > 0:
        s = warpgroup_mma(qr_s, kr_s.index(0).permute([1, 0]), zero_s)
        s = warpgroup_mma(q_s, kc_s.index(0).permute([1, 0]), s)
    for j in range(n_tiles):
        slot = j % 2
        n0 = start + j * 64
        k_cur = kc_s.index(slot)
        # online softmax of S_j (base 2)
        s = mask_scores(s, n0, end, lim_min, limit, offs_n, scale_log2)
        if MAX_XCHG:
            m_new = gl.maximum(m_i, _row_max_xchg(s, mx_s, row_s))
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p, m_i, l_part, o = online_softmax(s, m_i, m_new, l_part, o, scale_log2, row_o, False, RESCALE_SKIP)
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()  # P_j and (from the last step) the dequantized tile j + 1, for the async proxy
        gl.thread_barrier()  # every warp's P rows (and tile j + 1's rows) before either warpgroup's dots
        pv = warpgroup_mma(p_s, k_cur, o, is_async=True)
        # S_{j+1} from the other slot (a dead product past the last tile: that slot holds zeros)
        qk = warpgroup_mma(qr_s, kr_s.index(1 - slot).permute([1, 0]), zero_s, is_async=True)
        qk = warpgroup_mma(q_s, kc_s.index(1 - slot).permute([1, 0]), qk, is_async=True)
        # while the dots run: tile j + 4 toward L2, tile j + 2 (prefetched two steps ago) into registers
        _prefetch_tile(kv_ptr, page4, j + 4, n_tiles, start, stride_kb, stride_kt, BLOCK_SIZE)
        codes, sc = _load_codes(kv_ptr, page2, j + 2, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE,
                                CVT_BF16)
        o = warpgroup_mma_wait(2, deps=[pv])
        gl.thread_barrier()  # both warpgroups done with slot j and P
        # tile j + 2 into slot j while S_{j+1} runs (its rope loaded now: registers are short during P V)
        rope = _load_rope(kv_ptr, page2, j + 2, n_tiles, start, end, stride_kb, stride_kt, BLOCK_SIZE)
        _store(k_cur, kr_s.index(slot), codes, sc, rope, CVT_BF16)
        page2 = page3
        page3 = page4
        page4 = tile_page(bt_row, j + 5, n_tiles, start, BLOCK_SIZE, 64)
        s = warpgroup_mma_wait(0, deps=[qk])

    l_i = gl.sum(l_part, axis=1)
    # the program's rows and split again (an opaque zero: recomputed here, not held in registers across the loop)
    z = opaque_zero(n_tiles)
    rows = (gl.program_id(0) + z) * 64 + gl.arange(0, 64, row_s)
    row_ok = rows < M
    b = gl.program_id(2).to(gl.int64) + z
    pid_s = gl.program_id(1) + z
    if TMA_OUT:
        store_rows_tma(o, l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, q_s, desc_o,
                       (b * M + (gl.program_id(0) + z) * 64).to(gl.int32), DC, o_l)
    else:
        store_rows(o_ptr, o, l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT, o_l)


def smem_bytes() -> int:
    """Shared memory of one program's buffers: the query rows, the two bf16 tile slots and P (the sm_90 compile
    adds a little scratch for the cross-warpgroup row maxima; checked by a test)."""
    return BLOCK_M * D * 2 + 2 * BLOCK_N * D * 2 + BLOCK_M * BLOCK_N * 2


def eligible(q: Tensor, kv_cache: Tensor, kv_lora_rank: int) -> bool:
    """Whether :func:`launch` serves the call: an sm_90 GPU, bf16 q ``[B, s_q, H, 576]``, a uint8 cache
    ``[NB, BS, 656]`` (``kv_lora_rank`` 512), pages of a multiple of 64 rows, dense bytes within a row, row and
    page strides multiples of 16 bytes, a 16-byte aligned base."""
    if q.device.type != "cuda" or kv_cache.device != q.device:
        return False
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.uint8 or kv_lora_rank != DC:
        return False
    if q.dim() != 4 or q.shape[-1] != D or kv_cache.dim() != 3 or kv_cache.shape[-1] != ROW_BYTES:
        return False
    if kv_cache.shape[1] % BLOCK_N or kv_cache.stride(2) != 1 or kv_cache.stride(1) % 16 or kv_cache.stride(0) % 16:
        return False
    if kv_cache.data_ptr() % 16:  # the L2 prefetches take 16-byte aligned rows
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0)


def launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
           config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Run the kernel on a call :func:`eligible` accepts. ``config``: SPLITS (else the SMs filled in whole
    waves, ``_plan.opaque_splits``); several splits are merged by ``decode.reduce_splits``; the kernel's
    variants ``VARIANTS`` (each a bool, ``DEFAULTS`` where absent: ``{"CVT_BF16": True}``); TMA_OUT (default False;
    GPU-tested, not timed yet): one split and whole 64-row programs store the output by TMA."""
    B, s_q, H, _ = q.shape
    M = s_q * H
    out, lse = decode_outputs(q, kv_lora_rank)
    if B == 0 or M == 0:
        return out, lse
    hb = triton.cdiv(M, BLOCK_M)
    splits, direct = opaque_splits(config, B * hb, num_sms(q.device) * PROGRAMS_PER_SM,
                                   block_table.shape[1] * kv_cache.shape[1], BLOCK_N, "fp8_decode_gluon64")
    o_buf, l_buf = split_buffers(out, lse, B * M, splits, DC, direct)
    q = last_dim_contiguous(q)
    tma_out = direct and M % BLOCK_M == 0 and bool((config or {}).get("TMA_OUT", False))
    decode_fp8_gluon64_kernel[(hb, splits, B)](
        q, kv_cache, block_table, seq_lens, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        M, H, s_q, splits, DC=DC, DR=DR, BLOCK_SIZE=kv_cache.shape[1], DIRECT=direct,
        **{k: bool((config or {}).get(k, DEFAULTS[k])) for k in VARIANTS},
        TMA_OUT=tma_out, desc_o=row_blocks_descriptor(out, B * M) if tma_out else None,
        num_warps=NUM_WARPS, **launch_kwargs(q.device),
    )
    reduce_splits(wrap_triton, o_buf, l_buf, out, lse, B * M, splits, splits, DC, DC, direct, pdl=True)
    return out, lse


@torch.library.custom_op("mla::decode_fp8_gluon64", mutates_args=(), tags=LAYOUT_TAGS)
def decode_fp8_gluon64(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                       kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Gluon ``mla::decode_fp8`` with 64 query rows a program (same contract as ``mla::decode_fp8_ref``; an
    opaque call to Inductor): :func:`launch` where :func:`eligible`, else ``mla::decode_fp8_gluon`` where
    ``fp8_cache.gluon_eligible``, else ``mla::decode_fp8_triton``."""
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    if eligible(q, kv_cache, kv_lora_rank):
        return launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    if gluon_eligible(q, kv_cache, kv_lora_rank):
        import mla_compile.ops.triton.fp8_decode_gluon  # noqa: F401  (registers mla::decode_fp8_gluon)
        return torch.ops.mla.decode_fp8_gluon(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    import mla_compile.ops.triton.fp8_decode  # noqa: F401  (registers mla::decode_fp8_triton)
    return torch.ops.mla.decode_fp8_triton(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


@decode_fp8_gluon64.register_fake
def _(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank):
    return decode_outputs(q, kv_lora_rank)
