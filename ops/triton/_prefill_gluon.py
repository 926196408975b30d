"""The Gluon prefill kernels' shared pieces (``prefill_gluon``'s plain kernel and ``prefill_gluon_ws``'s
warp-specialized one): a key tile's row and TMA copies, a program's (or a persistent work item's) sequence,
rows and key tiles, one tile's online softmax and the rows' stores. Imports Triton's Gluon, so only the kernels
import it."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from mla_compile.ops.triton._common import causal_bounds


@gluon.jit
def _key_row(t, k_start, len_k, BLOCK_N: gl.constexpr):
    """First key row of tile ``t``: ``k_start + t * BLOCK_N``, or ``k_start + len_k - BLOCK_N`` for a tile that
    would run past the sequence (so padding rows are never read)."""
    return gl.minimum(k_start + t * BLOCK_N, k_start + len_k - BLOCK_N)


@gluon.jit
def _issue(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, bars, t, n_tiles, k_start, len_k, col_k, col_v,
           DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr = 2,
           base=0):
    """Start the TMA copies of key tile ``t`` (none past ``n_tiles``) into slot ``(base + t) % STAGES`` on its
    barrier (``base``: the ring's uses before this work item, the persistent kernel's): rows ``kr + [0, BLOCK_N)``
    with ``kr`` from :func:`_key_row`."""
    live = t < n_tiles
    kr = _key_row(t, k_start, len_k, BLOCK_N)
    slot = (base + t) % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, BLOCK_N * (DA + DB + DV) * 2, pred=live)
    tma.async_copy_global_to_shared(ka_desc, [kr, col_k], bar, ka_s.index(slot), pred=live)
    tma.async_copy_global_to_shared(kb_desc, [kr, col_k + DA], bar, kb_s.index(slot), pred=live)
    tma.async_copy_global_to_shared(v_desc, [kr, col_v], bar, v_s.index(slot), pred=live)


@gluon.jit
def _program(cu_q_ptr, cu_k_ptr, n_seq, T, n_slots, BM: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
             CHUNK: gl.constexpr, HEADS_FIRST: gl.constexpr):
    """``(h, q_start, len_q, k_start, len_k, m0, off, hi, full_end, n_tiles)`` of a program of grid ``(H, n_slots)``
    (``HEADS_FIRST``) or ``(n_slots, H)`` (a head's query blocks run together and share its keys in L2):
    head ``h``, query rows ``q_start + m0 + [0, BM)`` (``len_q`` the sequence's; a padding program owns rows up to
    ``T`` and no key, a slot past its sequence's rows no key), key tiles ``[0, n_tiles)`` of ``BLOCK_N``, those
    from ``full_end`` on masked, ``off`` the causal offset (query j sees keys <= j + off)."""
    if HEADS_FIRST:
        h = gl.program_id(0)
        slot_id = n_slots - 1 - gl.program_id(1)  # the longest causal blocks sit last in each sequence
    else:
        h = gl.program_id(1)
        slot_id = n_slots - 1 - gl.program_id(0)
    return _program_of(h, slot_id, cu_q_ptr, cu_k_ptr, n_seq, T, BM, BLOCK_N, CAUSAL, CHUNK)


@gluon.jit
def _item(w, H, cu_q_ptr, cu_k_ptr, n_seq, T, n_slots, BM: gl.constexpr, BLOCK_N: gl.constexpr,
          CAUSAL: gl.constexpr, CHUNK: gl.constexpr, HEADS_FIRST: gl.constexpr):
    """:func:`_program`'s tuple for work item ``w`` of the persistent kernel: the program of linear index ``w`` in
    the non-persistent grid's launch order (its first axis fastest), so items go longest causal blocks first."""
    if HEADS_FIRST:
        h = w % H
        slot_id = n_slots - 1 - w // H
    else:
        h = w // n_slots
        slot_id = n_slots - 1 - w % n_slots
    return _program_of(h, slot_id, cu_q_ptr, cu_k_ptr, n_seq, T, BM, BLOCK_N, CAUSAL, CHUNK)


@gluon.jit
def _program_of(h, slot_id, cu_q_ptr, cu_k_ptr, n_seq, T, BM: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, CHUNK: gl.constexpr):
    """:func:`_program`'s tuple for head ``h`` and row-block slot ``slot_id`` (of ``_common.tiles_started``'s
    enumeration of the sequences' 128-row blocks)."""
    c_l: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    seq = -1  # the segment owning slot ``slot_id`` (``_common.tiles_started``); n_seq: padding rows
    for c in range(0, n_seq + 1, CHUNK):
        idx = c + gl.arange(0, CHUNK, c_l)
        cu = gl.load(cu_q_ptr + idx, mask=idx <= n_seq, other=0)
        seq += gl.sum((((cu // BM + idx) <= slot_id) & (idx <= n_seq)).to(gl.int32), axis=0)
    live = seq < n_seq
    nxt = gl.minimum(seq + 1, n_seq)
    q_start = gl.load(cu_q_ptr + seq).to(gl.int32)
    len_q = gl.where(live, gl.load(cu_q_ptr + nxt).to(gl.int32), T) - q_start
    k_start = gl.load(cu_k_ptr + seq).to(gl.int32)
    len_k = gl.where(live, gl.load(cu_k_ptr + nxt).to(gl.int32) - k_start, 0)
    m0 = (slot_id - (q_start // BM + seq)) * BM
    off = len_k - len_q
    len_k = gl.where(m0 < len_q, len_k, 0)
    hi, full_end = causal_bounds(m0, off, len_k, BM, BLOCK_N, CAUSAL)
    n_tiles = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
    return h, q_start, len_q, k_start, len_k, m0, off, hi, full_end, n_tiles


@gluon.jit
def _softmax_tile(s, m_i, l_i, n0, full_end, len_k, lim, scale_log2, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                  col_s: gl.constexpr, FOLD: gl.constexpr):
    """Raw scores ``s`` of key tile ``n0`` to ``(p, m_new, l_new, alpha)`` in base 2 (``scale_log2`` = the softmax
    scale times log2 e); masked from ``full_end`` on (columns before ``n0`` of a shifted last tile, and past each
    row's diagonal ``lim``). ``FOLD`` (a positive scale): the row maximum is taken on the raw scores and the
    scale folded into the exponent (``exp2(s * c - m)``: one FMA an element, as FA3); else the scores are scaled
    first."""
    if not FOLD:
        s = s * scale_log2
    if n0 + BLOCK_N > full_end:
        n = gl.minimum(n0, len_k - BLOCK_N) + gl.arange(0, BLOCK_N, col_s)
        if CAUSAL:  # columns before n0 get a bound no row reaches
            visible = gl.where(n >= n0, n, 1 << 30)[None, :] <= lim[:, None]
        else:
            visible = (n >= n0)[None, :] & (lim >= -(1 << 30))[:, None]
        s = gl.where(visible, s, float("-inf"))
    if FOLD:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
    alpha = gl.exp2(m_i - m_shift)
    if FOLD:
        p = gl.exp2(gl.fma(s, scale_log2, -m_shift[:, None]))
    else:
        p = gl.exp2(s - m_shift[:, None])
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _store_lse(m_i, l_i, q_start, offs_m, len_q, h, H, lse_ptr):
    """Store the rows' natural-log LSE (-inf where a row saw no key); returns ``(1 / l, rows, rows' mask)``, the
    factor 1 on those rows (their output 0)."""
    empty = l_i == 0.0
    inv = 1.0 / gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    rows = (q_start + offs_m).to(gl.int64)
    m_ok = offs_m < len_q
    gl.store(lse_ptr + rows * H + h, lse, mask=m_ok)
    return inv, rows, m_ok


@gluon.jit
def _store_rows(o, m_i, l_i, q_start, offs_m, len_q, h, H, o_ptr, lse_ptr, DV: gl.constexpr, row_o: gl.constexpr,
                o_l: gl.constexpr):
    """Store the rows' output ``o / l`` (0 where a row saw no key) and natural-log LSE (-inf there)."""
    inv, rows, m_ok = _store_lse(m_i, l_i, q_start, offs_m, len_q, h, H, lse_ptr)
    rows_o = gl.convert_layout(rows, row_o)
    ok_o = gl.convert_layout(m_ok, row_o)
    cols = gl.arange(0, DV, gl.SliceLayout(0, o_l))
    out = o * gl.convert_layout(inv, row_o)[:, None]
    gl.store(o_ptr + (rows_o * H + h)[:, None] * DV + cols[None, :], out.to(o_ptr.dtype.element_ty),
             mask=ok_o[:, None])


@gluon.jit
def _store_rows_tma(o, m_i, l_i, q_start, offs_m, len_q, h, H, lse_ptr, o_desc, o_s, row0, DV: gl.constexpr,
                    row_o: gl.constexpr):
    """:func:`_store_rows` for 64 rows all inside the sequence: the LSE as there, the output ``o / l`` through
    ``o_s`` (a free ``[64, DV]`` shared buffer of the output's dtype) and one TMA copy to rows ``row0 + [0, 64)``,
    head ``h``'s columns (``o_desc``: the output as ``[T, H * DV]``, box ``[64, DV]``), awaited before returning."""
    inv, _, _ = _store_lse(m_i, l_i, q_start, offs_m, len_q, h, H, lse_ptr)
    o_s.store((o * gl.convert_layout(inv, row_o)[:, None]).to(o_s.dtype))
    fence_async_shared()
    gl.thread_barrier()  # (the calling warpgroup) every row stored before the copy reads them
    tma.async_copy_shared_to_global(o_desc, [row0, h * DV], o_s)
    tma.store_wait(0)
