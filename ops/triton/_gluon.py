"""Gluon pieces of the decode kernels (bf16 and fp8, paged and sparse): a program's key range, its tiles' pages,
its query rows staged in shared memory, their causal limits, its final LSE / output rows, and the ``wgmma`` fp8
kernel's float16 dequantization of code words and staging of the query rows (the float16 range limits are in its
docstring). Imports Triton's Gluon, so only the kernels import it."""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from mla_compile.ops.triton._bf16_tma import BOX_C

# bf16 tiles in shared memory as wgmma reads them (128-byte swizzle)
SMEM_SL = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
SMEM_C = gl.constexpr(SMEM_SL)
# the 64-row, 8-warp kernels' layouts (decode_gluon, fp8_decode_gluon64, sparse_decode_gluon64): the scores
# [64, 64] and the output [64, 512] as wgmma accumulators of two warpgroups (32 keys / 256 columns each), and the
# query rows' loads
S64 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
O64 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]))
Q64 = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))


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
def alloc_tiles(ROWS: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr):
    """A program's bf16 shared buffers: its ``ROWS`` query rows (``q_s [ROWS, DC]``, ``qr_s [ROWS, DR]``), two
    tile slots (``kc_s [2, 64, DC]``, ``kr_s [2, 64, DR]``) and ``P`` (``p_s [ROWS, 64]``), in that order."""
    q_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, DC], SMEM_C)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, DR], SMEM_C)
    kc_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, DC], SMEM_C)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, DR], SMEM_C)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], SMEM_C)
    return q_s, qr_s, kc_s, kr_s, p_s


@gluon.jit
def store_query_rows(q_s, qr_s, q_row, m_q, M, DC: gl.constexpr, q_l: gl.constexpr):
    """Store the query rows ``q_row`` (their first elements, ``[rows]`` in ``SliceLayout(1, q_l)``) into ``q_s``
    (latent part, ``[rows, DC]``) and ``qr_s`` (rope part, ``[rows, 64]``) as bf16; rows whose ``m_q`` is not
    below ``M`` are zeros. Both loads are issued before either store: one memory round trip, where a store per
    64 columns (each after a shared-memory barrier the compiler places) would wait for one load at a time."""
    ok = (m_q < M)[:, None]
    d_c = gl.arange(0, DC, gl.SliceLayout(0, q_l))
    d_r = gl.arange(0, 64, gl.SliceLayout(0, q_l))
    qc = gl.load(q_row[:, None] + d_c[None, :], mask=ok, other=0.0)
    qr = gl.load(q_row[:, None] + DC + d_r[None, :], mask=ok, other=0.0)
    q_s.store(qc.to(gl.bfloat16))
    qr_s.store(qr.to(gl.bfloat16))


@gluon.jit
def stage_query_rows(q_ptr, q_s, qr_s, b, pid_h, M, H, stride_qb, stride_qs, stride_qh, ROWS: gl.constexpr,
                     DC: gl.constexpr, q_l: gl.constexpr):
    """:func:`store_query_rows` of the paged kernels' program: rows ``pid_h * ROWS ...`` of sequence ``b``'s
    ``M = S_Q * H`` rows (row r: query ``r // H``, head ``r % H``; rows past M: zeros, never stored)."""
    m_q = pid_h * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, q_l))
    q_row = q_ptr + b * stride_qb + (m_q // H).to(gl.int64) * stride_qs + (m_q % H).to(gl.int64) * stride_qh
    store_query_rows(q_s, qr_s, q_row, m_q, M, DC, q_l)


@gluon.jit
def causal_rows(pid_h, ROWS: gl.constexpr, M, H, S_Q, seq_len, layout: gl.constexpr):
    """``(rows, row_ok, limit, lim_min)`` of a paged kernel's program (``layout``: its rows' slice layout): row r
    (query ``r // H``) sees positions ``< limit = seq_len - (S_Q - 1 - r // H)``; ``lim_min`` is the least limit
    of its real rows (``seq_len`` where it has none)."""
    rows = pid_h * ROWS + gl.arange(0, ROWS, layout)
    row_ok = rows < M
    limit = seq_len - (S_Q - 1 - rows // H)  # causal: a row sees positions < limit
    lim_min = gl.min(gl.where(row_ok, limit, seq_len), axis=0)
    return rows, row_ok, limit, lim_min


@gluon.jit
def store_rows(o_ptr, o, l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC: gl.constexpr,
               DIRECT: gl.constexpr, o_l: gl.constexpr):
    """:func:`finish_rows`, then the rows' outputs ``o / l`` (``o [rows, DC]`` fp32 in ``o_l``) into ``o_ptr`` in its
    dtype (rows past ``row_ok`` not stored)."""
    inv, o_first = finish_rows(l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    inv_o = gl.convert_layout(inv, row_o)
    first = gl.convert_layout(o_first, row_o)
    ok = gl.convert_layout(row_ok, row_o)
    cols = gl.arange(0, DC, gl.SliceLayout(0, o_l))
    ty: gl.constexpr = o_ptr.dtype.element_ty
    gl.store(o_ptr + first[:, None] + cols[None, :], (o * inv_o[:, None]).to(ty), mask=ok[:, None])


@gluon.jit
def store_rows_tma(o, l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, q_s, desc_o, row0, DC: gl.constexpr,
                   o_l: gl.constexpr):
    """:func:`store_rows` of a one-split (direct) 64-row program whose rows are all the output's (``M`` a multiple
    of 64): the LSE as there, the rows ``o / l`` through the query rows' buffer ``q_s [64, DC]`` (free once every
    warp's last dot is done: a CTA barrier first) and one TMA copy (``desc_o``: the output's ``[8, rows, 64]``
    column blocks, box ``[8, 64, 64]``, from row ``row0``), awaited before the warps exit."""
    inv, _ = finish_rows(l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, True)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    gl.thread_barrier()  # every warpgroup's dots reading the query rows done
    q_s.store((o * gl.convert_layout(inv, row_o)[:, None]).to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()  # every warp's rows stored before the copy reads them
    tma.async_copy_shared_to_global(desc_o, [0, row0, 0], q_s._reinterpret(gl.bfloat16, [8, 64, 64], BOX_C))
    tma.store_wait(0)


@gluon.jit
def mask_scores(s, n0, end, lim_min, limit, offs_n, scale_log2):
    """The tile at ``n0``'s scores ``s [rows, 64]`` in base 2 (times ``scale_log2``), keys at or past ``end`` or a
    row's causal ``limit`` set to -inf (checked only on a tile that reaches ``min(end, lim_min)``)."""
    s = s * scale_log2
    if n0 + 64 > gl.minimum(end, lim_min):
        pos = n0 + offs_n
        s = gl.where((pos < end)[None, :] & (pos[None, :] < limit[:, None]), s, float("-inf"))
    return s


# variant RESCALE_SKIP: a row's running maximum is raised (and O rescaled) only once a tile's maximum passes it
# by more than this (base 2): P stays within 2**TAU, exact in bf16's exponent range and fp32's sums
TAU = gl.constexpr(8.0)


def _rescale_asm(n: int) -> str:
    """PTX of ``_rescale_voted`` for ``n`` accumulator registers a thread (operands: ``n`` outputs, the ``n``
    accumulators tied to them, then ``n`` alphas from ``$2n``; a thread's first four registers cover both its
    rows, r and r + 8, in wgmma's layout: the vote reads all four)."""
    muls = "\n".join(f"        mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n))
    return f"""{{
        .reg .pred p;
        setp.neu.f32 p, ${2 * n}, 0f3F800000;
        setp.neu.or.f32 p, ${2 * n + 1}, 0f3F800000, p;
        setp.neu.or.f32 p, ${2 * n + 2}, 0f3F800000, p;
        setp.neu.or.f32 p, ${2 * n + 3}, 0f3F800000, p;
        vote.sync.any.pred p, p, 0xffffffff;
        @!p bra.uni SKIP;
{muls}
SKIP:
        }}"""


_RESCALE_N = gl.constexpr(64 * 512 // (32 * 8))  # O's accumulators a thread ([64, 512] fp32 over 8 warps)
_RESCALE_ASM = gl.constexpr(_rescale_asm(_RESCALE_N.value))
_RESCALE_CONSTRAINTS = gl.constexpr(",".join(["=f"] * _RESCALE_N.value + [str(i) for i in range(_RESCALE_N.value)]
                                             + ["f"] * _RESCALE_N.value))


@gluon.jit
def _rescale_voted(o, alpha):
    """``o * alpha[:, None]`` (``o`` the ``[64, 512]`` accumulator, ``alpha`` its rows' factors), skipped by a
    warp (a warp-uniform branch) when every alpha of its rows is 1."""
    a = gl.broadcast(o, alpha[:, None])[1]
    return gl.inline_asm_elementwise(_RESCALE_ASM, _RESCALE_CONSTRAINTS, [o, a], dtype=gl.float32, is_pure=True,
                                     pack=_RESCALE_N)


@gluon.jit
def online_softmax(s, m_i, m_new, l_part, o, scale_log2, row_o: gl.constexpr, FOLD_SCALE: gl.constexpr,
                   RESCALE_SKIP: gl.constexpr):
    """One tile's online-softmax step of a 64-row, 8-warp program (``o [64, 512]`` fp32: ``_rescale_voted``'s register
    count): from the base-2 scores ``s [64, 64]`` (raw scores under ``FOLD_SCALE``: ``scale_log2`` folded into the
    exponent's FMA), the rows' running max ``m_i`` and the tile's ``m_new = max(m_i, row max)`` (the row max of the
    base-2 scores: under ``FOLD_SCALE`` the raw maximum times ``scale_log2``), returns ``(P, new running max, l_part,
    o)`` with the element-wise row sums ``l_part [64, 64]`` and the accumulator ``o [64, 512]`` (rows in ``row_o``)
    rescaled. Rows that have seen nothing keep 0 (no NaN). ``RESCALE_SKIP``: a row raises its maximum only when the
    tile's passes it by more than ``TAU`` (always on its first seen key: -inf + TAU is -inf); its alpha is exactly 1
    otherwise, and a warp none of whose rows moved skips its O rescale (a warp vote: no CTA barrier)."""
    if RESCALE_SKIP:
        m_new = gl.where(m_new > m_i + TAU, m_new, m_i)
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.where(m_new == m_i, 1.0, gl.exp2(m_i - m_shift))  # exactly 1 where kept (-inf rows too)
    else:
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
        alpha = gl.exp2(m_i - m_shift)
    if FOLD_SCALE:
        p = gl.exp2(gl.fma(s, scale_log2, -m_shift[:, None]))
    else:
        p = gl.exp2(s - m_shift[:, None])
    l_part = l_part * alpha[:, None] + p
    if RESCALE_SKIP:
        o = _rescale_voted(o, gl.convert_layout(alpha, row_o))
    else:
        o = o * gl.convert_layout(alpha, row_o)[:, None]
    return p, m_new, l_part, o


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
