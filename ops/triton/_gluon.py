"""Gluon pieces of the fp8 decode kernels: a program's key range, its tiles' pages and its final LSE /
output rows (``fp8_decode_gluon``, ``fp8_decode_wgmma``, ``fp8_decode_tma``), and the ``wgmma`` kernel's
float16 dequantization of code words and staging of the query rows (the float16 range limits are in its
docstring). Imports Triton's Gluon, so only the kernels import it."""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def pdl_start(PDL: gl.constexpr):
    """Under ``PDL`` (the launch took ``launch_pdl``): wait for the kernel before this one (its writes visible),
    then let the next one be scheduled: the order ``_pdl.py``'s contract asks of every program, at the kernel's
    start, before any global read."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@gluon.jit
def split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, BLOCK_N: gl.constexpr):
    """``(pid_s, b, seq_len, start, end, n_tiles, bt_row)`` of a program of grid ``(head blocks, n_splits, B)``:
    split ``pid_s`` of sequence ``b`` covers positions ``[start, end)`` in ``n_tiles`` tiles of ``BLOCK_N``."""
    pid_s = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
    per_split = gl.cdiv(gl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    start = pid_s * per_split
    end = gl.minimum(start + per_split, seq_len)
    n_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
    return pid_s, b, seq_len, start, end, n_tiles, bt_ptr + b * stride_bt


@gluon.jit
def tile_page(bt_row, tile, n_tiles, start, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """The page (block-table entry of row ``bt_row``) holding tile ``tile`` of a program whose key range
    starts at ``start`` (0 for tiles past ``n_tiles``: never read)."""
    return gl.load(bt_row + (start + tile * BLOCK_N) // BLOCK_SIZE, mask=tile < n_tiles, other=0).to(gl.int64)


@gluon.jit
def finish_rows(l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC: gl.constexpr, DIRECT: gl.constexpr):
    """Store the rows' LSE (natural log when ``DIRECT``, one split; else base 2 into the split's workspace
    slot) from the running max ``m_i`` and sum ``l_i`` (base 2); returns ``(1 / l, first output element)``
    per row, ``1 / l`` = 1 where a row saw no key (its accumulator is 0, its LSE -inf)."""
    empty = l_i == 0.0
    inv = 1.0 / gl.where(empty, 1.0, l_i)
    lse2 = gl.where(empty, float("-inf"), m_i + gl.log2(gl.where(empty, 1.0, l_i)))
    if DIRECT:  # one split: the final result
        slot = b * M + rows
        lse = lse2 * 0.6931471805599453
    else:
        slot = (b * M + rows) * n_splits + pid_s
        lse = lse2
    gl.store(lse_ptr + slot, lse, mask=row_ok)
    return inv, slot * DC


@gluon.jit
def dequant_pairs(codes, sc):
    """``f16(code) * f16(scale)`` of int32 code words ``[R, W]`` (4 codes each; ``sc`` fp32 ``[R, 1]``) as
    float16 pairs, int32 ``[R, 2 W]`` in code order: one ``cvt.e4m3x2`` and one ``mul.f16x2`` a pair. The scale
    is clamped so that values stay finite (448 * 146 <= 65504)."""
    sc2 = gl.inline_asm_elementwise(
        """{
        .reg .f32 m;
        .reg .b16 h;
        min.f32 m, $1, 0f43120000;
        cvt.rn.f16.f32 h, m;
        mov.b32 $0, {h, h};
        }""",
        "=r,r", [sc], dtype=gl.int32, is_pure=True, pack=1)
    lo, hi = gl.inline_asm_elementwise(
        """{
        .reg .b16 c0, c1;
        .reg .b32 h0, h1;
        mov.b32 {c0, c1}, $2;
        cvt.rn.f16x2.e4m3x2 h0, c0;
        cvt.rn.f16x2.e4m3x2 h1, c1;
        mul.rn.f16x2 $0, h0, $3;
        mul.rn.f16x2 $1, h1, $3;
        }""",
        "=r,=r,r,r", [codes, gl.broadcast(codes, sc2)[1]], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    return gl.reshape(gl.join(lo, hi), [lo.shape[0], 2 * lo.shape[1]])


@gluon.jit
def q_power(amax):
    """The power of two that puts a query block's largest magnitude ``amax`` in [2^13, 2^15), float16's range
    with headroom (1 for an all-zero block): the kernels multiply the queries by it, exactly, and divide
    ``scale_log2`` by it."""
    return gl.exp2(13.0 - gl.floor(gl.log2(gl.where(amax > 0.0, amax, 1.0))))


@gluon.jit
def stage_q(q_s, qr_s, q_row, ok_q, scale_log2, DC: gl.constexpr, DR: gl.constexpr, q_l: gl.constexpr):
    """Store the program's query rows (``q_row``: their first elements, ``ok_q`` ``[rows, 1]``): the latent
    part as float16 times the power of two that puts its largest magnitude in [2^13, 2^15) (float16's range),
    the rope part as bf16 times the same power (exact); returns ``scale_log2`` with the power undone."""
    q = gl.load(q_row[:, None] + gl.arange(0, DC, gl.SliceLayout(0, q_l))[None, :], mask=ok_q, other=0.0)
    q = q.to(gl.float32)
    amax = gl.max(gl.max(gl.abs(q), axis=1), axis=0)
    up = q_power(amax)
    q_s.store((q * up).to(gl.float16))
    qr = gl.load(q_row[:, None] + DC + gl.arange(0, DR, gl.SliceLayout(0, q_l))[None, :], mask=ok_q, other=0.0)
    qr_s.store((qr.to(gl.float32) * up).to(gl.bfloat16))
    return scale_log2 / up
