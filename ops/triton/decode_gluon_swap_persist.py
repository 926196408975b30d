"""The persistent swapped decode (``decode_gluon.launch`` with ``config={"SWAP": True, "PERSIST": True}``, or
``PERSIST`` where "gluon" takes the swapped kernel): ``decode_gluon_swap``'s 16-row program, one an SM, each over a
balanced run of key tiles.

The work (``_tile_ranges``): the (16-row block, sequence) items, each the ``cdiv(len, 64)`` tiles of its sequence,
laid end to end; program c of the grid takes its balanced share of them, found from the lengths on the device. So
128 sequences of one row block keep 132 SMs busy instead of 128, and 256 run as one balanced pass instead of two
waves. A program's run crosses items: its pieces, one after the other with the same buffers, each as the swapped
kernel's program over keys ``[64 t0, 64 (t0 + n))``: its query rows staged, ``S^T = K Q^T`` and ``O^T += V^T P^T``
a tile, the copy of the slot's next tile issued once ``P V`` is done. A piece covering its whole item stores the
result (natural-log LSE); the others (only a program's first and last) store float32 partial rows and base-2 LSEs
in the program's workspace slot 0 (first piece) or 1 (last), which ``tile_merge.merge_tile_pieces`` folds afterwards
(it also writes the rows of empty sequences).

Across pieces the slots' barrier phases continue (a slot's ``u``-th tile over the program waits at phase ``u &
1``), and the next piece's first tiles stream in while a piece ends (``_tile_ranges``' slot rule: a one-tile piece
fills slot 1 with the next piece's tile 1 when it starts).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mla_compile.ops.triton._bf16_tma import issue_tile
from mla_compile.ops.triton._gluon import (alloc_tiles, causal_rows, finish_rows, pdl_start, stage_query_rows,
                                           tile_page)
from mla_compile.ops.triton._tile_ranges import CH, first_item, next_item, piece_tiles
from mla_compile.ops.triton.decode_gluon_swap import Q_L, acc_layout, softmax_pv

WARPS = 4


@gluon.jit
def decode_gluon_swap_persist_kernel(
    q_ptr, desc_c, desc_r, bt_ptr, seq_lens_ptr, ws_ptr, wl_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_bt,
    B, M, H, S_Q,
    DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_R: gl.constexpr,
    PDL: gl.constexpr = False,
):
    """``decode_gluon_swap_kernel``'s contract over ``B`` sequences of ``M`` query rows with ``BLOCK_R`` (16) rows an
    item, 4 warps, on a grid of ``(programs,)``, followed by ``tile_merge.merge_tile_pieces`` over the same programs
    (``item_rows=BLOCK_R``). ``desc_c`` / ``desc_r``: the swapped kernel's (a tile's latent columns as eight ``[64,
    64]`` blocks, its rope columns); ``ws_ptr`` / ``wl_ptr``: float32 ``[2 programs BLOCK_R, 512]`` / ``[2 programs
    BLOCK_R]`` (``tile_merge.tile_workspace``); ``o_ptr`` / ``lse_ptr``: the result's rows of whole items. ``PDL``:
    launched with PDL, every program waits for the kernel before it first."""
    pdl_start(PDL)
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    gl.static_assert(BLOCK_SIZE % 64 == 0)
    gl.static_assert(BLOCK_R == 16)
    acc_l: gl.constexpr = acc_layout(BLOCK_R)  # S^T's and O^T's
    col: gl.constexpr = gl.SliceLayout(0, acc_l)  # along the query rows (the dots' N)

    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64
    q_s, qr_s, kc_s, kr_s, p_s = alloc_tiles(BLOCK_R, DC, DR)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(ready.index(0), count=1)
    mbarrier.init(ready.index(1), count=1)
    fence_async_shared()
    gl.thread_barrier()  # the barriers initialized before any copy signals them

    g0, g1, h, b, s, nt, seq_len = first_item(seq_lens_ptr, B, gl.cdiv(M, BLOCK_R), CH)
    n = piece_tiles(s, nt, g0, g1)
    t0 = gl.maximum(g0, s) - s
    bt_row = bt_ptr + b * stride_bt
    for t in gl.static_range(2):  # the first piece's tiles 0 and 1
        issue_tile(desc_c, desc_r, kc_s, kr_s, ready, tile_page(bt_row, t, n, t0 * 64, BLOCK_SIZE, 64), t, n,
                   t0 * 64, BLOCK_SIZE)
    offs_n = gl.arange(0, 64, gl.SliceLayout(1, acc_l))  # key positions along the dots' M
    zero_s = gl.zeros([64, BLOCK_R], gl.float32, acc_l)

    # phase bits: 1 / 2 the parity of slot 0's / slot 1's tiles in the program's earlier pieces; 4 after its first
    # piece (its partial rows go to workspace slot 1)
    bits = n * 0
    while n > 0:
        _h2, b2, s2, nt2, _len2 = next_item(seq_lens_ptr, B, h, b, s, nt, g1)
        n2 = piece_tiles(s2, nt2, s2, g1)  # (a later piece starts past g0)
        start = t0 * 64
        end = gl.minimum(seq_len, start + n * 64)
        bt_row = bt_ptr + b * stride_bt
        bt2 = b2 * stride_bt  # the next piece's block-table row (an offset: a register, not a pointer's two)
        u0 = bits & 1
        u1 = (bits >> 1) & 1
        if n == 1:  # slot 1 stays unused by this piece: the next piece's tile 1 now
            issue_tile(desc_c, desc_r, kc_s, kr_s, ready, tile_page(bt_ptr + bt2, 1, n2, 0, BLOCK_SIZE, 64), 1, n2, 0,
                       BLOCK_SIZE)
        # the piece's query rows (rows past M: zeros, never stored); the last piece's dots that read them are done
        stage_query_rows(q_ptr, q_s, qr_s, b, h, M, H, stride_qb, stride_qs, stride_qh, BLOCK_R, DC, Q_L)
        fence_async_shared()
        gl.thread_barrier()
        rows, row_ok, limit, lim_min = causal_rows(h, BLOCK_R, M, H, S_Q, seq_len, col)
        m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, col)
        l_part = gl.zeros([64, BLOCK_R], gl.float32, acc_l)
        o = gl.zeros([DC, BLOCK_R], gl.float32, acc_l)  # O^T

        mbarrier.wait(ready.index(0), u0)
        s_t = warpgroup_mma(kr_s.index(0), qr_s.permute([1, 0]), zero_s)
        s_t = warpgroup_mma(kc_s.index(0), q_s.permute([1, 0]), s_t)
        for j in range(n):
            slot = j % 2
            n0 = start + j * 64
            k_cur = kc_s.index(slot)
            # the slot's next tile (_tile_ranges.fill_target's rule: this piece's j + 2, else the next piece's tile
            # of this slot), its page read early and the rest formed after P V: fewer values held across the softmax
            here = j + 2 < n
            at = gl.where(here, b * stride_bt + (start + (j + 2) * 64) // BLOCK_SIZE, bt2 + slot * 64 // BLOCK_SIZE)
            page_f = gl.load(bt_ptr + at, mask=here | (slot < n2), other=0).to(gl.int64)
            o, m_i, l_part = softmax_pv(s_t, m_i, l_part, o, k_cur, p_s, n0, end, lim_min, limit, offs_n, scale_log2,
                                        col, Q_L)
            tile_f = gl.where(here, j + 2, slot)
            issue_tile(desc_c, desc_r, kc_s, kr_s, ready, page_f, tile_f, gl.where(here, n, n2),
                       gl.where(here, start, 0), BLOCK_SIZE)
            if j + 1 < n:  # S_{j+1} from the other slot
                nslot = 1 - slot
                mbarrier.wait(ready.index(nslot), (u0 + (u1 - u0) * nslot + (j + 1) // 2) & 1)
                qk = warpgroup_mma(kr_s.index(nslot), qr_s.permute([1, 0]), zero_s, is_async=True)
                qk = warpgroup_mma(kc_s.index(nslot), q_s.permute([1, 0]), qk, is_async=True)
                s_t = warpgroup_mma_wait(0, deps=[qk])

        l_i = gl.sum(l_part, axis=0)
        ok = gl.convert_layout(row_ok, col)
        cols = gl.arange(0, DC, gl.SliceLayout(1, acc_l))
        if (t0 == 0) & (n == nt):  # the whole item: the result
            inv, o_first = finish_rows(l_i, m_i, rows, row_ok, b, M, 0, 1, lse_ptr, DC, True)
            ty: gl.constexpr = o_ptr.dtype.element_ty
            gl.store(o_ptr + gl.convert_layout(o_first, col)[None, :] + cols[:, None],
                     (o * gl.convert_layout(inv, col)[None, :]).to(ty), mask=ok[None, :])
        else:  # part of it: float32 rows in the program's slot (0: its first piece, 1: its last)
            inv, o_first = finish_rows(l_i, m_i, rows - h * BLOCK_R, row_ok, 2 * gl.program_id(0) + (bits >> 2),
                                       BLOCK_R, 0, 1, wl_ptr, DC, False)
            gl.store(ws_ptr + gl.convert_layout(o_first, col)[None, :] + cols[:, None],
                     o * gl.convert_layout(inv, col)[None, :], mask=ok[None, :])
        bits = (u0 ^ (((n + 1) // 2) & 1)) | ((u1 ^ ((n // 2) & 1)) << 1) | 4
        h, b, s, nt, seq_len = next_item(seq_lens_ptr, B, h, b, s, nt, g1)
        t0 = t0 * 0
        n = piece_tiles(s, nt, s, g1)
