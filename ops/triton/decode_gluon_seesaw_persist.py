"""The persistent seesaw decode (``decode_gluon.launch`` with ``config={"SEESAW": True, "PERSIST": True}``):
``decode_gluon_seesaw``'s two alternating warpgroups, one program an SM, each over a balanced run of key tiles.

The work (``_tile_ranges``): the (64-row block, sequence) items, each the ``cdiv(len, 64)`` tiles of its sequence,
laid end to end; program c of the grid takes its balanced share of them, found from the lengths on the device. A
program's run crosses items: its pieces, each run as one seesaw program over keys ``[64 t0, 64 (t0 + n))`` of its
item, one after the other with the same buffers. A piece covering its whole item stores the result
(bf16 by TMA through the query rows' buffer, natural-log LSE); the others (only a program's first and last can be
partial) store float32 partial rows and base-2 LSEs in the program's workspace slot 0 (first piece) or 1 (last),
which ``tile_merge.merge_tile_pieces`` folds afterwards (it also writes the rows of empty sequences).

Across pieces:
- barrier phases continue: a slot's ``u``-th tile (counted over the program's pieces) waits at phase ``u & 1``,
  ``pready`` likewise (one publication per tile), ``done`` and the query barrier once per piece;
- the next piece's first tiles stream in while this one ends (``_tile_ranges``' slot rule; warpgroup 0 fills the slot
  a one-tile piece leaves unused);
- each warpgroup loads its half of the next piece's latent query rows by TMA once its own output copy has read its
  half of that buffer (the other's last scores were done before: ``_ws_rows_done``), and the rope part into
  registers.

``M`` (query rows a sequence) is a multiple of 64 and q's rows are dense (the query copies), as
``decode_gluon.launch`` checks before it takes this kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from mla_compile.ops.triton._bf16_tma import BOX_C
from mla_compile.ops.triton._fp8_tma import opaque_zero
from mla_compile.ops.triton._gluon import causal_rows, tile_page
from mla_compile.ops.triton._tile_ranges import CH, fill_target, first_item, next_item, piece_tiles
from mla_compile.ops.triton.decode_gluon_seesaw import (O_L, P_A, Q_A, S_L, ZL, _fold_issue, _issue_half, _issue_rope,
                                                        _issue_rope_half, _own_pv, _own_softmax, _release_other,
                                                        _scores, _store_out_tma, alloc_buffers)
from mla_compile.ops.triton.decode_gluon_ws import _ws_finish, _ws_fold, _ws_rows_done

WARPS = 4  # each partition's warps (the kernel's own 4 and one 4-warp worker)
# the worker's registers a thread: the whole 256 (one program an SM; the kernel's own warps keep theirs). At the
# seesaw's 248 ptxas keeps twice as many values in local memory across the partitions (sm_90 compile).
WORKER_REGS = gl.constexpr(256)


@gluon.jit
def _persist(C: gl.constexpr, q_ptr, desc_h, desc_r, desc_q, desc_o, q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready,
             done, q_bar, bt_ptr, stride_bt, seq_lens_ptr, ws_ptr, wl_ptr, lse_ptr, scale_log2, B, M, H, S_Q,
             g0, g1, h, b, s, nt, seq_len, DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Warpgroup ``C`` over the program's pieces (the module docstring), each as ``decode_gluon_seesaw._seesaw``'s
    schedule in its ``FOLD_FIRST`` order (the other order's compile has a ``wgmma`` wait that ptxas injects, its
    C7517); the first piece's tiles 0 and 1 were started by the kernel's prologue. What a piece needs of the next
    (its sequence's block-table row and its tiles) is found when the piece starts, the next item itself again when
    it ends (fewer values live across the tile loop, where the register file is full)."""
    row_s: gl.constexpr = gl.SliceLayout(1, S_L)
    row_o: gl.constexpr = gl.SliceLayout(1, O_L)
    offs_n = gl.arange(0, 64, gl.SliceLayout(0, S_L))
    zero_s = gl.zeros([64, 64], gl.float32, S_L)
    d_r = gl.arange(0, DR, gl.SliceLayout(0, Q_A))

    n = piece_tiles(s, nt, g0, g1)
    t0 = gl.maximum(g0, s) - s
    # phase bits: 1 the pieces', 2 this warpgroup's slot tiles', 4 the other's (their counts' parities); 8 after the
    # program's first piece (its partial rows go to workspace slot 1)
    bits = n * 0
    while n > 0:
        _h2, b2, s2, nt2, _len2 = next_item(seq_lens_ptr, B, h, b, s, nt, g1)
        n2 = piece_tiles(s2, nt2, g0, g1)
        start = t0 * 64
        end = gl.minimum(seq_len, start + n * 64)
        bt_row = bt_ptr + b * stride_bt  # the table's elements < 2^31 (decode_gluon.persist_kind)
        bt_row2 = bt_ptr + b2 * stride_bt
        row0 = b * M + h * 64
        u_own = (bits >> 1) & 1
        u_oth = (bits >> 2) & 1
        if C == 0:
            if n == 1:  # slot 1 stays unused by this piece: the next piece's tile 1 now
                pg = tile_page(bt_row2, 1, n2, 0, BLOCK_SIZE, 64)
                _issue_rope_half(desc_r, desc_h, kr[1], kc[1], kb[5], kb[3], pg, 1, n2, 0, 0, BLOCK_SIZE)
                _issue_half(desc_h, kc[1], kb[4], pg, 1, n2, 0, 1, BLOCK_SIZE)
        # the piece's query rows: this warpgroup's latent half by TMA, the rope part into registers
        mbarrier.expect(q_bar, 64 * (DC // 2) * 2)
        tma.async_copy_global_to_shared(desc_q, [4 * C, row0, 0], q_bar,
                                        q_s.index(0)._reinterpret(gl.bfloat16, [8, 64, 64], BOX_C).slice(4 * C, 4,
                                                                                                         dim=0))
        q_row = q_ptr + (row0 + gl.arange(0, 64, gl.SliceLayout(1, Q_A))) * (DC + DR)  # dense rows, < 2^31 elements
        qr = gl.load(q_row[:, None] + DC + d_r[None, :])
        rows, row_ok, limit, lim_min = causal_rows(h, 64, M, H, S_Q, seq_len, row_s)
        m_i = gl.full([64], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([64], gl.float32, row_s)
        o = gl.zeros([64, 256], gl.float32, O_L)
        mbarrier.wait(q_bar, bits & 1)

        if C == 0:  # tile 0: nothing of the other's before it
            z = opaque_zero(n)
            pg2, f2, n_f2, st2 = fill_target(2, 0, n, start, bt_row, n2, bt_row2, BLOCK_SIZE)
            sa = _scores(qr, q_s, kr, kc, kb, zero_s, C, u_own, z)
            st = warpgroup_mma_wait(0, deps=[sa])
            p, m_i, alpha = _own_softmax(st, m_i, kc, scale_log2, start, end, lim_min, limit, offs_n, C, 0, ZL)
            o, l_i = _own_pv(o, l_i, p, m_i, alpha, desc_h, desc_r, kc, kr, kb, p_s, m_s, a_s, pready, pg2, st2,
                             n_f2, C, f2, z, BLOCK_SIZE, row_o, P_A)
        for t in range(2 - C, n, 2):
            z = opaque_zero(t)
            pg1, f1, n_f1, st1 = fill_target(t + 1, 1 - C, n, start, bt_row, n2, bt_row2, BLOCK_SIZE)
            pg2, f2, n_f2, st2 = fill_target(t + 2, C, n, start, bt_row, n2, bt_row2, BLOCK_SIZE)
            # the seesaw's FOLD_FIRST order: 2, 1, 3 once the fold is done, then S_t awaited
            pv, l_i, m_i = _fold_issue(o, l_i, p_s, m_s, a_s, kc, pready, C, (u_oth + (t - 1) // 2) & 1, z, row_s,
                                       row_o)
            sa = _scores(qr, q_s, kr, kc, kb, zero_s, C, (u_own + t // 2) & 1, z)
            o = warpgroup_mma_wait(3, deps=[pv])
            _release_other(desc_h, kc, kb, pg1, st1, n_f1, C, f1, BLOCK_SIZE)
            st = warpgroup_mma_wait(0, deps=[sa])
            p, m_i, alpha = _own_softmax(st, m_i, kc, scale_log2, start, end, lim_min, limit, offs_n, C, t, ZL)
            o, l_i = _own_pv(o, l_i, p, m_i, alpha, desc_h, desc_r, kc, kr, kb, p_s, m_s, a_s, pready, pg2, st2,
                             n_f2, C, f2, z, BLOCK_SIZE, row_o, P_A)

        last = n - 1
        if last % 2 != C:  # the last tile is the other's: fold it, then this warpgroup's half of its slot refills
            o, l_i, m_i = _ws_fold(C, o, l_i, p_s[1 - C].index(0), m_s[1 - C], a_s[1 - C], kc[1 - C], 0,
                                   pready[1 - C], (u_oth + last // 2) & 1, row_s, row_o)
            pg = tile_page(bt_row2, 1 - C, n2, 0, BLOCK_SIZE, 64)
            _issue_half(desc_h, kc[1 - C], kb[(1 - C) * 3 + C], pg, 1 - C, n2, 0, C, BLOCK_SIZE)
        if (t0 == 0) & (n == nt):  # the whole item: the result, by TMA through this warpgroup's half of q_s
            inv, _ = _ws_rows_done(C, l_i, m_i, x_s, done, rows, row_ok, b, M, 0, 1, lse_ptr, DC, True, row_s,
                                   bits & 1)
            _store_out_tma(C, o, inv, q_s, kc, desc_o, row0, 0, O_L, True)
        else:  # part of it: float32 rows in the program's slot (0: its first piece, 1: its last)
            _ws_finish(C, o, l_i, m_i, x_s, done, rows - h * 64, row_ok, 2 * gl.program_id(0) + (bits >> 3), 64, 0,
                       1, ws_ptr, wl_ptr, DC, False, row_s, O_L, bits & 1)
        own = (u_own + (n + 1 - C) // 2) & 1
        oth = (u_oth + (n + C) // 2) & 1
        bits = ((bits & 1) ^ 1) | (own << 1) | (oth << 2) | 8
        h, b, s, nt, seq_len = next_item(seq_lens_ptr, B, h, b, s, nt, g1)
        t0 = t0 * 0
        n = piece_tiles(s, nt, g0, g1)


@gluon.jit
def decode_gluon_seesaw_persist_kernel(
    q_ptr, desc_h, desc_r, desc_q, desc_o, bt_ptr, seq_lens_ptr, ws_ptr, wl_ptr, lse_ptr,
    scale_log2,
    stride_bt,
    B, M, H, S_Q,
    DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr,
):
    """``decode_gluon_kernel``'s contract over ``B`` sequences of ``M`` query rows (a multiple of 64; ``S_Q`` query
    positions of ``H`` heads) with :data:`WARPS` warps plus a 4-warp worker, on a grid of ``(programs,)``, followed by
    ``tile_merge.merge_tile_pieces`` over the same programs. ``desc_h``: the cache's latent columns as ``[8, rows,
    64]``, box ``[4, 64, 64]``; ``desc_r``: its rows ``[rows, 576]``, box ``[64, 64]`` (the rope columns);
    ``desc_q``: q's latent columns as ``[8, B M, 64]``, box ``[4, 64, 64]`` (a warpgroup's half of a piece's rows);
    ``desc_o``: the bf16 output's ``[8, B M, 64]``, box ``[4, 64, 64]``; ``ws_ptr`` / ``wl_ptr``: float32 ``[2
    programs 64, 512]`` / ``[2 programs 64]`` (``tile_merge.tile_workspace``); ``lse_ptr``: the natural-log LSE of the
    whole items' rows."""
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    gl.static_assert(BLOCK_SIZE % 64 == 0)
    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64
    # the seesaw's buffers; the query barrier takes each warpgroup's half of a piece's query rows
    q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done, q_bar = alloc_buffers(DC, DR, 2)

    g0, g1, h, b, s, nt, seq_len = first_item(seq_lens_ptr, B, M // 64, CH)
    n = piece_tiles(s, nt, g0, g1)
    start = (gl.maximum(g0, s) - s) * 64
    bt_row = bt_ptr + b * stride_bt
    pages = (tile_page(bt_row, 0, n, start, BLOCK_SIZE, 64),  # the first piece's tiles 0 and 1
             tile_page(bt_row, 1, n, start, BLOCK_SIZE, 64))
    for t in gl.static_range(2):
        _issue_rope(desc_r, kr[t], kb[t * 3 + 2], pages[t], t, n, start, BLOCK_SIZE)
        for hh in gl.static_range(2):
            _issue_half(desc_h, kc[t], kb[t * 3 + hh], pages[t], t, n, start, hh, BLOCK_SIZE)
    gl.warp_specialize([
        (_persist, (0, q_ptr, desc_h, desc_r, desc_q, desc_o, q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done,
                    q_bar, bt_ptr, stride_bt, seq_lens_ptr, ws_ptr, wl_ptr, lse_ptr, scale_log2, B, M, H, S_Q,
                    g0, g1, h, b, s, nt, seq_len, DC, DR, BLOCK_SIZE)),
        (_persist, (1, q_ptr, desc_h, desc_r, desc_q, desc_o, q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done,
                    q_bar, bt_ptr, stride_bt, seq_lens_ptr, ws_ptr, wl_ptr, lse_ptr, scale_log2, B, M, H, S_Q,
                    g0, g1, h, b, s, nt, seq_len, DC, DR, BLOCK_SIZE)),
    ], [4], [WORKER_REGS])  # WARPS
