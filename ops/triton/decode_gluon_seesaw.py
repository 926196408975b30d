"""The alternating ("seesaw") sm_90 Gluon bf16 decode (``decode_gluon.launch`` with ``config={"SEESAW": True}``):
``decode_gluon_kernel``'s contract and 64-row programs, for the many-heads case (#27's 128-head gap).

Two 4-warp partitions (``gl.warp_specialize``: the kernel's 4 warps and one 4-warp worker), no producer, so
neither partition's registers are capped for a third. Warpgroup ``C`` owns

- the scores and softmax of the tiles t = C, C + 2, ... (every tile's S by one warpgroup: no N=32 halves),
  and tile slot ``C`` (tile t lives in slot t % 2: a warpgroup's own tiles in its own slot);
- output columns ``[256 C, 256 C + 256)`` of every tile: its own tiles' ``P V`` with P from registers, the
  other's with P from the other's shared ``P`` buffer.

The running max passes between the warpgroups with each tile's P (max, rescale factor and P in shared
memory, buffer t % 2: two P buffers. A warpgroup publishes P_t only after its fold of P_{t-1} is done, and the
other writes P_{t+1} into buffer t + 1 only after taking P_t, so each publication also tells the other that its
P buffer is free: no wait before a publication). A warpgroup's order for its tile t:

1. ``S_t`` issued (rope part first, from the query's rope columns held in registers, then this warpgroup's
   latent half, then the other's: the order in which they are re-filled, each as its part of the tile arrives);
2. the other's tile t - 1: its max and factor read, ``O *= alpha``, ``O += P_{t-1} V_{t-1}`` issued;
3. both awaited: this warpgroup's half of the other's slot re-filled with tile t + 1's (before the softmax, so
   the other's next S finds it sooner);
4. the softmax, a partial tile's value rows zeroed;
5. ``O *= alpha_t``, ``O += P_t V_t`` issued (P from registers), P_t published while it runs, then slot C's rope
   columns and this warpgroup's half of it re-filled with tile t + 2's (the block-table entries were read at the
   tile's start).

Tile 0 (warpgroup 0's, nothing of the other's before it) takes steps 1, 4 and 5. ``FOLD_FIRST`` (the default
order) takes the other's tile first: steps 2 and 1 issued (S_t only once the other has published tile t - 1),
step 3 as soon as step 2's ``P V`` is done (``S_t`` may still run), ``S_t`` awaited, then 4 and 5; each
warpgroup's softmax then overlaps the other's dots only. Without it, ``S_t`` starts as soon as its parts have
landed, before the other's publication.

So one warpgroup's softmax (step 4) runs while the other's dots do, and each tile's copies are started in
three parts (the rope columns and the two 256-column halves, one mbarrier each) as soon as their last reader
is done. Shared memory: the latent query rows ``[64, 512]``, two tile slots, two P buffers, the hand-over rows
(:func:`smem_bytes`: within an SM's 227 KB because the query's rope part stays in registers).

Both warpgroups end with the same running max; warpgroup 1 hands its row sums to warpgroup 0, which stores
the LSE (``decode_gluon_ws._ws_rows_done``). Each stores its output columns: with whole 64-row programs
(``TMA_OUT``) staged in shared memory (free once both are done: with one split, bf16 in its half of the latent query
rows' buffer; with several, the float32 partial rows in its own tile slot) and written by one TMA copy, else with
plain stores (``_ws_finish``). Keys of a partial tile past the split's end are masked and their
value rows zeroed; a row that sees no key has LSE -inf and output 0 (``decode_gluon_kernel``'s contract).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mla_compile.ops.triton._bf16_tma import (BLOCK_M, BLOCK_N, BOX_C, DC, DR, F32_BOX_C, F32_C, STAGES, TILE_BYTES,
                                              tile_row, zero_tail)
from mla_compile.ops.triton._fp8_tma import opaque_zero
from mla_compile.ops.triton._gluon import SMEM_C, causal_rows, split_range, tile_page
from mla_compile.ops.triton.decode_gluon_ws import (_ws_finish, _ws_fold, _ws_publish, _ws_rows_done, _ws_softmax,
                                                     _ws_take)

WARPS = 4  # each partition's warps (the kernel's own 4 and one 4-warp worker)
WORKER_REGS = gl.constexpr(248)  # the worker's registers a thread (the kernel's own warps get the rest of the file)
HALF_BYTES = gl.constexpr(BLOCK_N * (DC // 2) * 2)  # a half tile's latent columns
ROPE_BYTES = gl.constexpr(BLOCK_N * DR * 2)
# a warpgroup's layouts: S [64, 64] and O [64, 256] accumulators, P and the query's rope part as A operands, the
# zeroing of a partial tile's value rows
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
P_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_L.value, k_width=2))
Q_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_L.value, k_width=2))
ZL = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


def smem_bytes() -> int:
    """Shared memory of one program's buffers: the latent query rows, the two tile slots, two P buffers, the
    hand-over rows (max and factor per P buffer, the row sums' two) and 11 mbarriers (the compile adds a little
    scratch and the partitions' captured arguments; checked by a test)."""
    return BLOCK_M * DC * 2 + STAGES * TILE_BYTES + 2 * BLOCK_M * BLOCK_N * 2 + 6 * BLOCK_M * 4 + 11 * 8


@gluon.jit
def _copy_half(desc_h, kc, bar, row, live, H_: gl.constexpr):
    """The copy of latent columns ``[256 H_, 256 H_ + 256)`` (four ``[64, 64]`` blocks, ``desc_h``'s box) of the
    tile at cache row ``row`` into its slot ``kc`` on barrier ``bar`` (its expectation set by the caller)."""
    dst = kc.index(0)._reinterpret(gl.bfloat16, [8, 64, 64], BOX_C).slice(4 * H_, 4, dim=0)
    tma.async_copy_global_to_shared(desc_h, [4 * H_, row, 0], bar, dst, pred=live)


@gluon.jit
def _copy_rope(desc_r, kr, bar, row, live):
    """The copy of the rope columns (from column 512, ``desc_r``'s box) of the tile at cache row ``row`` into its
    slot ``kr`` on barrier ``bar`` (its expectation set by the caller)."""
    tma.async_copy_global_to_shared(desc_r, [row, 512], bar, kr.index(0), pred=live)


@gluon.jit
def _issue_half(desc_h, kc, bar, page, tile, n_tiles, start, H_: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Start the copy of tile ``tile``'s latent half ``H_`` (:func:`_copy_half`) into its slot ``kc`` on that slot's
    half-``H_`` barrier ``bar`` (none past ``n_tiles``)."""
    live = tile < n_tiles
    row = tile_row(page, tile, start, BLOCK_SIZE)
    mbarrier.expect(bar, HALF_BYTES, pred=live)
    _copy_half(desc_h, kc, bar, row, live, H_)


@gluon.jit
def _issue_rope(desc_r, kr, bar, page, tile, n_tiles, start, BLOCK_SIZE: gl.constexpr):
    """Start the copy of tile ``tile``'s rope columns into its slot ``kr`` on that slot's rope barrier ``bar``."""
    live = tile < n_tiles
    row = tile_row(page, tile, start, BLOCK_SIZE)
    mbarrier.expect(bar, ROPE_BYTES, pred=live)
    _copy_rope(desc_r, kr, bar, row, live)


@gluon.jit
def _issue_rope_half(desc_r, desc_h, kr, kc, bar_r, bar_h, page, tile, n_tiles, start, H_: gl.constexpr,
                     BLOCK_SIZE: gl.constexpr):
    """:func:`_issue_rope` and :func:`_issue_half` of one tile, both expectations set before either copy starts
    (one compiler-placed barrier between them, not one before each copy)."""
    live = tile < n_tiles
    row = tile_row(page, tile, start, BLOCK_SIZE)
    mbarrier.expect(bar_r, ROPE_BYTES, pred=live)
    mbarrier.expect(bar_h, HALF_BYTES, pred=live)
    _copy_rope(desc_r, kr, bar_r, row, live)
    _copy_half(desc_h, kc, bar_h, row, live, H_)


@gluon.jit
def _scores(qr, q_s, kr, kc, kb, zero_s, C: gl.constexpr, use, z):
    """Step 1: issue ``S_t = Q K_t^T`` on slot ``C`` (the rope part from ``qr`` in registers, then this
    warpgroup's latent half, re-filled after its own ``P V`` of tile t - 2, then the other's, re-filled after the
    other's fold of that tile), each part once its copy has landed (``use``: the slot's barrier phase of tile t);
    returns the pending accumulator (three ``wgmma`` groups). ``z``: ``_fp8_tma.opaque_zero``, which indexes the
    buffers so that their descriptors are made here, not held in registers across the loop."""
    q = q_s.index(z)
    k_own = kc[C].index(z)
    mbarrier.wait(kb[C * 3 + 2], use)
    sa = warpgroup_mma(qr, kr[C].index(z).permute([1, 0]), zero_s, is_async=True)
    mbarrier.wait(kb[C * 3 + C], use)
    sa = warpgroup_mma(q.slice(C * 256, 256, dim=1), k_own.slice(C * 256, 256, dim=1).permute([1, 0]), sa,
                       is_async=True)
    mbarrier.wait(kb[C * 3 + 1 - C], use)
    return warpgroup_mma(q.slice((1 - C) * 256, 256, dim=1), k_own.slice((1 - C) * 256, 256, dim=1).permute([1, 0]),
                         sa, is_async=True)


@gluon.jit
def _own_softmax(s, m_i, kc, scale_log2, start, end, lim_min, limit, offs_n, C: gl.constexpr, t,
                 zl: gl.constexpr):
    """Step 4 on the finished scores ``s`` of tile ``t``: the softmax from the running max ``m_i`` after tile
    t - 1 and a partial tile's value rows zeroed (visible to both warpgroups' ``P V`` before P_t is published);
    returns ``(P, max, alpha)``."""
    n0 = start + t * 64
    p, m_i, alpha = _ws_softmax(s, m_i, n0, end, lim_min, limit, offs_n, scale_log2)
    if n0 + 64 > end:
        zero_tail(kc[C].index(0), end - n0, zl)
        fence_async_shared()
        gl.thread_barrier()
    return p, m_i, alpha


@gluon.jit
def _own_pv(o, l_i, p, m_i, alpha, desc_h, desc_r, kc, kr, kb, p_s, m_s, a_s, pready, page, start, n_tiles,
            C: gl.constexpr, fill, z, BLOCK_SIZE: gl.constexpr, row_o: gl.constexpr, p_a: gl.constexpr):
    """Step 5: ``O *= alpha``, ``O += P_t V_t`` issued on this warpgroup's columns with P from registers; while
    it runs, P_t, its max and factor published in P buffer ``C`` (free: the module docstring); then, the dot
    done, slot ``C``'s rope columns (S_t, their only reader, is done) and this warpgroup's half take tile
    ``fill``'s (t + 2; ``page``: its block-table entry, ``start`` / ``n_tiles``: its range's); returns ``(o, l_i)``.
    (The dot is issued before the P stores: no shared-memory access between the publication's barrier and its
    arrival.)"""
    o = o * gl.convert_layout(alpha, row_o)[:, None]
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_a)
    o = warpgroup_mma(p_op, kc[C].index(z).slice(C * 256, 256, dim=1), o, is_async=True)
    _ws_publish(p, m_i, alpha, p_s[C].index(z), m_s[C], a_s[C], pready[C])
    o, p_op = warpgroup_mma_wait(0, deps=[o, p_op])  # P's registers kept until the dot is done
    gl.thread_barrier()
    _issue_rope_half(desc_r, desc_h, kr[C], kc[C], kb[C * 3 + 2], kb[C * 3 + C], page, fill, n_tiles, start, C,
                     BLOCK_SIZE)
    return o, l_i


@gluon.jit
def _fold_issue(o, l_i, p_s, m_s, a_s, kc, pready, C: gl.constexpr, phase, z, row_s: gl.constexpr,
                row_o: gl.constexpr):
    """Step 2: once the other warpgroup has published tile t - 1 (its ``pready`` barrier at ``phase``), take its
    running max and factor, rescale ``O`` and the row sums, and issue ``O += P_{t-1} V_{t-1}`` on this warpgroup's
    columns (P from the other's buffer); returns ``(pending O, l_i, m_i)``."""
    o, l_i, m_i = _ws_take(o, l_i, m_s[1 - C], a_s[1 - C], pready[1 - C], phase, row_s, row_o)
    pv = warpgroup_mma(p_s[1 - C].index(z), kc[1 - C].index(z).slice(C * 256, 256, dim=1), o, is_async=True)
    return pv, l_i, m_i


@gluon.jit
def _release_other(desc_h, kc, kb, page, start, n_tiles, C: gl.constexpr, fill, BLOCK_SIZE: gl.constexpr):
    """Step 3, once step 2's ``P V`` is done (every warp): this warpgroup's half of the other's slot takes tile
    ``fill``'s (t + 1; ``page``: its block-table entry, ``start`` / ``n_tiles``: its range's)."""
    gl.thread_barrier()
    _issue_half(desc_h, kc[1 - C], kb[(1 - C) * 3 + C], page, fill, n_tiles, start, C, BLOCK_SIZE)


@gluon.jit
def _store_out_tma(C: gl.constexpr, o, inv, q_s, kc, desc_o, row0, pid_s, o_l: gl.constexpr, DIRECT: gl.constexpr):
    """Store this warpgroup's 256 output columns ``o / l`` of the program's 64 rows (output rows ``row0`` on) through
    shared memory and one TMA copy, awaited before the warps exit (both warpgroups' dots are done,
    ``_ws_rows_done``, so the buffers are free). ``DIRECT``: bf16 into its half of the latent query rows' buffer,
    ``desc_o`` the output's ``[8, rows, 64]`` column blocks (box ``[4, 64, 64]``); else float32 into its own tile
    slot's latent part, ``desc_o`` the split workspace's ``[splits, 16, rows, 32]`` column blocks (box ``[1, 8, 64,
    32]``) at split ``pid_s``. Coalesced, against the scattered stores of the accumulator layout."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    out = o * gl.convert_layout(inv, row_o)[:, None]
    if DIRECT:
        q_s.index(0).slice(C * 256, 256, dim=1).store(out.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        src = q_s.index(0)._reinterpret(gl.bfloat16, [8, 64, 64], BOX_C).slice(4 * C, 4, dim=0)
        tma.async_copy_shared_to_global(desc_o, [4 * C, row0, 0], src)
    else:
        kc[C].index(0)._reinterpret(gl.float32, [64, 256], F32_C).store(out)
        fence_async_shared()
        gl.thread_barrier()
        src = kc[C].index(0)._reinterpret(gl.float32, [1, 8, 64, 32], F32_BOX_C)
        tma.async_copy_shared_to_global(desc_o, [pid_s, 8 * C, row0, 0], src)
    tma.store_wait(0)


@gluon.jit
def _seesaw(C: gl.constexpr, q_ptr, desc_h, desc_r, q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done, q_bar,
            bt_row, scale_log2, start, end, n_tiles, seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits,
            stride_qb, stride_qs, stride_qh, o_ptr, lse_ptr, desc_o,
            DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr,
            FOLD_FIRST: gl.constexpr, TMA_OUT: gl.constexpr, TMA_Q: gl.constexpr):
    """Warpgroup ``C`` of the module's schedule (its docstring: steps 1-5 a tile; ``FOLD_FIRST``: 2, 1, 4, 3, 5),
    then the fold of the other's last tile and the stores (``_ws_finish``; ``TMA_OUT``: :func:`_store_out_tma`)."""
    s_l: gl.constexpr = S_L
    o_l: gl.constexpr = O_L
    p_a: gl.constexpr = P_A
    q_a: gl.constexpr = Q_A
    zl: gl.constexpr = ZL
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)

    # the query rows' rope part, held in registers as the S dot's A operand (rows past M: zeros)
    m_q = pid_h * 64 + gl.arange(0, 64, gl.SliceLayout(1, q_a))
    q_row = q_ptr + b * stride_qb + (m_q // H).to(gl.int64) * stride_qs + (m_q % H).to(gl.int64) * stride_qh
    d_r = gl.arange(0, DR, gl.SliceLayout(0, q_a))
    qr = gl.load(q_row[:, None] + DC + d_r[None, :], mask=(m_q < M)[:, None], other=0.0)

    rows, row_ok, limit, lim_min = causal_rows(pid_h, 64, M, H, S_Q, seq_len, row_s)
    offs_n = gl.arange(0, 64, gl.SliceLayout(0, s_l))
    zero_s = gl.zeros([64, 64], gl.float32, s_l)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    o = gl.zeros([64, 256], gl.float32, o_l)
    if TMA_Q:
        mbarrier.wait(q_bar, 0)  # the latent query rows' copy (the kernel's prologue) landed

    if C == 0:  # tile 0: no tile of the other's before it
        if n_tiles > 0:
            z = opaque_zero(n_tiles)
            page2 = tile_page(bt_row, 2, n_tiles, start, BLOCK_SIZE, 64)
            sa = _scores(qr, q_s, kr, kc, kb, zero_s, C, 0, z)
            s = warpgroup_mma_wait(0, deps=[sa])
            p, m_i, alpha = _own_softmax(s, m_i, kc, scale_log2, start, end, lim_min, limit, offs_n, C, 0, zl)
            o, l_i = _own_pv(o, l_i, p, m_i, alpha, desc_h, desc_r, kc, kr, kb, p_s, m_s, a_s, pready, page2,
                             start, n_tiles, C, 2, z, BLOCK_SIZE, row_o, p_a)
    for t in range(2 - C, n_tiles, 2):
        z = opaque_zero(t)
        page1 = tile_page(bt_row, t + 1, n_tiles, start, BLOCK_SIZE, 64)  # block-table entries read ahead of use
        page2 = tile_page(bt_row, t + 2, n_tiles, start, BLOCK_SIZE, 64)
        if FOLD_FIRST:  # 2, 1, 3 once the fold is done (S_t's three groups may still run), then S_t awaited
            pv, l_i, m_i = _fold_issue(o, l_i, p_s, m_s, a_s, kc, pready, C, ((t - 1) // 2) & 1, z, row_s, row_o)
            sa = _scores(qr, q_s, kr, kc, kb, zero_s, C, (t // 2) & 1, z)
            o = warpgroup_mma_wait(3, deps=[pv])
            _release_other(desc_h, kc, kb, page1, start, n_tiles, C, t + 1, BLOCK_SIZE)
            s = warpgroup_mma_wait(0, deps=[sa])
        else:  # 1. S_t, each part as it arrives; 2. the other's tile t - 1; both awaited, 3
            sa = _scores(qr, q_s, kr, kc, kb, zero_s, C, (t // 2) & 1, z)
            pv, l_i, m_i = _fold_issue(o, l_i, p_s, m_s, a_s, kc, pready, C, ((t - 1) // 2) & 1, z, row_s, row_o)
            s, o = warpgroup_mma_wait(0, deps=[sa, pv])
            _release_other(desc_h, kc, kb, page1, start, n_tiles, C, t + 1, BLOCK_SIZE)
        # 4. S_t done: the softmax
        p, m_i, alpha = _own_softmax(s, m_i, kc, scale_log2, start, end, lim_min, limit, offs_n, C, t, zl)
        # 5. this warpgroup's own P V, P_t published meanwhile, then its half of slot C takes tile t + 2's
        o, l_i = _own_pv(o, l_i, p, m_i, alpha, desc_h, desc_r, kc, kr, kb, p_s, m_s, a_s, pready, page2, start,
                         n_tiles, C, t + 2, z, BLOCK_SIZE, row_o, p_a)

    last = n_tiles - 1
    if (n_tiles > 0) & (last % 2 != C):  # the last tile is the other's: fold it
        o, l_i, m_i = _ws_fold(C, o, l_i, p_s[1 - C].index(0), m_s[1 - C], a_s[1 - C], kc[1 - C], 0, pready[1 - C],
                               (last // 2) & 1, row_s, row_o)
    if TMA_OUT:
        inv, _ = _ws_rows_done(C, l_i, m_i, x_s, done, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT,
                               row_s, 0)
        _store_out_tma(C, o, inv, q_s, kc, desc_o, (b * M + pid_h * 64).to(gl.int32), pid_s, o_l, DIRECT)
    else:
        _ws_finish(C, o, l_i, m_i, x_s, done, rows, row_ok, b, M, pid_s, n_splits, o_ptr, lse_ptr, DC, DIRECT, row_s,
                   o_l, 0)


@gluon.jit
def alloc_buffers(DC: gl.constexpr, DR: gl.constexpr, Q_ARRIVALS: gl.constexpr):
    """The seesaw's shared buffers (:func:`smem_bytes`) and barriers, initialized and fenced before any copy signals
    them: ``(q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done, q_bar)``; ``kb[3 s + h]`` is slot s's latent half h
    (h = 2: its rope columns); ``q_bar`` completes after ``Q_ARRIVALS`` arrivals. One allocation per slot, P buffer,
    hand-over row and barrier: the compiler's shared-memory hazard analysis sees views of one allocation as one
    buffer and would put a barrier between any two of their accesses."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    q_s = gl.allocate_shared_memory(gl.bfloat16, [1, 64, DC], SMEM_C)
    kc = (gl.allocate_shared_memory(gl.bfloat16, [1, 64, DC], SMEM_C),
          gl.allocate_shared_memory(gl.bfloat16, [1, 64, DC], SMEM_C))
    kr = (gl.allocate_shared_memory(gl.bfloat16, [1, 64, DR], SMEM_C),
          gl.allocate_shared_memory(gl.bfloat16, [1, 64, DR], SMEM_C))
    p_s = (gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], SMEM_C),
           gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], SMEM_C))
    m_s = (gl.allocate_shared_memory(gl.float32, [64], plain), gl.allocate_shared_memory(gl.float32, [64], plain))
    a_s = (gl.allocate_shared_memory(gl.float32, [64], plain), gl.allocate_shared_memory(gl.float32, [64], plain))
    x_s = gl.allocate_shared_memory(gl.float32, [2, 64], plain)
    kb = (gl.allocate_shared_memory(gl.int64, [1], bar_l), gl.allocate_shared_memory(gl.int64, [1], bar_l),
          gl.allocate_shared_memory(gl.int64, [1], bar_l), gl.allocate_shared_memory(gl.int64, [1], bar_l),
          gl.allocate_shared_memory(gl.int64, [1], bar_l), gl.allocate_shared_memory(gl.int64, [1], bar_l))
    pready = (gl.allocate_shared_memory(gl.int64, [1], bar_l), gl.allocate_shared_memory(gl.int64, [1], bar_l))
    done = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    for i in gl.static_range(6):
        mbarrier.init(kb[i], count=1)
    for i in gl.static_range(2):
        mbarrier.init(pready[i], count=1)
        mbarrier.init(done.index(i), count=1)
    mbarrier.init(q_bar, count=Q_ARRIVALS)
    fence_async_shared()
    gl.thread_barrier()  # the barriers initialized before any copy signals them
    return q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done, q_bar


@gluon.jit
def decode_gluon_seesaw_kernel(
    q_ptr, desc_h, desc_r, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_bt,
    M, H, S_Q, n_splits,
    DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr,
    FOLD_FIRST: gl.constexpr = False, TMA_OUT: gl.constexpr = False, desc_o=None, TMA_Q: gl.constexpr = False,
    desc_q=None,
):
    """``decode_gluon_kernel``'s contract with :data:`WARPS` warps plus a 4-warp worker; ``desc_h`` spans the
    cache's latent columns as ``[8, rows, 64]`` with a box of half a tile (``[4, 64, 64]``), ``desc_r`` its rows
    ``[rows, 576]`` (box ``[64, 64]``, the rope columns). The kernel's warps stage the latent query rows and
    start tiles 0 and 1; the module docstring has the schedule (``FOLD_FIRST``: its variant). ``TMA_OUT`` (``M`` a
    multiple of 64): each warpgroup stores its output columns through shared memory with one TMA copy; ``desc_o``
    spans ``o_ptr``'s rows as ``[8, rows, 64]`` column blocks (box ``[4, 64, 64]``) with one split (``DIRECT``), else
    the float32 workspace ``[rows, splits, 512]`` as ``[splits, 16, rows, 32]`` (box ``[1, 8, 64, 32]``). ``TMA_Q``
    (``M`` a multiple of 64, q's rows dense): ``desc_q`` spans q's latent columns as ``[8, rows, 64]`` (box ``[8, 64,
    64]``) and the program's rows come by one TMA copy started before the prologue's loads, awaited by each
    warpgroup."""
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    gl.static_assert(BLOCK_SIZE % 64 == 0)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64
    pid_h = gl.program_id(0)

    q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done, q_bar = alloc_buffers(DC, DR, 1)
    if TMA_Q:  # the latent query rows first: their copy needs no load of the prologue's
        mbarrier.expect(q_bar, 64 * DC * 2)
        tma.async_copy_global_to_shared(desc_q, [0, (gl.program_id(2) * M + pid_h * 64).to(gl.int32), 0], q_bar,
                                        q_s.index(0)._reinterpret(gl.bfloat16, [8, 64, 64], BOX_C))
    else:  # one load (rows past M: zeros, never stored), stored to shared memory below
        m_q = pid_h * 64 + gl.arange(0, 64, gl.SliceLayout(1, q_l))
        q_row = (q_ptr + gl.program_id(2).to(gl.int64) * stride_qb + (m_q // H).to(gl.int64) * stride_qs
                 + (m_q % H).to(gl.int64) * stride_qh)
        d_q = gl.arange(0, DC, gl.SliceLayout(0, q_l))
        q = gl.load(q_row[:, None] + d_q[None, :], mask=(m_q < M)[:, None], other=0.0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, 64)
    pages = (tile_page(bt_row, 0, n_tiles, start, BLOCK_SIZE, 64),  # the block-table entries of tiles 0 and 1
             tile_page(bt_row, 1, n_tiles, start, BLOCK_SIZE, 64))
    for t in gl.static_range(2):
        _issue_rope(desc_r, kr[t], kb[t * 3 + 2], pages[t], t, n_tiles, start, BLOCK_SIZE)
        for h in gl.static_range(2):
            _issue_half(desc_h, kc[t], kb[t * 3 + h], pages[t], t, n_tiles, start, h, BLOCK_SIZE)
    if not TMA_Q:
        q_s.index(0).store(q.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
    gl.warp_specialize([
        (_seesaw, (0, q_ptr, desc_h, desc_r, q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done, q_bar, bt_row,
                   scale_log2, start, end, n_tiles, seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits, stride_qb,
                   stride_qs, stride_qh, o_ptr, lse_ptr, desc_o, DC, DR, BLOCK_SIZE, DIRECT, FOLD_FIRST, TMA_OUT,
                   TMA_Q)),
        (_seesaw, (1, q_ptr, desc_h, desc_r, q_s, kc, kr, p_s, m_s, a_s, x_s, kb, pready, done, q_bar, bt_row,
                   scale_log2, start, end, n_tiles, seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits, stride_qb,
                   stride_qs, stride_qh, o_ptr, lse_ptr, desc_o, DC, DR, BLOCK_SIZE, DIRECT, FOLD_FIRST, TMA_OUT,
                   TMA_Q)),
    ], [4], [WORKER_REGS])  # WARPS
