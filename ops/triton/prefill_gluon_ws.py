"""The warp-specialized sm_90 Gluon prefill (``prefill_gluon.launch`` with ``config={"WS": True}``, backend
"gluon-ws"): a TMA producer and two consumer warpgroups, per program or persistent (``PERSIST``); the design is in
``prefill_gluon``'s docstring."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mla_compile.ops.triton._gluon import SMEM_C
from mla_compile.ops.triton._prefill_gluon import (_issue, _item, _key_row, _program, _softmax_tile, _store_rows,
                                                   _store_rows_tma)


@gluon.jit
def _ws_produce(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, empty, n_tiles, k_start, len_k, col_k, col_v,
                DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                KV_SPLIT: gl.constexpr, base=0, t_lo=0, t_hi=None):
    """The producer (the default 4 warps): tile t into slot r % STAGES (``full``; r = ``base`` + t, ``base`` the
    ring's uses before this work item) once both consumers released ring use r - STAGES from it (``empty``, two
    arrivals a use). ``KV_SPLIT``: keys and values of a slot on barriers of their own (``full`` / ``empty``
    ``[slot]`` the keys', ``[STAGES + slot]`` the values'): tile t's keys are copied once the scores of the slot's
    use before are done, before its ``P V`` is. Tiles ``[t_lo, t_hi)`` (default: all ``n_tiles``)."""
    hi = n_tiles if t_hi is None else t_hi
    for t in range(t_lo, hi):
        r = base + t
        if KV_SPLIT:
            slot = r % STAGES
            phase = ((r // STAGES) - 1) & 1
            kr = _key_row(t, k_start, len_k, BLOCK_N)
            mbarrier.wait(empty.index(slot), phase, pred=r >= STAGES)
            mbarrier.expect(full.index(slot), BLOCK_N * (DA + DB) * 2)
            tma.async_copy_global_to_shared(ka_desc, [kr, col_k], full.index(slot), ka_s.index(slot))
            tma.async_copy_global_to_shared(kb_desc, [kr, col_k + DA], full.index(slot), kb_s.index(slot))
            mbarrier.wait(empty.index(STAGES + slot), phase, pred=r >= STAGES)
            mbarrier.expect(full.index(STAGES + slot), BLOCK_N * DV * 2)
            tma.async_copy_global_to_shared(v_desc, [kr, col_v], full.index(STAGES + slot), v_s.index(slot))
        else:
            mbarrier.wait(empty.index(r % STAGES), ((r // STAGES) - 1) & 1, pred=r >= STAGES)
            _issue(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, t, n_tiles, k_start, len_k, col_k, col_v,
                   DA, DB, DV, BLOCK_N, STAGES, base)


@gluon.jit
def _ws_tiles(c, m0, off, len_k, n_tiles, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, PIPE: gl.constexpr):
    """``(n_mine, turns)`` of consumer warpgroup ``c`` (rows ``m0 + 64 c + [0, 64)``): its tiles with work (those
    holding a key its rows see: a prefix of the producer's ``n_tiles``) and its ``PINGPONG`` turns (``PIPE``: one a
    pipelined step, ``n_mine - 1``; else ``n_mine + 1``; none without tiles). Each consumer reads both's."""
    hi = len_k
    if CAUSAL:
        hi = gl.minimum(len_k, m0 + c * 64 + 64 + off)
    n_mine = gl.minimum(n_tiles, gl.cdiv(gl.maximum(hi, 0), BLOCK_N))
    if PIPE:
        turns = gl.maximum(n_mine - 1, 0)
    else:
        turns = n_mine + (n_mine > 0).to(gl.int32)
    return n_mine, turns


@gluon.jit
def _turn_wait(turn, C: gl.constexpr, k, other_turns):
    """(``PINGPONG``) Consumer ``C``'s turn ``k``: the k-th completion of ``turn[C]`` (of ``turn[0]``: the kernel's
    first, then consumer 1's hand-overs), waited for only where the other consumer makes it."""
    mbarrier.wait(turn.index(C), k & 1, pred=k < other_turns + (1 - C))


@gluon.jit
def _turn_pass(turn, C: gl.constexpr):
    """(``PINGPONG``) Hand the turn to the other consumer once every warp of this one has issued its dots."""
    gl.thread_barrier()
    mbarrier.arrive(turn.index(1 - C), count=1)


@gluon.jit
def _ws_consume(C: gl.constexpr, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, turn, scale_log2, q_start, len_q,
                len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr,
                DV: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                KV_SPLIT: gl.constexpr, PIPE: gl.constexpr, FOLD: gl.constexpr, PINGPONG: gl.constexpr,
                base=0, qphase=0, qempty=None, o_desc=None, TMA_OUT: gl.constexpr = False):
    """Consumer warpgroup ``C``: query rows ``m0 + 64 C + [0, 64)``; every tile: ``S`` (two async ``wgmma``
    k-groups), the online softmax, ``O += P V`` with P from registers, then the slot released (``empty``;
    ``KV_SPLIT``: the keys released after ``S``, the values waited for before ``P V`` and released after it;
    ``PIPE``: :func:`_ws_pipelined_tiles`). Causal tiles past this warpgroup's last visible key are released
    without work. ``PINGPONG``: the dots issued in turns with the other consumer (``turn``, the module
    docstring). Stores its rows at the end. The persistent kernel's work items: ``base`` the ring's uses before
    this item, ``qphase`` the query tile's (``qbar``) phase, and ``qempty`` (not None) signalled once this
    consumer's dots are done, before its stores, so the producer may load the next item's query rows. ``TMA_OUT``
    (``DV`` the query tile's first part's width): 64 rows all inside the sequence are stored through this
    consumer's query buffer ``qa_s[C]`` (free once its dots are done) and one TMA copy (``o_desc``), ``qempty``
    signalled once the copy has read the buffer; others as before."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    dt: gl.constexpr = o_ptr.dtype.element_ty
    offs_m = m0 + C * 64 + gl.arange(0, 64, row_s)
    lim = offs_m + off
    n_mine, _ = _ws_tiles(C, m0, off, len_k, n_tiles, BLOCK_N, CAUSAL, PIPE)
    _, other_turns = _ws_tiles(1 - C, m0, off, len_k, n_tiles, BLOCK_N, CAUSAL, PIPE)
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, s_l)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([64], gl.float32, row_s)
    o = gl.zeros([64, DV], gl.float32, o_l)
    mbarrier.wait(qbar, qphase)
    qa = qa_s.index(C)
    qb = qb_s.index(C)
    if PIPE:
        o, m_i, l_i = _ws_pipelined_tiles(qa, qb, ka_s, kb_s, v_s, full, empty, turn, zero_s, o, m_i, l_i, scale_log2,
                                          n_mine, other_turns, full_end, len_k, lim, n_tiles, C, BLOCK_N, CAUSAL,
                                          STAGES, KV_SPLIT, PINGPONG, p_a, row_o, col_s, dt, FOLD, base)
    else:
        for j in range(n_tiles):
            slot = (base + j) % STAGES
            phase = ((base + j) // STAGES) & 1
            n0 = j * BLOCK_N
            mbarrier.wait(full.index(slot), phase)
            if j < n_mine:
                if PINGPONG:
                    if j == 0:  # turn 0: tile 0's S alone; turn j + 1: tile j's P V and tile j + 1's S
                        _turn_wait(turn, C, 0, other_turns)
                qk = warpgroup_mma(qa, ka_s.index(slot).permute([1, 0]), zero_s, use_acc=False, is_async=True)
                qk = warpgroup_mma(qb, kb_s.index(slot).permute([1, 0]), qk, is_async=True)
                if PINGPONG:
                    _turn_pass(turn, C)
                s = warpgroup_mma_wait(0, deps=[qk])
                if KV_SPLIT:
                    gl.thread_barrier()  # (this consumer's warps) the keys read before their release
                    mbarrier.arrive(empty.index(slot), count=1)
                p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, n0, full_end, len_k, lim, scale_log2, BLOCK_N, CAUSAL,
                                                   col_s, FOLD)
                o = o * gl.convert_layout(alpha, row_o)[:, None]
                if KV_SPLIT:
                    mbarrier.wait(full.index(STAGES + slot), phase)
                if PINGPONG:
                    _turn_wait(turn, C, j + 1, other_turns)
                pv = warpgroup_mma(gl.convert_layout(p.to(dt), p_a), v_s.index(slot), o, is_async=True)
                if PINGPONG:
                    if j == n_mine - 1:  # the last turn (tile j's P V alone) handed over before any skipped tile
                        _turn_pass(turn, C)
                o = warpgroup_mma_wait(0, deps=[pv])
            elif KV_SPLIT:
                mbarrier.arrive(empty.index(slot), count=1)
                mbarrier.wait(full.index(STAGES + slot), phase)
            gl.thread_barrier()  # (this consumer's warps) every read of the slot done before the release
            if KV_SPLIT:
                mbarrier.arrive(empty.index(STAGES + slot), count=1)
            else:
                mbarrier.arrive(empty.index(slot), count=1)
    if TMA_OUT and (m0 + C * 64 + 64 <= len_q):
        _store_rows_tma(o, m_i, l_i, q_start, offs_m, len_q, h, H, lse_ptr, o_desc, qa, q_start + m0 + C * 64, DV,
                        row_o)
        if qempty is not None:  # the query buffer free again once the copy has read it
            gl.thread_barrier()  # (this consumer's warps) past the copy's wait
            mbarrier.arrive(qempty, count=1)
    else:
        if qempty is not None:
            gl.thread_barrier()  # (this consumer's warps) every dot reading the query rows done
            mbarrier.arrive(qempty, count=1)
        _store_rows(o, m_i, l_i, q_start, offs_m, len_q, h, H, o_ptr, lse_ptr, DV, row_o, o_l)


@gluon.jit
def _ws_pipelined_tiles(qa, qb, ka_s, kb_s, v_s, full, empty, turn, zero_s, o, m_i, l_i, scale_log2, n_mine,
                        other_turns, full_end, len_k, lim, n_tiles, C: gl.constexpr, BLOCK_N: gl.constexpr,
                        CAUSAL: gl.constexpr, STAGES: gl.constexpr, KV_SPLIT: gl.constexpr, PINGPONG: gl.constexpr,
                        p_a: gl.constexpr, row_o: gl.constexpr, col_s: gl.constexpr, dt: gl.constexpr,
                        FOLD: gl.constexpr, base=0):
    """The tiles of :func:`_ws_consume` software-pipelined inside the warpgroup (``PIPE``; FA3's intra-warpgroup
    overlap): tile j's ``S`` dots and tile j - 1's ``P V`` are in flight together, tile j's softmax runs while
    ``P V`` does, and ``O`` takes tile j's rescale once ``P V`` is done (it then holds tile j - 1's sum at tile j's
    maximum). Tile j - 1's values (its whole slot without ``KV_SPLIT``) are released after its ``P V``; with
    ``KV_SPLIT`` tile j's keys right after its ``S``. The ``n_mine`` tiles this warpgroup sees are a prefix of the
    producer's; the rest are released without work. ``PINGPONG``: step j (j >= 1) is turn j - 1, its two dots
    issued between :func:`_turn_wait` and :func:`_turn_pass`. ``base``: the ring's uses before this work item
    (tile j is ring use ``base + j``). Returns ``(o, m_i, l_i)``."""
    VB: gl.constexpr = STAGES if KV_SPLIT else 0  # the values' barriers: [VB + slot]
    if n_mine > 0:
        first = base % STAGES
        mbarrier.wait(full.index(first), (base // STAGES) & 1)
        qk = warpgroup_mma(qa, ka_s.index(first).permute([1, 0]), zero_s, use_acc=False, is_async=True)
        qk = warpgroup_mma(qb, kb_s.index(first).permute([1, 0]), qk, is_async=True)
        s = warpgroup_mma_wait(0, deps=[qk])
        if KV_SPLIT:
            gl.thread_barrier()
            mbarrier.arrive(empty.index(first), count=1)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, full_end, len_k, lim, scale_log2, BLOCK_N, CAUSAL, col_s,
                                           FOLD)
        p_op = gl.convert_layout(p.to(dt), p_a)
        for j in range(1, n_mine):
            slot = (base + j) % STAGES
            prev = (base + j - 1) % STAGES
            mbarrier.wait(full.index(slot), ((base + j) // STAGES) & 1)
            if PINGPONG:
                _turn_wait(turn, C, j - 1, other_turns)
            qk = warpgroup_mma(qa, ka_s.index(slot).permute([1, 0]), zero_s, use_acc=False, is_async=True)
            qk = warpgroup_mma(qb, kb_s.index(slot).permute([1, 0]), qk, is_async=True)
            if KV_SPLIT:
                mbarrier.wait(full.index(VB + prev), ((base + j - 1) // STAGES) & 1)
            pv = warpgroup_mma(p_op, v_s.index(prev), o, is_async=True)
            if PINGPONG:
                _turn_pass(turn, C)
            s = warpgroup_mma_wait(1, deps=[qk])  # the S dots done; P V may still run
            if KV_SPLIT:
                gl.thread_barrier()
                mbarrier.arrive(empty.index(slot), count=1)
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j * BLOCK_N, full_end, len_k, lim, scale_log2, BLOCK_N,
                                               CAUSAL, col_s, FOLD)
            o = warpgroup_mma_wait(0, deps=[pv])
            gl.thread_barrier()  # (this consumer's warps) every read of tile j - 1's values done before the release
            mbarrier.arrive(empty.index(VB + prev), count=1)
            o = o * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dt), p_a)
        last = (base + n_mine - 1) % STAGES
        if KV_SPLIT:
            mbarrier.wait(full.index(VB + last), ((base + n_mine - 1) // STAGES) & 1)
        pv = warpgroup_mma(p_op, v_s.index(last), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=[pv])
        gl.thread_barrier()
        mbarrier.arrive(empty.index(VB + last), count=1)
    for j in range(gl.maximum(n_mine, 0), n_tiles):
        slot = (base + j) % STAGES
        mbarrier.wait(full.index(slot), ((base + j) // STAGES) & 1)
        mbarrier.arrive(empty.index(slot), count=1)
        if KV_SPLIT:
            mbarrier.wait(full.index(VB + slot), ((base + j) // STAGES) & 1)
            mbarrier.arrive(empty.index(VB + slot), count=1)
    return o, m_i, l_i


@gluon.jit
def _issue_q(qa_desc, qb_desc, qa_s, qb_s, qbar, q_start, m0, h, stride_qh, DA: gl.constexpr, DB: gl.constexpr):
    """Start the copies of the 128 query rows from ``q_start + m0`` (head ``h``'s columns) into the two consumers'
    halves ``qa_s`` / ``qb_s [2, 64, .]`` on ``qbar``."""
    q_row = q_start + m0
    mbarrier.expect(qbar, 128 * (DA + DB) * 2)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(qa_desc, [q_row + 64 * c, h * stride_qh], qbar, qa_s.index(c))
        tma.async_copy_global_to_shared(qb_desc, [q_row + 64 * c, h * stride_qh + DA], qbar, qb_s.index(c))


@gluon.jit
def _grab_item(counter_ptr, wbuf, itembar, k):
    """(``PERSIST``) The producer takes the program's k-th work item, the next of the launch's counter (one atomic
    add), and hands it to the consumers: ``wbuf[k % 2]``, then an arrival on ``itembar`` (its k-th phase)."""
    wl: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    w = gl.atomic_add(counter_ptr, 1)
    wbuf.index(k % 2).store(gl.full([1], w, gl.int32, wl))
    gl.thread_barrier()  # (the producer's warps) the item stored before the arrival
    mbarrier.arrive(itembar, count=1)
    return w


@gluon.jit
def _next_item(wbuf, itembar, k):
    """(``PERSIST``) A consumer's k-th work item: once ``itembar``'s k-th phase completed, ``wbuf[k % 2]``."""
    wl: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    mbarrier.wait(itembar, k & 1)
    return gl.max(wbuf.index(k % 2).load(wl), axis=0)


@gluon.jit
def _take_item(wbuf, itembar, k, RECEIPT: gl.constexpr):
    """(``PERSIST``) :func:`_next_item` on ``itembar[0]``; with ``RECEIPT`` (the producer's ``EARLY_KV``) an arrival
    on ``itembar[1]`` once every warp of this consumer has read it."""
    w = _next_item(wbuf, itembar.index(0), k)
    if RECEIPT:
        gl.thread_barrier()  # (this consumer's warps) the item read
        mbarrier.arrive(itembar.index(1), count=1)
    return w


@gluon.jit
def _ws_produce_items(qa_desc, qb_desc, ka_desc, kb_desc, v_desc, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar,
                      qempty, wbuf, itembar, counter_ptr, cu_q_ptr, cu_k_ptr, n_seq, T, H, n_slots, stride_qh,
                      stride_kh, stride_vh, DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr,
                      BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, CHUNK: gl.constexpr, HEADS_FIRST: gl.constexpr,
                      STAGES: gl.constexpr, KV_SPLIT: gl.constexpr, EARLY_KV: gl.constexpr):
    """The persistent kernel's producer: work items taken one at a time from the launch's counter
    (:func:`_grab_item`; a taken index past the last item ends the program), each once both consumers released
    the last one's query rows (``qempty``, two arrivals; so no item is handed over before the consumers took the
    last), then the item's query rows and key tiles (:func:`_ws_produce`), the ring's uses counted on across
    items. ``EARLY_KV`` (the consumers' TMA store, which releases the query rows only once its copy has read
    them): the next item is taken as soon as the last one's tiles are issued, and its first ``STAGES`` tiles
    are copied as their slots come free, before the wait for ``qempty`` and the query rows' copy (the consumers
    have taken the last item: its tiles are being used); and each item is handed over only once both consumers
    took the one before (``itembar[1]``, two arrivals: ``itembar[0]`` never two phases ahead of a consumer's wait).
    ``itembar``: ``[2, 1]``, the hand-over's barrier and the consumers' receipts."""
    base = 0
    k = 0
    w = _grab_item(counter_ptr, wbuf, itembar.index(0), k)
    while w < H * n_slots:
        h, q_start, len_q, k_start, len_k, m0, off, hi, full_end, n_tiles = _item(
            w, H, cu_q_ptr, cu_k_ptr, n_seq, T, n_slots, 128, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST)
        if EARLY_KV:
            first = gl.minimum(n_tiles, STAGES) if k > 0 else 0
            _ws_produce(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, empty, n_tiles, k_start, len_k,
                        h * stride_kh, h * stride_vh, DA, DB, DV, BLOCK_N, STAGES, KV_SPLIT, base, 0, first)
            mbarrier.wait(qempty, (k - 1) & 1, pred=k > 0)
            _issue_q(qa_desc, qb_desc, qa_s, qb_s, qbar, q_start, m0, h, stride_qh, DA, DB)
            _ws_produce(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, empty, n_tiles, k_start, len_k,
                        h * stride_kh, h * stride_vh, DA, DB, DV, BLOCK_N, STAGES, KV_SPLIT, base, first, n_tiles)
        else:
            _issue_q(qa_desc, qb_desc, qa_s, qb_s, qbar, q_start, m0, h, stride_qh, DA, DB)
            _ws_produce(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, empty, n_tiles, k_start, len_k,
                        h * stride_kh, h * stride_vh, DA, DB, DV, BLOCK_N, STAGES, KV_SPLIT, base)
        base += n_tiles
        k += 1
        if EARLY_KV:
            mbarrier.wait(itembar.index(1), (k - 1) & 1)  # both consumers took item k - 1
        else:
            mbarrier.wait(qempty, (k - 1) & 1)  # (so both took it)
        w = _grab_item(counter_ptr, wbuf, itembar.index(0), k)


@gluon.jit
def _ws_consume_items(C: gl.constexpr, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, qempty, wbuf, itembar,
                      scale_log2, cu_q_ptr, cu_k_ptr, n_seq, T, H, n_slots, o_ptr, lse_ptr, DV: gl.constexpr,
                      BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, CHUNK: gl.constexpr, HEADS_FIRST: gl.constexpr,
                      STAGES: gl.constexpr, KV_SPLIT: gl.constexpr, PIPE: gl.constexpr, FOLD: gl.constexpr,
                      TMA_OUT: gl.constexpr, o_desc):
    """The persistent kernel's consumer ``C``: :func:`_ws_consume` for each work item the producer hands over
    (:func:`_take_item`; with ``TMA_OUT`` a receipt for the producer's ``EARLY_KV``), its query tile at the item's
    phase of ``qbar``, released on ``qempty`` before the plain stores (after a TMA store's read of it); a
    handed-over index past the last item ends it."""
    base = 0
    k = 0
    w = _take_item(wbuf, itembar, k, TMA_OUT)
    while w < H * n_slots:
        h, q_start, len_q, k_start, len_k, m0, off, hi, full_end, n_tiles = _item(
            w, H, cu_q_ptr, cu_k_ptr, n_seq, T, n_slots, 128, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST)
        _ws_consume(C, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, qbar, scale_log2, q_start, len_q, len_k, m0,
                    off, full_end, n_tiles, h, H, o_ptr, lse_ptr, DV, BLOCK_N, CAUSAL, STAGES, KV_SPLIT, PIPE, FOLD,
                    False, base, k & 1, qempty, o_desc, TMA_OUT)
        base += n_tiles
        k += 1
        w = _take_item(wbuf, itembar, k, TMA_OUT)


@gluon.jit
def prefill_gluon_ws_kernel(
    qa_desc, qb_desc, ka_desc, kb_desc, v_desc, cu_q_ptr, cu_k_ptr, o_ptr, lse_ptr,
    scale_log2, n_seq, T, H, n_slots, stride_qh, stride_kh, stride_vh, counter_ptr,
    DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    CHUNK: gl.constexpr, STAGES: gl.constexpr, HEADS_FIRST: gl.constexpr = True, KV_SPLIT: gl.constexpr = False,
    PIPE: gl.constexpr = False, FOLD: gl.constexpr = True, PINGPONG: gl.constexpr = False,
    PERSIST: gl.constexpr = False, TMA_OUT: gl.constexpr = False, o_desc=None,
):
    """As :func:`prefill_gluon_kernel`, warp-specialized after FA3's sm_90 forward: 4 default warps (a TMA
    producer over a ring of ``STAGES`` key/value slots) and two 4-warp consumer warpgroups, each owning 64 of
    the 128 query rows (q boxes ``[64, DA]`` / ``[64, DB]``), independent of each other but for releasing
    slots (and, with ``PINGPONG``, taking turns to issue their dots; ``STAGES >= 2``), so one's softmax can run
    while the other's dots do. ``PERSIST`` (not with ``PINGPONG``): a grid of at most one program an SM, each
    taking the work items of the non-persistent grid (``_item``) one at a time from ``counter_ptr`` (an int32 at 0
    when the launch starts; unread without ``PERSIST``), with the ring's and the query tile's barriers running on,
    so an item's first copies start while the one before it finishes and stores. ``TMA_OUT`` (``DV == DA``):
    ``o_desc`` spans the output as ``[T, H * DV]`` (box ``[64, DV]``) and each consumer stores 64 rows inside its
    sequence by TMA (``_ws_consume``)."""
    if TMA_OUT:
        gl.static_assert(DV == DA)  # the output's rows staged in a consumer's [64, DA] query buffer
    gl.static_assert(DB >= 64)
    BM: gl.constexpr = 128
    sm: gl.constexpr = SMEM_C
    dt: gl.constexpr = o_ptr.dtype.element_ty
    if not PERSIST:
        h, q_start, len_q, k_start, len_k, m0, off, hi, full_end, n_tiles = _program(
            cu_q_ptr, cu_k_ptr, n_seq, T, n_slots, BM, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST)
        col_k = h * stride_kh
        col_v = h * stride_vh
    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64

    qa_s = gl.allocate_shared_memory(dt, [2, 64, DA], sm)
    qb_s = gl.allocate_shared_memory(dt, [2, 64, DB], sm)
    ka_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DA], sm)
    kb_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DB], sm)
    v_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DV], sm)
    NBARS: gl.constexpr = 2 * STAGES if KV_SPLIT else STAGES
    full = gl.allocate_shared_memory(gl.int64, [NBARS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBARS, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBARS):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(qbar.index(0), count=1)
    if PINGPONG:
        gl.static_assert(STAGES >= 2)  # with one slot a turn's S would wait for the other's P V of its turn
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    else:
        turn = qbar  # not read
    if PERSIST:
        gl.static_assert(not PINGPONG)  # its turns count from 0 in each item
        qempty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qempty.index(0), count=2)
        itembar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(itembar.index(0), count=1)
        mbarrier.init(itembar.index(1), count=2)
        wbuf = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    fence_async_shared()
    gl.thread_barrier()  # the barriers initialized before any copy signals them
    if PINGPONG:
        mbarrier.arrive(turn.index(0), count=1)  # consumer 0 takes the first turn
    if PERSIST:
        gl.warp_specialize([
            (_ws_produce_items, (qa_desc, qb_desc, ka_desc, kb_desc, v_desc, qa_s, qb_s, ka_s, kb_s, v_s, full, empty,
                                 qbar.index(0), qempty.index(0), wbuf, itembar, counter_ptr, cu_q_ptr,
                                 cu_k_ptr, n_seq, T, H, n_slots, stride_qh, stride_kh, stride_vh, DA, DB, DV, BLOCK_N,
                                 CAUSAL, CHUNK, HEADS_FIRST, STAGES, KV_SPLIT, TMA_OUT)),
            (_ws_consume_items, (0, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar.index(0), qempty.index(0), wbuf,
                                 itembar, scale_log2, cu_q_ptr, cu_k_ptr, n_seq, T, H, n_slots, o_ptr,
                                 lse_ptr, DV, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST, STAGES, KV_SPLIT, PIPE, FOLD,
                                 TMA_OUT, o_desc)),
            (_ws_consume_items, (1, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar.index(0), qempty.index(0), wbuf,
                                 itembar, scale_log2, cu_q_ptr, cu_k_ptr, n_seq, T, H, n_slots, o_ptr,
                                 lse_ptr, DV, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST, STAGES, KV_SPLIT, PIPE, FOLD,
                                 TMA_OUT, o_desc)),
        ], [4, 4], [240, 240])
    else:
        _ws_one_item(qa_desc, qb_desc, ka_desc, kb_desc, v_desc, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, turn,
                     scale_log2, q_start, len_q, k_start, len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr,
                     col_k, col_v, stride_qh, DA, DB, DV, BLOCK_N, CAUSAL, STAGES, KV_SPLIT, PIPE, FOLD, PINGPONG,
                     TMA_OUT, o_desc)


@gluon.jit
def _ws_one_item(qa_desc, qb_desc, ka_desc, kb_desc, v_desc, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, turn,
                 scale_log2, q_start, len_q, k_start, len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr, col_k,
                 col_v, stride_qh, DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, STAGES: gl.constexpr, KV_SPLIT: gl.constexpr, PIPE: gl.constexpr,
                 FOLD: gl.constexpr, PINGPONG: gl.constexpr, TMA_OUT: gl.constexpr, o_desc):
    """The non-persistent kernel's program: its query rows, then the producer and the two consumers."""
    _issue_q(qa_desc, qb_desc, qa_s, qb_s, qbar.index(0), q_start, m0, h, stride_qh, DA, DB)
    gl.warp_specialize([
        (_ws_produce, (ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, empty, n_tiles, k_start, len_k, col_k, col_v,
                       DA, DB, DV, BLOCK_N, STAGES, KV_SPLIT)),
        (_ws_consume, (0, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar.index(0), turn, scale_log2, q_start, len_q,
                       len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr, DV, BLOCK_N, CAUSAL, STAGES,
                       KV_SPLIT, PIPE, FOLD, PINGPONG, 0, 0, None, o_desc, TMA_OUT)),
        (_ws_consume, (1, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar.index(0), turn, scale_log2, q_start, len_q,
                       len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr, DV, BLOCK_N, CAUSAL, STAGES,
                       KV_SPLIT, PIPE, FOLD, PINGPONG, 0, 0, None, o_desc, TMA_OUT)),
    ], [4, 4], [240, 240])  # the producer in the 4 default warps (the registers left), the consumers as workers
