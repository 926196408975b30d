"""sm_90 Gluon kernels for ``mla::prefill`` (backends "gluon" and "gluon-ws"):
``mla::prefill_gluon`` and ``mla::prefill_gluon_ws``.

Work layout as :mod:`mla_compile.ops.triton.prefill_tma` (a program per 128 query rows of one sequence and one
head, grid ``(H, n_slots)`` heads-fastest (``HEADS_FIRST``) or ``(n_slots, H)`` query blocks fastest (a head's
query blocks run together and share its keys in L2), by default heads-fastest only for grids of at most
``HEADS_FIRST_WAVES`` waves of programs (:func:`heads_first`), with the longest causal blocks first; the
sequence found on the device;
q/k/v through host-made TMA descriptors over ``[rows, heads' columns]`` views; a key tile that would run past
its sequence is loaded ending at the sequence's last key, so padding rows are never read).

One program an SM, 8 warps (two warpgroups of 64 query rows; no warp specialization):

- shared memory: ``Q`` as its two qk parts ``[128, DA]`` + ``[128, DB]`` (one TMA copy each, once) and a ring
  of two key-tile slots, each ``K [BLOCK_N, DA] + [BLOCK_N, DB]`` and ``V [BLOCK_N, DV]``, 128-byte swizzle;
- ``S = Q_a K_a^T + Q_b K_b^T`` (two async ``wgmma`` k-groups, fp32 in registers), the online softmax in base 2
  (scale folded into ``log2 e``; the mask only on diagonal / shifted tiles), ``P`` converted in registers to
  the A-operand layout of ``O += P V`` (``wgmma`` with A from registers, B = the slot's ``V``);
- after tile j's ``P V`` is done (both warpgroups: a CTA barrier) its slot takes tile j + 2, so one copy is in
  flight while a tile is worked on.

``prefill_gluon_ws_kernel`` (``config={"WS": True}``, backend "gluon-ws") is the same work warp-specialized as in
FA3's sm_90 forward: a TMA producer (the 4 default warps) fills a ring of ``STAGES`` slots (``full`` / ``empty``
mbarriers, both consumers release a slot), and two 4-warp consumer warpgroups each own 64 of the 128 query rows
(their own S, softmax and ``P V``), so the two are not held in step by a CTA barrier and one's softmax may run
while the other's dots do; causal tiles past a consumer's last visible key are released without work. By default
(``KV_SPLIT`` and ``PIPE``, as FA3) a slot's keys and values have barriers of their own and each consumer is
software-pipelined: tile j's ``S`` dots are in flight with tile j - 1's ``P V``, the keys released right after
``S``, the values waited for only before ``P V``.

``PINGPONG`` (off by default; FA3's inter-warpgroup ping-pong) orders the consumers' dots explicitly: they take
turns, a consumer issues a turn's dots only once the other has issued its previous turn's, so one warpgroup's
softmax runs while the other's dots do. Two mbarriers of one arrival, ``turn[c]`` ("consumer c may issue"):
consumer c's turn k waits for the k-th completion of ``turn[c]`` (parity ``k & 1``), issues its dots, then (a
warpgroup barrier: all four warps have issued) arrives on ``turn[1 - c]``; ``turn[0]`` is completed once before
the consumers start, so consumer 0 goes first. A turn is, with ``PIPE``, one step of the pipelined loop (tile j's
``S`` and tile j - 1's ``P V``: tiles 1 .. n - 1 of a consumer's n); without, tile j - 1's ``P V`` and tile j's
``S`` (turn 0 tile 0's ``S``, turn n tile n - 1's ``P V``; the turn is held through the wait for ``P V``, as
FA3). A causal consumer that sees fewer tiles takes fewer turns: each knows both counts, waits only for hand-overs
the other makes (consumer 0's turn k: ``k <=`` the other's turns; consumer 1's: ``k <`` the other's) and hands
over after every turn (one nobody waits for completes a phase no wait reads; turns alternate, so no wait sees a
barrier two phases on). Turns follow the tile order: with two or more slots, every slot a turn waits for was
released by the other consumer before its last hand-over, so no turn waits on the other's next turn.

``PERSIST`` (off by default, not with ``PINGPONG``; FA3's persistent scheduling) launches at most one program an
SM; each takes the non-persistent grid's work items (a head and a 128-row block) ``pid``, ``pid + programs``,
... in its launch order, longest causal blocks first. The producer loads an item's query rows once both
consumers released the last item's (``qempty``: each consumer arrives once its dots are done, before its
stores), then streams its key tiles into the same ring, whose uses count on across items; so an item's first
copies overlap the last item's final tiles and stores, which a program an item leaves exposed. Not yet run on a
GPU.

Served where :func:`eligible`: an sm_90 GPU, bf16/fp16, qk = a power of two plus a power of two, v a power of
two, each from 64 (a 128-byte swizzled row) to 256, shared memory within an SM's (:func:`smem_bytes`),
aligned rows (the TMA kernel's conditions); elsewhere the op runs ``mla::prefill_triton_tma`` (which runs the
pointer kernel where the TMA one is not eligible).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla_compile.ops.prefill import fake, validate
from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton._common import causal_bounds, check_config, num_sms, prefill_outputs
from mla_compile.ops.triton._gluon import SMEM_C, SMEM_SL
from mla_compile.ops.triton.prefill_tma import _view2d, split_dims
from mla_compile.ops.triton.prefill_tma import eligible as tma_eligible

_LOG2E = 1.4426950408889634
BLOCK_M = 128
NUM_WARPS = 8
WS_WARPS = 4  # the warp-specialized kernel's default partition (the producer); two 4-warp consumers besides
SMEM_LIMIT = 227 * 1024
# :func:`launch`'s config keys
CONFIG_KEYS = frozenset({"WS", "BLOCK_N", "STAGES", "HEADS_FIRST", "KV_SPLIT", "PIPE", "FOLD_SCALE", "PINGPONG",
                         "PERSIST"})
HEADS_FIRST_WAVES = 4  # default grid order: heads-fastest up to this many waves of one program an SM


def heads_first(programs: int, sms: int) -> bool:
    """The default grid order for ``programs`` programs on ``sms`` SMs: heads-fastest (all heads' longest causal
    blocks first: the best tail on a short grid) up to ``HEADS_FIRST_WAVES`` waves, query blocks fastest above
    (concurrent programs share their head's keys in L2 instead of streaming every head's from memory)."""
    return programs <= HEADS_FIRST_WAVES * sms


def smem_bytes(dqk: int, dv: int, block_n: int, ws: bool = False, stages: int = 2, kv_split: bool = False,
               pingpong: bool = False, persist: bool = False) -> int:
    """Shared memory of one program's buffers: Q, the key/value slots and the barriers (three; the
    warp-specialized kernel's: two a slot, four with ``kv_split``, Q's, the two turns with ``pingpong``, and
    the query tile's release with ``persist``)."""
    bars = (2 * stages * (2 if kv_split else 1) + 1 + (2 if pingpong else 0) + int(persist)) * 8 if ws else 3 * 8
    return BLOCK_M * dqk * 2 + stages * block_n * (dqk + dv) * 2 + bars


def eligible(q: Tensor, k: Tensor, v: Tensor, block_n: int = 64, ws: bool = False, stages: int = 2,
             pingpong: bool = False, persist: bool = False) -> bool:
    """Whether :func:`launch` serves these tensors (see the module docstring); reads no data."""
    if not tma_eligible(q, k, v) or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    da, db = split_dims(q.shape[-1])
    dims = (da, db, v.shape[-1])
    return (64 <= min(dims) and max(dims) <= 256
            and smem_bytes(q.shape[-1], v.shape[-1], block_n, ws, stages, ws, pingpong, persist) <= SMEM_LIMIT)


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
def _store_rows(o, m_i, l_i, q_start, offs_m, len_q, h, H, o_ptr, lse_ptr, DV: gl.constexpr, row_o: gl.constexpr,
                o_l: gl.constexpr):
    """Store the rows' output ``o / l`` (0 where a row saw no key) and natural-log LSE (-inf there)."""
    empty = l_i == 0.0
    inv = 1.0 / gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    rows = (q_start + offs_m).to(gl.int64)
    m_ok = offs_m < len_q
    gl.store(lse_ptr + rows * H + h, lse, mask=m_ok)
    rows_o = gl.convert_layout(rows, row_o)
    ok_o = gl.convert_layout(m_ok, row_o)
    cols = gl.arange(0, DV, gl.SliceLayout(0, o_l))
    out = o * gl.convert_layout(inv, row_o)[:, None]
    gl.store(o_ptr + (rows_o * H + h)[:, None] * DV + cols[None, :], out.to(o_ptr.dtype.element_ty),
             mask=ok_o[:, None])


@gluon.jit
def prefill_gluon_kernel(
    qa_desc, qb_desc, ka_desc, kb_desc, v_desc, cu_q_ptr, cu_k_ptr, o_ptr, lse_ptr,
    scale_log2, n_seq, T, H, n_slots, stride_qh, stride_kh, stride_vh,
    DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    CHUNK: gl.constexpr, HEADS_FIRST: gl.constexpr = True, FOLD: gl.constexpr = True,
):
    """Grid ``(H, n_slots)`` (``(n_slots, H)`` without ``HEADS_FIRST``), 8 warps; descriptors over ``_view2d``
    views (q box ``[128, DA]`` / ``[128, DB]``, k ``[BLOCK_N, DA]`` / ``[BLOCK_N, DB]``, v ``[BLOCK_N, DV]``);
    writes ``o_ptr [T, H, DV]`` (q's dtype) and ``lse_ptr [T, H]`` (natural log) of the program's rows."""
    gl.static_assert(DB >= 64)
    BM: gl.constexpr = 128
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, DV, 16])
    p_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    sm: gl.constexpr = SMEM_C
    dt: gl.constexpr = o_ptr.dtype.element_ty

    h, q_start, len_q, k_start, len_k, m0, off, hi, full_end, n_tiles = _program(
        cu_q_ptr, cu_k_ptr, n_seq, T, n_slots, BM, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST)
    col_k = h * stride_kh
    col_v = h * stride_vh
    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64

    qa_s = gl.allocate_shared_memory(dt, [BM, DA], sm)
    qb_s = gl.allocate_shared_memory(dt, [BM, DB], sm)
    ka_s = gl.allocate_shared_memory(dt, [2, BLOCK_N, DA], sm)
    kb_s = gl.allocate_shared_memory(dt, [2, BLOCK_N, DB], sm)
    v_s = gl.allocate_shared_memory(dt, [2, BLOCK_N, DV], sm)
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()  # the barriers initialized before any copy signals them

    q_row = q_start + m0
    mbarrier.expect(bars.index(2), BM * (DA + DB) * 2)
    tma.async_copy_global_to_shared(qa_desc, [q_row, h * stride_qh], bars.index(2), qa_s)
    tma.async_copy_global_to_shared(qb_desc, [q_row, h * stride_qh + DA], bars.index(2), qb_s)
    for t in gl.static_range(2):
        _issue(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, bars, t, n_tiles, k_start, len_k, col_k, col_v,
               DA, DB, DV, BLOCK_N)

    offs_m = m0 + gl.arange(0, BM, row_s)
    lim = offs_m + off
    zero_s = gl.zeros([BM, BLOCK_N], gl.float32, s_l)
    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BM], gl.float32, row_s)
    o = gl.zeros([BM, DV], gl.float32, o_l)
    mbarrier.wait(bars.index(2), 0)
    for j in range(n_tiles):
        slot = j % 2
        mbarrier.wait(bars.index(slot), (j // 2) & 1)
        qk = warpgroup_mma(qa_s, ka_s.index(slot).permute([1, 0]), zero_s, use_acc=False, is_async=True)
        qk = warpgroup_mma(qb_s, kb_s.index(slot).permute([1, 0]), qk, is_async=True)
        s = warpgroup_mma_wait(0, deps=[qk])
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j * BLOCK_N, full_end, len_k, lim, scale_log2, BLOCK_N, CAUSAL,
                                           col_s, FOLD)
        o = o * gl.convert_layout(alpha, row_o)[:, None]
        pv = warpgroup_mma(gl.convert_layout(p.to(dt), p_a), v_s.index(slot), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=[pv])
        gl.thread_barrier()  # both warpgroups done with the slot before it takes tile j + 2
        _issue(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, bars, j + 2, n_tiles, k_start, len_k, col_k, col_v,
               DA, DB, DV, BLOCK_N)
    _store_rows(o, m_i, l_i, q_start, offs_m, len_q, h, H, o_ptr, lse_ptr, DV, row_o, o_l)


@gluon.jit
def _ws_produce(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, empty, n_tiles, k_start, len_k, col_k, col_v,
                DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                KV_SPLIT: gl.constexpr, base=0):
    """The producer (the default 4 warps): tile t into slot r % STAGES (``full``; r = ``base`` + t, ``base`` the
    ring's uses before this work item) once both consumers released ring use r - STAGES from it (``empty``, two
    arrivals a use). ``KV_SPLIT``: keys and values of a slot on barriers of their own (``full`` / ``empty``
    ``[slot]`` the keys', ``[STAGES + slot]`` the values'): tile t's keys are copied once the scores of the slot's
    use before are done, before its ``P V`` is."""
    for t in range(n_tiles):
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
                base=0, qphase=0, qempty=None):
    """Consumer warpgroup ``C``: query rows ``m0 + 64 C + [0, 64)``; every tile: ``S`` (two async ``wgmma``
    k-groups), the online softmax, ``O += P V`` with P from registers, then the slot released (``empty``;
    ``KV_SPLIT``: the keys released after ``S``, the values waited for before ``P V`` and released after it;
    ``PIPE``: :func:`_ws_pipelined_tiles`). Causal tiles past this warpgroup's last visible key are released
    without work. ``PINGPONG``: the dots issued in turns with the other consumer (``turn``, the module
    docstring). Stores its rows at the end. The persistent kernel's work items: ``base`` the ring's uses before
    this item, ``qphase`` the query tile's (``qbar``) phase, and ``qempty`` (not None) signalled once this
    consumer's dots are done, before its stores, so the producer may load the next item's query rows."""
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
def _ws_produce_items(qa_desc, qb_desc, ka_desc, kb_desc, v_desc, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar,
                      qempty, cu_q_ptr, cu_k_ptr, n_seq, T, H, n_slots, stride_qh, stride_kh, stride_vh,
                      DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr, CHUNK: gl.constexpr, HEADS_FIRST: gl.constexpr, STAGES: gl.constexpr,
                      KV_SPLIT: gl.constexpr):
    """The persistent kernel's producer: for each of this program's work items (``_item``: items ``pid``,
    ``pid + programs``, ...), the item's query rows once both consumers released the last item's (``qempty``,
    two arrivals), then its key tiles (:func:`_ws_produce`), the ring's uses counted on across items."""
    base = 0
    k = 0
    for w in range(gl.program_id(0), H * n_slots, gl.num_programs(0)):
        h, q_start, len_q, k_start, len_k, m0, off, hi, full_end, n_tiles = _item(
            w, H, cu_q_ptr, cu_k_ptr, n_seq, T, n_slots, 128, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST)
        mbarrier.wait(qempty, (k - 1) & 1, pred=k > 0)
        _issue_q(qa_desc, qb_desc, qa_s, qb_s, qbar, q_start, m0, h, stride_qh, DA, DB)
        _ws_produce(ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, empty, n_tiles, k_start, len_k, h * stride_kh,
                    h * stride_vh, DA, DB, DV, BLOCK_N, STAGES, KV_SPLIT, base)
        base += n_tiles
        k += 1


@gluon.jit
def _ws_consume_items(C: gl.constexpr, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, qempty, scale_log2, cu_q_ptr,
                      cu_k_ptr, n_seq, T, H, n_slots, o_ptr, lse_ptr, DV: gl.constexpr, BLOCK_N: gl.constexpr,
                      CAUSAL: gl.constexpr, CHUNK: gl.constexpr, HEADS_FIRST: gl.constexpr, STAGES: gl.constexpr,
                      KV_SPLIT: gl.constexpr, PIPE: gl.constexpr, FOLD: gl.constexpr):
    """The persistent kernel's consumer ``C``: :func:`_ws_consume` for each of the program's work items (the
    producer's order), its query tile at the item's phase of ``qbar``, released on ``qempty`` before the stores."""
    base = 0
    k = 0
    for w in range(gl.program_id(0), H * n_slots, gl.num_programs(0)):
        h, q_start, len_q, k_start, len_k, m0, off, hi, full_end, n_tiles = _item(
            w, H, cu_q_ptr, cu_k_ptr, n_seq, T, n_slots, 128, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST)
        _ws_consume(C, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, qbar, scale_log2, q_start, len_q, len_k, m0,
                    off, full_end, n_tiles, h, H, o_ptr, lse_ptr, DV, BLOCK_N, CAUSAL, STAGES, KV_SPLIT, PIPE, FOLD,
                    False, base, k & 1, qempty)
        base += n_tiles
        k += 1


@gluon.jit
def prefill_gluon_ws_kernel(
    qa_desc, qb_desc, ka_desc, kb_desc, v_desc, cu_q_ptr, cu_k_ptr, o_ptr, lse_ptr,
    scale_log2, n_seq, T, H, n_slots, stride_qh, stride_kh, stride_vh,
    DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    CHUNK: gl.constexpr, STAGES: gl.constexpr, HEADS_FIRST: gl.constexpr = True, KV_SPLIT: gl.constexpr = False,
    PIPE: gl.constexpr = False, FOLD: gl.constexpr = True, PINGPONG: gl.constexpr = False,
    PERSIST: gl.constexpr = False,
):
    """As :func:`prefill_gluon_kernel`, warp-specialized after FA3's sm_90 forward: 4 default warps (a TMA
    producer over a ring of ``STAGES`` key/value slots) and two 4-warp consumer warpgroups, each owning 64 of
    the 128 query rows (q boxes ``[64, DA]`` / ``[64, DB]``), independent of each other but for releasing
    slots (and, with ``PINGPONG``, taking turns to issue their dots; ``STAGES >= 2``), so one's softmax can run
    while the other's dots do. ``PERSIST`` (not with ``PINGPONG``): a grid of at most one program an SM, each
    looping over the work items of the non-persistent grid (``_item``) with the ring's and the query tile's
    barriers running on, so an item's first copies start while the one before it finishes and stores."""
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
    fence_async_shared()
    gl.thread_barrier()  # the barriers initialized before any copy signals them
    if PINGPONG:
        mbarrier.arrive(turn.index(0), count=1)  # consumer 0 takes the first turn
    if PERSIST:
        gl.warp_specialize([
            (_ws_produce_items, (qa_desc, qb_desc, ka_desc, kb_desc, v_desc, qa_s, qb_s, ka_s, kb_s, v_s, full, empty,
                                 qbar.index(0), qempty.index(0), cu_q_ptr, cu_k_ptr, n_seq, T, H, n_slots, stride_qh,
                                 stride_kh, stride_vh, DA, DB, DV, BLOCK_N, CAUSAL, CHUNK, HEADS_FIRST, STAGES,
                                 KV_SPLIT)),
            (_ws_consume_items, (0, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar.index(0), qempty.index(0),
                                 scale_log2, cu_q_ptr, cu_k_ptr, n_seq, T, H, n_slots, o_ptr, lse_ptr, DV, BLOCK_N,
                                 CAUSAL, CHUNK, HEADS_FIRST, STAGES, KV_SPLIT, PIPE, FOLD)),
            (_ws_consume_items, (1, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar.index(0), qempty.index(0),
                                 scale_log2, cu_q_ptr, cu_k_ptr, n_seq, T, H, n_slots, o_ptr, lse_ptr, DV, BLOCK_N,
                                 CAUSAL, CHUNK, HEADS_FIRST, STAGES, KV_SPLIT, PIPE, FOLD)),
        ], [4, 4], [240, 240])
    else:
        _ws_one_item(qa_desc, qb_desc, ka_desc, kb_desc, v_desc, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, turn,
                     scale_log2, q_start, len_q, k_start, len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr,
                     col_k, col_v, stride_qh, DA, DB, DV, BLOCK_N, CAUSAL, STAGES, KV_SPLIT, PIPE, FOLD, PINGPONG)


@gluon.jit
def _ws_one_item(qa_desc, qb_desc, ka_desc, kb_desc, v_desc, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar, turn,
                 scale_log2, q_start, len_q, k_start, len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr, col_k,
                 col_v, stride_qh, DA: gl.constexpr, DB: gl.constexpr, DV: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, STAGES: gl.constexpr, KV_SPLIT: gl.constexpr, PIPE: gl.constexpr,
                 FOLD: gl.constexpr, PINGPONG: gl.constexpr):
    """The non-persistent kernel's program: its query rows, then the producer and the two consumers."""
    _issue_q(qa_desc, qb_desc, qa_s, qb_s, qbar.index(0), q_start, m0, h, stride_qh, DA, DB)
    gl.warp_specialize([
        (_ws_produce, (ka_desc, kb_desc, v_desc, ka_s, kb_s, v_s, full, empty, n_tiles, k_start, len_k, col_k, col_v,
                       DA, DB, DV, BLOCK_N, STAGES, KV_SPLIT)),
        (_ws_consume, (0, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar.index(0), turn, scale_log2, q_start, len_q,
                       len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr, DV, BLOCK_N, CAUSAL, STAGES,
                       KV_SPLIT, PIPE, FOLD, PINGPONG)),
        (_ws_consume, (1, qa_s, qb_s, ka_s, kb_s, v_s, full, empty, qbar.index(0), turn, scale_log2, q_start, len_q,
                       len_k, m0, off, full_end, n_tiles, h, H, o_ptr, lse_ptr, DV, BLOCK_N, CAUSAL, STAGES,
                       KV_SPLIT, PIPE, FOLD, PINGPONG)),
    ], [4, 4], [240, 240])  # the producer in the 4 default warps (the registers left), the consumers as workers


def launch(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
           causal: bool, config: dict | None = None) -> tuple[Tensor, Tensor]:
    """The kernel (callers check :func:`eligible`); ``config``: ``WS`` (the warp-specialized kernel), ``BLOCK_N``
    (default 64 plain, 128 warp-specialized), ``STAGES`` (warp-specialized: slots of the ring, default 2),
    ``KV_SPLIT`` (warp-specialized: keys and values on barriers of their own, default True), ``PIPE``
    (warp-specialized: the consumers software-pipelined, :func:`_ws_pipelined_tiles`, default True),
    ``PINGPONG`` (warp-specialized: the consumers issue their dots in turns, the module docstring; needs
    ``STAGES >= 2``; default False), ``PERSIST`` (warp-specialized, not with ``PINGPONG``: at most one program an
    SM, each looping over the work items, ``prefill_gluon_ws_kernel``; default False), ``HEADS_FIRST`` (True: grid
    ``(H, n_slots)``; False: ``(n_slots, H)``; default :func:`heads_first`; with ``PERSIST`` the work items' order),
    ``FOLD_SCALE`` (the softmax scale folded into the exponent's FMA, :func:`_softmax_tile`; default True, taken
    only for a positive ``scale``)."""
    cfg = check_config("mla.prefill (gluon)", config, CONFIG_KEYS)
    ws = bool(cfg.get("WS", False))
    block_n = int(cfg.get("BLOCK_N", 128 if ws else 64))
    stages = int(cfg.get("STAGES", 2))
    kv_split = bool(cfg.get("KV_SPLIT", ws))
    pipe = bool(cfg.get("PIPE", ws))
    pingpong = bool(cfg.get("PINGPONG", False))
    if pingpong and not (ws and stages >= 2):
        raise ValueError(f"mla.prefill (gluon): PINGPONG needs WS=True and STAGES >= 2, got WS={ws}, "
                         f"STAGES={stages}; drop PINGPONG or set both")
    persist = bool(cfg.get("PERSIST", False))
    if persist and (pingpong or not ws):
        raise ValueError(f"mla.prefill (gluon): PERSIST needs WS=True and no PINGPONG, got WS={ws}, "
                         f"PINGPONG={pingpong}")
    fold = bool(cfg.get("FOLD_SCALE", True)) and scale > 0
    T, H, dqk = q.shape
    dv = v.shape[-1]
    out, lse = prefill_outputs(q, v)
    if T == 0 or H == 0:
        return out, lse
    da, db = split_dims(dqk)
    q2, k2, v2 = _view2d(q), _view2d(k), _view2d(v)
    q_rows = 64 if ws else BLOCK_M
    qa = TensorDescriptor.from_tensor(q2, [q_rows, da], SMEM_SL)
    qb = TensorDescriptor.from_tensor(q2, [q_rows, db], SMEM_SL)
    ka = TensorDescriptor.from_tensor(k2, [block_n, da], SMEM_SL)
    kb = TensorDescriptor.from_tensor(k2, [block_n, db], SMEM_SL)
    vd = TensorDescriptor.from_tensor(v2, [block_n, dv], SMEM_SL)
    n_seq = cu_seqlens_q.shape[0] - 1
    n_slots = triton.cdiv(T, BLOCK_M) + n_seq
    if "HEADS_FIRST" in cfg:
        first = bool(cfg["HEADS_FIRST"])
    else:
        first = heads_first(H * n_slots, num_sms(q.device))
    args = (qa, qb, ka, kb, vd, cu_seqlens_q, cu_seqlens_k, out, lse, scale * _LOG2E, n_seq, T, H, n_slots,
            q.stride(1), k.stride(1), v.stride(1))
    grid = (H, n_slots) if first else (n_slots, H)
    if persist:  # the same work items, each program taking every programs-th
        grid = (min(H * n_slots, num_sms(q.device)),)
    if ws:
        prefill_gluon_ws_kernel[grid](*args, DA=da, DB=db, DV=dv, BLOCK_N=block_n, CAUSAL=bool(causal),
                                      CHUNK=128, STAGES=stages, HEADS_FIRST=first, KV_SPLIT=kv_split, PIPE=pipe,
                                      FOLD=fold, PINGPONG=pingpong, PERSIST=persist, num_warps=WS_WARPS)
    else:
        prefill_gluon_kernel[grid](*args, DA=da, DB=db, DV=dv, BLOCK_N=block_n, CAUSAL=bool(causal),
                                   CHUNK=256, HEADS_FIRST=first, FOLD=fold, num_warps=NUM_WARPS)
    return out, lse


def _run(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, ws: bool) -> tuple[Tensor, Tensor]:
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    if eligible(q, k, v, 128 if ws else 64, ws):  # launch's default tiles
        return launch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, {"WS": ws})
    import mla_compile.ops.triton.prefill_tma  # noqa: F401  (registers mla::prefill_triton_tma)
    return torch.ops.mla.prefill_triton_tma(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)


@torch.library.custom_op("mla::prefill_gluon", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_gluon(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                  causal: bool) -> tuple[Tensor, Tensor]:
    """Gluon ``mla::prefill`` (same contract as ``mla::prefill_ref``; an opaque call to Inductor):
    ``prefill_gluon_kernel`` where :func:`eligible`, else ``mla::prefill_triton_tma``."""
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, False)


@torch.library.custom_op("mla::prefill_gluon_ws", mutates_args=(), tags=LAYOUT_TAGS)
def prefill_gluon_ws(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                     causal: bool) -> tuple[Tensor, Tensor]:
    """``mla::prefill_gluon`` with the warp-specialized kernel (``prefill_gluon_ws_kernel``, 128-key tiles)."""
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, True)


prefill_gluon.register_fake(fake)
prefill_gluon_ws.register_fake(fake)
