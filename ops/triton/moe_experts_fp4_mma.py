"""Gluon ``mla::moe_experts_fp4_gluon``: the fused fp4 experts of :mod:`~mla_compile.ops.triton.moe_experts_fp4`
with the products on the tensor cores (``mma.sync``), each code decoded straight into the dot's register operand.

The Triton kernels decode on the CUDA cores, widen every weight to float32 and issue one FMA per weight; at a few
tokens that issue, not the bytes, bounds them (``benchmarks/kernel_resources.py --fp4``). Here:

- A warp's step is 16 weight rows (``ROWS``: 16 or 32) x 128 columns, the A operand of ``mma.sync.m16n8k16``.
  Each thread loads, for each of its rows (g and g + 8 of its lane group), 4 consecutive int32 words: one
  32-block, so one ue8m0 scale. Each word's codes i and i + 4 (i < 4) sit 16 bits apart: one shift-and-mask
  places both in bfloat16's fields (``fp4_block_linear.bf16_pair_bits``: the value times 2^-126) and one
  ``mul.bf16x2`` scales both by the block's power of two times 2^-``TILE_SHIFT`` (exact for scale bytes 34..160,
  as ``e2m1_bf16_tile``); the 32-bit result is, as it stands, one register of the A fragment.
- That puts the weights in a K order of its own (:data:`A_ORDER`): the register holding codes (i, i + 4) is where
  ``mma`` wants columns (2c, 2c + 1). The dot is the same sum over a permuted K, so x is read in its natural order
  (32 contiguous values a thread) and permuted in registers the same way (:data:`X_ORDER`, the B fragment).
  ``convert_layout(..., assert_trivial=True)`` makes the compile fail if either ever needs a data exchange.
- The warps of a program (``S``) split K: the dot is batched over them (warp w takes steps w, w + S, ...), and the
  float32 partials are summed once after the loop. Each step's words are loaded one step ahead (the loop
  unrolled twice, so the prefetch needs no register copies); gate and up share the loop and x's operand.
- The B operand is 8 bf16 rows of x (n = 8); the accumulator is float32 and scaled back by 2^``TILE_SHIFT``.

Up to ``CONFIG["sorted_above"]`` tokens, per (token, pick), every column of the dot the token's row (column 0 kept):
kernel 1 (grid ``(T * k, I / ROWS)``) takes one (token, pick) row and ``ROWS`` rows of its expert's gate and up, the
clamp and ``silu(g) * u``, the activation stored in x's dtype; a pick of weight 0 returns before any load. Kernel 2
(grid ``(T, H / ROWS)``) takes one token and ``ROWS`` output columns, its picks' down rows in a fixed order, each
pick's dot weighted by its routing weight (a pick of weight 0 skipped: its activation row is never read).
Above, over the (token, pick) rows sorted by expert (``sort_by_expert_triton``: one counting-sort launch): the same
two steps a program per (expert, ``ROWS`` rows), its rows 8 at a time as the dot's columns, so each hit expert's
weights are read once for 8 rows; the down outputs float32 at each row's own (token, pick) row, weighted and summed
per token after (``combine_pairs``, deterministic).
Serves bf16 x with ``H`` and ``I`` multiples of ``256 * S`` (:func:`eligible`); other calls run the Triton kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from mla_compile.ops.moe_experts import _out_dtype, combine_pairs
from mla_compile.ops.moe_experts_fp4 import FUSED_MAX_TOKENS_FP4, fake, validate
from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton.fp4_block_linear import TILE_UNIT, bf16_pair_bits, bf16_scale_bits
from mla_compile.ops.triton.moe_experts_fp4 import kernel_operands
from mla_compile.ops.triton.moe_grouped import sort_by_expert_triton

STEP = gl.constexpr(128)  # K columns a warp's step: 16 words a row, 4 a thread
# The decoded step [S, R, 16 words, c2, c0, c1] (word j = 4 t + a: t the lane's column group, a the thread's word;
# code c = 4 c2 + 2 c1 + c0) reshaped to [S, R, t, a, c2, c0, c1] and permuted to A's column order
# (a, c1, c0, t, c2): column 32 a + 16 c1 + 8 c0 + 2 t + c2 holds code 32 t + 8 a + c of the step.
A_ORDER = gl.constexpr((0, 1, 3, 6, 5, 2, 4))
# x's step in natural order [S, column, t, a, c2, c1, c0] permuted the same way (a, c1, c0, t, c2)
X_ORDER = gl.constexpr((0, 1, 3, 5, 6, 2, 4))
# Launch parameters: rows a warp's dot (16 or 32), warps a program (K split among them) for each kernel's pair;
# above ``sorted_above`` tokens (the op's fused / grouped split by default) the sorted kernels (each hit expert's
# weights read once for 8 rows) instead of the per-(token, pick) ones. ``per_pick``: ``(max tokens, rows, gate-up
# warps, down warps)`` for the per-(token, pick) launches, the first entry whose bound holds the call's tokens;
# ``sorted``: ``(rows, gate-up warps, down warps)`` of the sorted launches (``()``: the three above). Dims an entry
# does not fit take the three above: one token's few programs split K over more warps, eight or more tokens' many
# programs take wider tiles on fewer warps, the sorted kernels two warps a program (timed: BENCHMARKS.md).
CONFIG = dict(rows=16, gate_up_warps=4, down_warps=4, sorted_above=FUSED_MAX_TOKENS_FP4,
              per_pick=((1, 16, 4, 8), (7, 16, 4, 4), (FUSED_MAX_TOKENS_FP4, 32, 2, 2)), sorted=(16, 2, 2))


@gluon.constexpr_function
def acc_layout(S, R):
    """The accumulator ``[S, R, 8]``: warp w holds batch w (its K share), ``R / 16`` m16 tiles."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[S, 1, 1], instr_shape=[1, 16, 8])


@gluon.constexpr_function
def word_layout(S, R):
    """The words ``[S, R, 16]`` of a step: lanes (t, g) hold rows g, g + 8 (and g + 16, g + 24 for R = 32) and words
    4 t .. 4 t + 3 (one 16-byte load a row), in the register order that makes the decoded step A's layout."""
    regs = [[0, 0, 1], [0, 0, 2], [0, 8, 0]] + ([[0, 16, 0]] if R == 32 else [])
    lanes = [[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes,
                                      warp_bases=[[1 << i, 0, 0] for i in range(S.bit_length() - 1)], block_bases=[],
                                      shape=[S, R, 16])


@gluon.constexpr_function
def x_layout(S):
    """x's step ``[S, 8, 128]`` (the dot's 8 columns, each a row of x) in natural order: lane group g's column, lane
    t's 32 contiguous values of it."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
                                      lane_bases=[[0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                      warp_bases=[[1 << i, 0, 0] for i in range(S.bit_length() - 1)],
                                      block_bases=[], shape=[S, 8, STEP.value])


@gluon.jit
def _pair(w, f2, I: gl.constexpr):
    """Codes ``I`` and ``I + 4`` of words ``w`` as one bfloat16 pair each (code I low), scaled by ``f2`` (the
    scale factor in both halves): ``[..., 2]`` bfloat16."""
    both = gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [bf16_pair_bits(w, I), f2],
                                     dtype=gl.int32, is_pure=True, pack=1)
    return gl.join(both.to(gl.int16).to(gl.bfloat16, bitcast=True),
                   (both >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True))


@gluon.jit
def _decode(w, f2, a_l: gl.constexpr):
    """A step's words ``[S, R, 16]`` and their scale factors -> the A operand ``[S, R, 128]`` in :data:`A_ORDER`."""
    d = gl.join(gl.join(_pair(w, f2, 0), _pair(w, f2, 1)), gl.join(_pair(w, f2, 2), _pair(w, f2, 3)))
    S: gl.constexpr = w.shape[0]
    R: gl.constexpr = w.shape[1]
    d = gl.permute(gl.reshape(d, [S, R, 4, 4, 2, 2, 2]), A_ORDER.value)
    return gl.convert_layout(gl.reshape(d, [S, R, STEP]), a_l, assert_trivial=True)


@gluon.jit
def _factor(s):
    """ue8m0 bytes (int32) -> ``2^(s - 1 - TILE_SHIFT)`` as bfloat16 bits in both halves of an int32 (byte 255:
    NaN; below byte 34 the factor is subnormal and the products inexact, as ``e2m1_bf16_tile``)."""
    bits = bf16_scale_bits(s)
    return bits | (bits << 16)


@gluon.jit
def _x_operand(x_cols, col_ok, q, sx, kx, b_l: gl.constexpr):
    """The rows at ``x_cols [1, 8, 1]`` (0 where not ``col_ok``), columns of step ``q + sx`` (warp sx's), as the B
    operand ``[S, 128, 8]`` in :data:`A_ORDER`."""
    S: gl.constexpr = sx.shape[0]
    v = gl.load(x_cols + (q + sx) * STEP + kx, mask=col_ok & (kx >= 0), other=0.0)
    v = gl.reshape(gl.permute(gl.reshape(v, [S, 8, 4, 4, 2, 2, 2]), X_ORDER.value), [S, 8, STEP])
    return gl.convert_layout(gl.permute(v, (0, 2, 1)), b_l, assert_trivial=True)


@gluon.jit
def _rows_dot(acc, acc2, w_ptr, s_ptr, w2_ptr, s2_ptr, x_cols, col_ok, wj, sj, sx, kx, n_steps, S: gl.constexpr,
              a_l: gl.constexpr, b_l: gl.constexpr, TWO: gl.constexpr):
    """``acc += W X`` over all of K for the rows at ``w_ptr`` (word pointers of column 0 plus ``wj``) and their scale
    bytes at ``s_ptr`` (plus ``sj``), X's 8 columns the rows at ``x_cols`` (:func:`_x_operand`), and with ``TWO`` in
    the same loop ``acc2 += W2 X`` (gate and up: x's operand made once a step, twice the words in flight):
    ``n_steps`` steps a warp (even), each step's words loaded a step ahead. Returns ``(acc, acc2)``."""
    w_a = gl.load(w_ptr + wj)
    if TWO:
        v_a = gl.load(w2_ptr + wj)
    for c in range(0, n_steps, 2):
        q = c * S
        more = (wj >= 0) & (c + 2 < n_steps)
        w_b = gl.load(w_ptr + (q + S) * 16 + wj)
        if TWO:
            v_b = gl.load(w2_ptr + (q + S) * 16 + wj)
        xb = _x_operand(x_cols, col_ok, q, sx, kx, b_l)
        acc = mma_v2(_decode(w_a, _factor(gl.load(s_ptr + q * 4 + sj).to(gl.int32)), a_l), xb, acc)
        w_a = gl.load(w_ptr + (q + 2 * S) * 16 + wj, mask=more, other=0)
        if TWO:
            acc2 = mma_v2(_decode(v_a, _factor(gl.load(s2_ptr + q * 4 + sj).to(gl.int32)), a_l), xb, acc2)
            v_a = gl.load(w2_ptr + (q + 2 * S) * 16 + wj, mask=more, other=0)
        xb = _x_operand(x_cols, col_ok, q + S, sx, kx, b_l)
        acc = mma_v2(_decode(w_b, _factor(gl.load(s_ptr + (q + S) * 4 + sj).to(gl.int32)), a_l), xb, acc)
        if TWO:
            acc2 = mma_v2(_decode(v_b, _factor(gl.load(s2_ptr + (q + S) * 4 + sj).to(gl.int32)), a_l), xb, acc2)
    return acc, acc2


@gluon.jit
def _tile(cols, S: gl.constexpr, R: gl.constexpr):
    """This program's ``R`` weight rows (``program_id(1)``) over ``cols`` columns, and its operands' offsets in the step
    layouts: ``(n [1, R, 1] int64 rows, wj [S, 1, 16] words of warp w's first step, sj [S, 1, 16] their scale bytes,
    sx [S, 1, 1], col [1, 8, 1] the dot's columns, kx [1, 1, 128], n_steps a warp, ro [R, 1] rows and co [1, 8]
    columns of the summed accumulator)``."""
    w_l: gl.constexpr = word_layout(S, R)
    x_l: gl.constexpr = x_layout(S)
    out_l: gl.constexpr = gl.SliceLayout(0, acc_layout(S, R))
    n0 = gl.program_id(1) * R
    sw = gl.arange(0, S, gl.SliceLayout(1, gl.SliceLayout(2, w_l)))[:, None, None]
    r = gl.arange(0, R, gl.SliceLayout(0, gl.SliceLayout(2, w_l)))[None, :, None]
    j = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, w_l)))[None, None, :]
    sx = gl.arange(0, S, gl.SliceLayout(1, gl.SliceLayout(2, x_l)))[:, None, None]
    col = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(2, x_l)))[None, :, None]
    kx = gl.arange(0, STEP, gl.SliceLayout(0, gl.SliceLayout(1, x_l)))[None, None, :]
    ro = n0 + gl.arange(0, R, gl.SliceLayout(1, out_l))[:, None]
    co = gl.arange(0, 8, gl.SliceLayout(0, out_l))[None, :]
    return (n0 + r).to(gl.int64), sw * 16 + j, sw * 4 + j // 4, sx, col, kx, cols // (STEP * S), ro, co


@gluon.jit
def _swiglu(acc_g, acc_u, limit, LIMIT: gl.constexpr):
    """The K split's gate and up partials summed and scaled back, clamped under ``LIMIT``: ``silu(g) * u [R, 8]``."""
    gv = gl.sum(acc_g, axis=0) * TILE_UNIT
    uv = gl.sum(acc_u, axis=0) * TILE_UNIT
    if LIMIT:
        gv = gl.minimum(gv, limit)
        uv = gl.minimum(gl.maximum(uv, -limit), limit)
    return gv / (1.0 + gl.exp(-gv)) * uv


@gluon.constexpr_function
def operand_layout(S, R, index):
    """The dot's operand ``index`` (0: A, the decoded weights; 1: B, x) of :func:`acc_layout`."""
    return gl.DotOperandLayout(operand_index=index, parent=acc_layout(S, R), k_width=2)


@gluon.jit
def _moe_fp4_mma_gate_up_kernel(
    x_ptr, ids_ptr, wt_ptr, g_ptr, u_ptr, gs_ptr, us_ptr, h_ptr, limit,
    H, K,
    s_x, s_ids, s_wt, s_ge, s_gn, s_ue, s_un, s_gse, s_gsn, s_use, s_usn, s_h,
    LIMIT: gl.constexpr, ROWS: gl.constexpr,
):
    """Grid ``(T * K, I / ROWS)``: one (token, pick) row, ``ROWS`` rows of its expert's gate and up."""
    S: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = acc_layout(S, ROWS)
    a_l: gl.constexpr = operand_layout(S, ROWS, 0)
    b_l: gl.constexpr = operand_layout(S, ROWS, 1)
    limit = gl.full([], limit, gl.float32)
    row = gl.program_id(0)
    t = (row // K).to(gl.int64)
    if gl.load(wt_ptr + t * s_wt + row % K) != 0:  # a pick of weight 0 (another rank's) reads nothing
        e = gl.load(ids_ptr + t * s_ids + row % K).to(gl.int64)
        n, wj, sj, sx, col, kx, n_steps, ro, co = _tile(H, S, ROWS)
        x_cols = x_ptr + t * s_x + 0 * col  # the token's row in every column of the dot
        zero = gl.zeros([S, ROWS, 8], gl.float32, acc_l)
        acc_g, acc_u = _rows_dot(zero, zero, g_ptr + e * s_ge + n * s_gn, gs_ptr + e * s_gse + n * s_gsn,
                                 u_ptr + e * s_ue + n * s_un, us_ptr + e * s_use + n * s_usn, x_cols, col >= 0, wj, sj,
                                 sx, kx, n_steps, S, a_l, b_l, True)
        a = _swiglu(acc_g, acc_u, limit, LIMIT)
        gl.store(h_ptr + row.to(gl.int64) * s_h + ro + co, a.to(h_ptr.dtype.element_ty), mask=co == 0)


@gluon.jit
def _moe_fp4_mma_down_kernel(
    h_ptr, w_ptr, ids_ptr, dn_ptr, ds_ptr, out_ptr,
    I,
    s_h, s_w, s_ids, s_de, s_dh, s_dse, s_dsh, s_out,
    K: gl.constexpr, ROWS: gl.constexpr,
):
    """Grid ``(T, H / ROWS)``: one token, ``ROWS`` output columns, its picks' down rows weighted in a fixed order."""
    S: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = acc_layout(S, ROWS)
    a_l: gl.constexpr = operand_layout(S, ROWS, 0)
    b_l: gl.constexpr = operand_layout(S, ROWS, 1)
    t = gl.program_id(0).to(gl.int64)
    n, wj, sj, sx, col, kx, n_steps, ro, co = _tile(I, S, ROWS)
    acc = gl.zeros([S, ROWS, 8], gl.float32, acc_l)
    for j in gl.static_range(K):
        weight = gl.load(w_ptr + t * s_w + j)
        if weight != 0:  # a pick of weight 0: its activation row was never written
            e = gl.load(ids_ptr + t * s_ids + j).to(gl.int64)
            zero = gl.zeros([S, ROWS, 8], gl.float32, acc_l)
            w_rows, s_rows = dn_ptr + e * s_de + n * s_dh, ds_ptr + e * s_dse + n * s_dsh
            part, _ = _rows_dot(zero, zero, w_rows, s_rows, w_rows, s_rows, h_ptr + (t * K + j) * s_h + 0 * col,
                                col >= 0, wj, sj, sx, kx, n_steps, S, a_l, b_l, False)
            acc += weight * part
    y = gl.sum(acc, axis=0) * TILE_UNIT
    gl.store(out_ptr + t * s_out + ro + co, y.to(out_ptr.dtype.element_ty), mask=co == 0)


@gluon.jit
def _group(offs_ptr):
    """``(start, end)``: the sorted rows of this program's expert (``program_id(0)``)."""
    e = gl.program_id(0)
    end = gl.load(offs_ptr + e)
    start = gl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    return start, end


@gluon.jit
def _live_rows(order_ptr, wt_ptr, r0, end, col):
    """``(ok, pick)`` of sorted rows ``r0 + col``: the row exists and its routing weight is not 0, and its (token,
    pick) index (``order``)."""
    pick = gl.load(order_ptr + r0 + col, mask=r0 + col < end, other=0)
    return (r0 + col < end) & (gl.load(wt_ptr + pick, mask=r0 + col < end, other=0.0) != 0), pick


@gluon.jit
def _moe_fp4_mma_sorted_gate_up_kernel(
    x_ptr, order_ptr, wt_ptr, g_ptr, u_ptr, gs_ptr, us_ptr, offs_ptr, h_ptr, limit,
    H, K,
    s_x, s_ge, s_gn, s_ue, s_un, s_gse, s_gsn, s_use, s_usn, s_h,
    LIMIT: gl.constexpr, ROWS: gl.constexpr,
):
    """Grid ``(E, I / ROWS)``: ``ROWS`` rows of expert e's gate and up over its sorted (token, pick) rows, 8 a dot
    (each weight read once for up to 8 of them); an expert without live rows reads nothing (a row of routing weight 0
    is left out and its ``h`` row unwritten). ``h`` in sorted order."""
    S: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = acc_layout(S, ROWS)
    a_l: gl.constexpr = operand_layout(S, ROWS, 0)
    b_l: gl.constexpr = operand_layout(S, ROWS, 1)
    limit = gl.full([], limit, gl.float32)
    e = gl.program_id(0).to(gl.int64)
    start, end = _group(offs_ptr)
    n, wj, sj, sx, col, kx, n_steps, ro, co = _tile(H, S, ROWS)
    g_rows, gs_rows = g_ptr + e * s_ge + n * s_gn, gs_ptr + e * s_gse + n * s_gsn
    u_rows, us_rows = u_ptr + e * s_ue + n * s_un, us_ptr + e * s_use + n * s_usn
    for r0 in range(start, end, 8):
        ok, pick = _live_rows(order_ptr, wt_ptr, r0, end, col)
        if gl.sum(ok.to(gl.int32)) > 0:
            zero = gl.zeros([S, ROWS, 8], gl.float32, acc_l)
            acc_g, acc_u = _rows_dot(zero, zero, g_rows, gs_rows, u_rows, us_rows, x_ptr + (pick // K) * s_x, ok, wj,
                                     sj, sx, kx, n_steps, S, a_l, b_l, True)
            a = _swiglu(acc_g, acc_u, limit, LIMIT)
            gl.store(h_ptr + (r0 + co).to(gl.int64) * s_h + ro, a.to(h_ptr.dtype.element_ty), mask=r0 + co < end)


@gluon.jit
def _moe_fp4_mma_sorted_down_kernel(
    h_ptr, order_ptr, wt_ptr, dn_ptr, ds_ptr, offs_ptr, y_ptr,
    I,
    s_h, s_de, s_dh, s_dse, s_dsh, s_y,
    ROWS: gl.constexpr,
):
    """Grid ``(E, H / ROWS)``: ``ROWS`` rows of expert e's down over its sorted activation rows, 8 a dot; ``y``
    float32 at each sorted row's own (token, pick) row (``order``; weighted and summed per token after), 0 in a row
    of routing weight 0."""
    S: gl.constexpr = gl.num_warps()
    acc_l: gl.constexpr = acc_layout(S, ROWS)
    a_l: gl.constexpr = operand_layout(S, ROWS, 0)
    b_l: gl.constexpr = operand_layout(S, ROWS, 1)
    e = gl.program_id(0).to(gl.int64)
    start, end = _group(offs_ptr)
    n, wj, sj, sx, col, kx, n_steps, ro, co = _tile(I, S, ROWS)
    w_rows, s_rows = dn_ptr + e * s_de + n * s_dh, ds_ptr + e * s_dse + n * s_dsh
    for r0 in range(start, end, 8):
        ok, pick = _live_rows(order_ptr, wt_ptr, r0, end, col)
        y = gl.zeros([ROWS, 8], gl.float32, gl.SliceLayout(0, acc_l))
        if gl.sum(ok.to(gl.int32)) > 0:
            zero = gl.zeros([S, ROWS, 8], gl.float32, acc_l)
            acc, _ = _rows_dot(zero, zero, w_rows, s_rows, w_rows, s_rows, h_ptr + (r0 + col).to(gl.int64) * s_h, ok,
                               wj, sj, sx, kx, n_steps, S, a_l, b_l, False)
            y = gl.sum(acc, axis=0) * TILE_UNIT
        pair = gl.load(order_ptr + r0 + co, mask=r0 + co < end, other=0)  # the rows' (token, pick) indices
        gl.store(y_ptr + pair.to(gl.int64) * s_y + ro, y, mask=r0 + co < end)


def _fits(H: int, I: int, rows: int, gate_up_warps: int, down_warps: int) -> bool:
    """Whether the kernels take these launch parameters at these dims: ``H`` a multiple of ``256 *`` the gate-up
    kernel's warps and ``I`` of ``256 *`` the down kernel's (two steps a warp a loop turn), both of the rows a warp."""
    return (H % (2 * STEP.value * gate_up_warps) == 0 and I % (2 * STEP.value * down_warps) == 0 and H % rows == 0
            and I % rows == 0)


def tiles(tokens: int, H: int, I: int) -> tuple[int, int, int]:
    """``(rows a warp, gate-up warps, down warps)`` of a launch over ``tokens`` tokens at dims ``H`` / ``I``: the
    first ``CONFIG["per_pick"]`` entry holding the tokens (``CONFIG["sorted"]`` above ``sorted_above``) where the
    kernels take it, else ``CONFIG``'s three."""
    if tokens > CONFIG["sorted_above"]:
        config = CONFIG["sorted"]
    else:
        config = next((c for bound, *c in CONFIG["per_pick"] if tokens <= bound), ())
    if config and _fits(H, I, *config):
        return tuple(config)
    return CONFIG["rows"], CONFIG["gate_up_warps"], CONFIG["down_warps"]


def eligible(x: Tensor, I: int) -> bool:
    """Whether the Gluon kernels serve this call: bf16 x and dims :func:`_fits` takes at ``CONFIG``'s launch
    parameters (the few-token ones of :func:`tiles` only where they fit too)."""
    return x.dtype == torch.bfloat16 and _fits(x.shape[1], I, CONFIG["rows"], CONFIG["gate_up_warps"],
                                               CONFIG["down_warps"])


def launch(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor, up_scale: Tensor,
           down: Tensor, down_scale: Tensor, out_float32: bool, swiglu_limit: float | None) -> Tensor:
    """The Gluon kernels on a validated, :func:`eligible` call: per (token, pick) up to ``CONFIG["sorted_above"]``
    tokens, over the rows sorted by expert above (each hit expert's weights read once for 8 rows)."""
    T, H = x.shape
    K = ids.shape[1]
    E, I, _ = gate.shape
    out = torch.empty(T, H, dtype=_out_dtype(x, out_float32), device=x.device)
    if T == 0:
        return out
    x, weights, ids, (g, u, d), (gs, us, ds), h = kernel_operands(x, weights, ids, gate, gate_scale, up, up_scale,
                                                                  down, down_scale)
    rows, gate_up_warps, down_warps = tiles(T, H, I)
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    gu = dict(LIMIT=swiglu_limit is not None, ROWS=rows, num_warps=gate_up_warps)
    if T > CONFIG["sorted_above"]:
        order, offs = sort_by_expert_triton(ids, E)
        _moe_fp4_mma_sorted_gate_up_kernel[(E, I // rows)](
            x, order, weights, g, u, gs, us, offs, h, limit, H, K,
            x.stride(0), g.stride(0), g.stride(1), u.stride(0), u.stride(1), gs.stride(0), gs.stride(1),
            us.stride(0), us.stride(1), h.stride(0), **gu)
        y = torch.empty(T * K, H, dtype=torch.float32, device=x.device)
        _moe_fp4_mma_sorted_down_kernel[(E, H // rows)](
            h, order, weights, d, ds, offs, y, I,
            h.stride(0), d.stride(0), d.stride(1), ds.stride(0), ds.stride(1), y.stride(0),
            ROWS=rows, num_warps=down_warps)
        return out.copy_(combine_pairs(y, weights))
    _moe_fp4_mma_gate_up_kernel[(T * K, I // rows)](
        x, ids, weights, g, u, gs, us, h, limit, H, K,
        x.stride(0), ids.stride(0), weights.stride(0), g.stride(0), g.stride(1), u.stride(0), u.stride(1),
        gs.stride(0), gs.stride(1), us.stride(0), us.stride(1), h.stride(0), **gu)
    _moe_fp4_mma_down_kernel[(T, H // rows)](
        h, weights, ids, d, ds, out, I,
        h.stride(0), weights.stride(0), ids.stride(0), d.stride(0), d.stride(1), ds.stride(0), ds.stride(1),
        out.stride(0),
        K=K, ROWS=rows, num_warps=down_warps)
    return out


@torch.library.custom_op("mla::moe_experts_fp4_gluon", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_fp4_gluon(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                          up_scale: Tensor, down: Tensor, down_scale: Tensor, out_float32: bool,
                          swiglu_limit: float | None) -> Tensor:
    """Gluon ``mla::moe_experts_fp4`` (contract of the ``_ref`` op; an opaque call to Inductor): the kernels here
    where :func:`eligible`, else ``mla::moe_experts_fp4_triton``."""
    args = (x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale)
    validate(*args)
    if x.device.type == "cuda" and eligible(x, gate.shape[1]):
        return launch(*args, out_float32, swiglu_limit)
    # mla::moe_experts_fp4_triton is registered by the import of kernel_operands' module
    return torch.ops.mla.moe_experts_fp4_triton(*args, out_float32, swiglu_limit)


moe_experts_fp4_gluon.register_fake(fake)
