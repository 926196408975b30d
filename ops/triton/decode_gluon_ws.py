"""The warp-specialized sm_90 Gluon bf16 decode (``decode_gluon.launch`` with ``config={"WS": True}``, backend
"gluon-ws"); the design is in ``decode_gluon``'s docstring, the contract is ``decode_gluon_kernel``'s."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mla_compile.ops.triton._bf16_tma import issue_tile, zero_tail
from mla_compile.ops.triton._fp8_tma import opaque_zero
from mla_compile.ops.triton._gluon import (SMEM_C, causal_rows, finish_rows, mask_scores, split_range, stage_query_rows,
                                           tile_page)


@gluon.jit
def _ws_produce(desc_c, desc_r, kc_s, kr_s, full, empty, bt_row, n_tiles, start, BLOCK_SIZE: gl.constexpr):
    """The producer warp: tile t into slot t % 2 (``full``) once both consumers released tile t - 2 from it
    (``empty``, two arrivals a use); block-table entries a tile ahead."""
    page = tile_page(bt_row, 0, n_tiles, start, BLOCK_SIZE, 64)
    for t in range(n_tiles):
        page_next = tile_page(bt_row, t + 1, n_tiles, start, BLOCK_SIZE, 64)
        mbarrier.wait(empty.index(t % 2), ((t // 2) - 1) & 1, pred=t >= 2)
        issue_tile(desc_c, desc_r, kc_s, kr_s, full, page, t, n_tiles, start, BLOCK_SIZE)
        page = page_next


@gluon.jit
def _ws_softmax(s, m_prev, n0, end, lim_min, limit, offs_n, scale_log2):
    """Scores ``S`` of the tile at ``n0`` to ``(P, m, alpha)``: masked base-2 scores, the rows' new running max
    after ``m_prev`` and the factor ``alpha`` that takes sums relative to ``m_prev`` to sums relative to ``m``."""
    s = mask_scores(s, n0, end, lim_min, limit, offs_n, scale_log2)
    m_new = gl.maximum(m_prev, gl.max(s, axis=1))
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
    return gl.exp2(s - m_shift[:, None]), m_new, gl.exp2(m_prev - m_shift)


@gluon.jit
def _ws_publish(p, m_new, alpha, p_s, m_s, a_s, bar):
    """Hand a tile's ``P`` (bf16), running max and ``alpha`` to the other consumer through shared memory and
    signal ``bar`` (one arrival, after this consumer's warps have stored)."""
    p_s.store(p.to(gl.bfloat16))
    m_s.store(m_new)
    a_s.store(alpha)
    fence_async_shared()  # P is read by the other consumer's wgmma
    gl.thread_barrier()  # (this consumer's warps)
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _ws_consume(C: gl.constexpr, q_s, qr_s, kc_s, kr_s, p_s, m_s, a_s, x_s, full, empty, pready, done,
                scale_log2, start, end, n_tiles, seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits, o_ptr, lse_ptr,
                DC: gl.constexpr, DIRECT: gl.constexpr):
    """Consumer warpgroup ``C``: owns output columns ``[256 C, 256 C + 256)`` of every tile and the scores and
    softmax of the tiles t = C, C + 2, ...; the running max passes between the consumers with each tile's P.

    Its own tile t: ``S_t`` (its S dot issued before it handles the other's tile t - 1, so that dot runs
    while it waits), the softmax from the max after tile t - 1 (read with tile t - 1's hand-over), zeroed
    value rows of a partial tile, P_t / max / alpha handed over (``pready``), then ``O += P_t V_t`` with P
    from registers. The other's tile t: ``O *= alpha_t``, ``O += P_t V_t`` with P from shared memory (one
    buffer: each consumer writes it only after its own read of the other's P is done). Each tile's slot
    is released (``empty``) by both consumers once their reads of it are done. At the end consumer 1 hands
    its row sums to consumer 0 (``done``), which stores the LSE; each stores its columns."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    p_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    rows, row_ok, limit, lim_min = causal_rows(pid_h, 64, M, H, S_Q, seq_len, row_s)
    offs_n = gl.arange(0, 64, gl.SliceLayout(0, s_l))
    zero_s = gl.zeros([64, 64], gl.float32, s_l)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    o = gl.zeros([64, 256], gl.float32, o_l)

    if C == 0:  # tile 0: nothing of the other's before it
        if n_tiles > 0:
            z = opaque_zero(n_tiles)
            mbarrier.wait(full.index(0), 0)
            s = warpgroup_mma(qr_s.index(z), kr_s.index(z).permute([1, 0]), zero_s)
            s = warpgroup_mma(q_s.index(z), kc_s.index(z).permute([1, 0]), s)
            p, m_i, alpha = _ws_softmax(s, m_i, start, end, lim_min, limit, offs_n, scale_log2)
            if start + 64 > end:
                zero_tail(kc_s.index(0), end - start, zl)
            _ws_publish(p, m_i, alpha, p_s.index(z), m_s, a_s, pready.index(0))
            l_i = gl.sum(p, axis=1)
            o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_a), kc_s.index(z).slice(0, 256, dim=1), o)
            gl.thread_barrier()  # every warp's dots done before the release
            mbarrier.arrive(empty.index(0), count=1)
    for t in range(2 - C, n_tiles, 2):
        slot = t % 2
        prev = 1 - slot
        n0 = start + t * 64
        z = opaque_zero(t)  # the loop-invariant operands indexed by it: descriptors made in the loop, not held
        mbarrier.wait(full.index(slot), (t // 2) & 1)
        sa = warpgroup_mma(qr_s.index(z), kr_s.index(slot).permute([1, 0]), zero_s, is_async=True)
        sa = warpgroup_mma(q_s.index(z), kc_s.index(slot).permute([1, 0]), sa, is_async=True)
        # the other's tile t - 1
        mbarrier.wait(full.index(prev), ((t - 1) // 2) & 1)  # (long complete: its P came after it)
        o, l_i, m_i = _ws_take(o, l_i, m_s, a_s, pready.index(prev), ((t - 1) // 2) & 1, row_s, row_o)
        pv = warpgroup_mma(p_s.index(z), kc_s.index(prev).slice(C * 256, 256, dim=1), o, is_async=True)
        # this consumer's tile t
        s = warpgroup_mma_wait(1, deps=[sa])
        p, m_i, alpha = _ws_softmax(s, m_i, n0, end, lim_min, limit, offs_n, scale_log2)
        if n0 + 64 > end:
            zero_tail(kc_s.index(slot), end - n0, zl)
        o = warpgroup_mma_wait(0, deps=[pv])
        gl.thread_barrier()  # every warp's read of the other's P and of tile t - 1 done: P's buffer is free
        mbarrier.arrive(empty.index(prev), count=1)
        _ws_publish(p, m_i, alpha, p_s.index(z), m_s, a_s, pready.index(slot))
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        l_i = l_i * alpha + gl.sum(p, axis=1)
        o = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_a), kc_s.index(slot).slice(C * 256, 256, dim=1), o)
        gl.thread_barrier()
        mbarrier.arrive(empty.index(slot), count=1)
    last = n_tiles - 1
    if (n_tiles > 0) & (last % 2 != C):  # the last tile is the other's
        slot = last % 2
        mbarrier.wait(full.index(slot), (last // 2) & 1)
        o, l_i, m_i = _ws_fold(C, o, l_i, p_s.index(0), m_s, a_s, kc_s, slot, pready.index(slot), (last // 2) & 1,
                               row_s, row_o)
        mbarrier.arrive(empty.index(slot), count=1)

    _ws_finish(C, o, l_i, m_i, x_s, done, rows, row_ok, b, M, pid_s, n_splits, o_ptr, lse_ptr, DC, DIRECT, row_s,
               o_l, 0)


@gluon.jit
def _ws_take(o, l_i, m_s, a_s, ready, phase, row_s: gl.constexpr, row_o: gl.constexpr):
    """Take the other consumer's hand-over of a tile: wait for it (``ready`` at ``phase``), read its running max
    (``m_s``) and factor (``a_s``) and rescale ``o`` / ``l_i`` by the factor; returns ``(o, l_i, m_i)``, ready for
    that tile's ``P V``."""
    mbarrier.wait(ready, phase)
    alpha_o = a_s.load(row_s)
    m_i = m_s.load(row_s)
    o = o * gl.convert_layout(alpha_o, row_o)[:, None]
    return o, l_i * alpha_o, m_i


@gluon.jit
def _ws_fold(C: gl.constexpr, o, l_i, p_s, m_s, a_s, kc_s, slot, ready, phase, row_s: gl.constexpr,
             row_o: gl.constexpr):
    """Fold the other consumer's tile (in slot ``slot`` of ``kc_s``) into consumer ``C``'s columns: its hand-over
    (:func:`_ws_take`), then ``P V`` (P from ``p_s``); returns ``(o, l_i, m_i)`` once the dot is done (every warp
    of the consumer)."""
    o, l_i, m_i = _ws_take(o, l_i, m_s, a_s, ready, phase, row_s, row_o)
    o = warpgroup_mma(p_s, kc_s.index(slot).slice(C * 256, 256, dim=1), o)
    gl.thread_barrier()
    return o, l_i, m_i


@gluon.jit
def _ws_rows_done(C: gl.constexpr, l_i, m_i, x_s, done, rows, row_ok, b, M, pid_s, n_splits, lse_ptr,
                  DC: gl.constexpr, DIRECT: gl.constexpr, row_s: gl.constexpr, phase):
    """The rows' end for consumer ``C`` (both with the same running max ``m_i``, each with the row sums ``l_i`` of
    its own tiles): consumer 1 hands its sums to consumer 0 (``x_s[0]``, ``done[0]``), which adds its own, stores
    the LSE (``_gluon.finish_rows``) and hands the total back (``x_s[1]``, ``done[1]``); returns ``(1 / l, first
    output element)`` per row. On return the other consumer has finished its tiles (every dot of it done).
    ``phase``: the ``done`` barriers' (0 for a program's only rows; a persistent program's count of rows ends)."""
    if C == 1:
        x_s.index(0).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done.index(0), count=1)
        mbarrier.wait(done.index(1), phase)
        l_i = x_s.index(1).load(row_s)
        empty_row = l_i == 0.0
        inv = 1.0 / gl.where(empty_row, 1.0, l_i)
        if DIRECT:
            o_first = (b * M + rows) * DC
        else:
            o_first = ((b * M + rows) * n_splits + pid_s) * DC
    else:
        mbarrier.wait(done.index(0), phase)
        l_i = l_i + x_s.index(0).load(row_s)
        x_s.index(1).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done.index(1), count=1)
        inv, o_first = finish_rows(l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT)
    return inv, o_first


@gluon.jit
def _ws_finish(C: gl.constexpr, o, l_i, m_i, x_s, done, rows, row_ok, b, M, pid_s, n_splits, o_ptr, lse_ptr,
               DC: gl.constexpr, DIRECT: gl.constexpr, row_s: gl.constexpr, o_l: gl.constexpr, phase):
    """The end of consumer ``C``: :func:`_ws_rows_done` (``done`` at ``phase``), then its 256 output columns
    ``o / l`` stored."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    inv, o_first = _ws_rows_done(C, l_i, m_i, x_s, done, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT,
                                 row_s, phase)
    cols = C * 256 + gl.arange(0, 256, gl.SliceLayout(0, o_l))
    first = gl.convert_layout(o_first, row_o)
    ok = gl.convert_layout(row_ok, row_o)
    ty: gl.constexpr = o_ptr.dtype.element_ty
    gl.store(o_ptr + first[:, None] + cols[None, :], (o * gl.convert_layout(inv, row_o)[:, None]).to(ty),
             mask=ok[:, None])


@gluon.jit
def decode_gluon_ws_kernel(
    q_ptr, desc_c, desc_r, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_bt,
    M, H, S_Q, n_splits,
    DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr,
):
    """``decode_gluon_kernel``'s contract, warp-specialized: 4 warps (consumer 0) plus a consumer warpgroup
    and a producer warp (``gl.warp_specialize``); the consumers take alternate tiles' scores and softmax
    (``_ws_consume``), so one's softmax runs while the other's dots do."""
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    gl.static_assert(BLOCK_SIZE % 64 == 0)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    scale_log2 = gl.full([], scale_log2, gl.float32)
    pid_h = gl.program_id(0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, 64)

    q_s = gl.allocate_shared_memory(gl.bfloat16, [1, 64, DC], SMEM_C)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [1, 64, DR], SMEM_C)
    kc_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, DC], SMEM_C)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, DR], SMEM_C)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], SMEM_C)
    m_s = gl.allocate_shared_memory(gl.float32, [64], plain)
    a_s = gl.allocate_shared_memory(gl.float32, [64], plain)
    x_s = gl.allocate_shared_memory(gl.float32, [2, 64], plain)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
        mbarrier.init(pready.index(i), count=1)
        mbarrier.init(done.index(i), count=1)

    stage_query_rows(q_ptr, q_s.index(0), qr_s.index(0), b, pid_h, M, H, stride_qb, stride_qs, stride_qh, 64, DC, q_l)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([
        (_ws_produce, (desc_c, desc_r, kc_s, kr_s, full, empty, bt_row, n_tiles, start, BLOCK_SIZE)),
        (_ws_consume, (0, q_s, qr_s, kc_s, kr_s, p_s, m_s, a_s, x_s, full, empty, pready, done, scale_log2, start,
                       end, n_tiles, seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits, o_ptr, lse_ptr, DC, DIRECT)),
        (_ws_consume, (1, q_s, qr_s, kc_s, kr_s, p_s, m_s, a_s, x_s, full, empty, pready, done, scale_log2, start,
                       end, n_tiles, seq_len, pid_h, b, pid_s, M, H, S_Q, n_splits, o_ptr, lse_ptr, DC, DIRECT)),
    ], [4, 4], [240, 240])  # the producer in the 4 default warps (the registers left), the consumers as workers
