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

``prefill_gluon_ws.prefill_gluon_ws_kernel`` (``config={"WS": True}``, backend "gluon-ws"; the pieces both kernels
share are in ``_prefill_gluon``) is the same work warp-specialized as in
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
SM; each takes the non-persistent grid's work items (a head and a 128-row block, in that grid's launch order:
longest causal blocks first within a sequence) one at a time from a counter of the launch (an atomic add by the
producer, which hands the item to its consumers through shared memory), as the hardware hands the non-persistent
grid's programs to free SMs. (A static round-robin would not balance: with query blocks fastest at 8 x 4096
tokens, 264 slots for 132 programs, each program would run two fixed block positions of every head, the busiest
about twice the mean.) The producer loads an item's query rows once both
consumers released the last item's (``qempty``: each consumer arrives once its dots are done, before its
stores), then streams its key tiles into the same ring, whose uses count on across items; so an item's first
copies overlap the last item's final tiles and stores, which a program an item leaves exposed.

``TMA_OUT`` (the warp-specialized kernel; on by default): a consumer whose 64
rows all lie inside its sequence stages its output in its own ``[64, DA]`` query buffer (free once its dots are
done; ``DV == DA``) and writes it with one TMA copy, instead of the accumulator layout's plain stores (16 bytes of
eight rows a warp instruction); a block that ends past its sequence keeps the plain stores (a copy would write the
next sequence's rows). With ``PERSIST`` the buffer's release (``qempty``) waits for the copy, so there the
producer copies the next item's first ``STAGES`` tiles as their slots come free and its query rows after the
release (``prefill_gluon_ws._ws_produce_items``' ``EARLY_KV``; GPU-tested, and faster than the persistent form's
plain stores at 128 heads: BENCHMARKS.md).

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
from mla_compile.ops.triton._common import check_config, num_sms, prefill_outputs
from mla_compile.ops.triton._gluon import SMEM_C, SMEM_SL
from mla_compile.ops.triton._prefill_gluon import _issue, _program, _softmax_tile, _store_rows
from mla_compile.ops.triton.prefill_gluon_ws import prefill_gluon_ws_kernel
from mla_compile.ops.triton.prefill_tma import _view2d, split_dims
from mla_compile.ops.triton.prefill_tma import eligible as tma_eligible

_LOG2E = 1.4426950408889634
BLOCK_M = 128
NUM_WARPS = 8
WS_WARPS = 4  # the warp-specialized kernel's default partition (the producer); two 4-warp consumers besides
SMEM_LIMIT = 227 * 1024
# :func:`launch`'s config keys
CONFIG_KEYS = frozenset({"WS", "BLOCK_N", "STAGES", "HEADS_FIRST", "KV_SPLIT", "PIPE", "FOLD_SCALE", "PINGPONG",
                         "PERSIST", "TMA_OUT"})
HEADS_FIRST_WAVES = 4  # default grid order: heads-fastest up to this many waves of one program an SM


def heads_first(programs: int, sms: int) -> bool:
    """The default grid order for ``programs`` programs on ``sms`` SMs: heads-fastest (all heads' longest causal
    blocks first: the best tail on a short grid) up to ``HEADS_FIRST_WAVES`` waves, query blocks fastest above
    (concurrent programs share their head's keys in L2 instead of streaming every head's from memory)."""
    return programs <= HEADS_FIRST_WAVES * sms


def smem_bytes(dqk: int, dv: int, block_n: int, ws: bool = False, stages: int = 2, kv_split: bool = False,
               pingpong: bool = False, persist: bool = False) -> int:
    """Shared memory of one program's buffers: Q, the key/value slots and the barriers (three; the
    warp-specialized kernel's: two a slot, four with ``kv_split``, Q's, the two turns with ``pingpong``, and with
    ``persist`` the query tile's release, the work item's hand-over and the item's two 4-byte slots)."""
    bars = (2 * stages * (2 if kv_split else 1) + 1 + (2 if pingpong else 0) + (2 if persist else 0)) * 8 if ws \
        else 3 * 8
    return BLOCK_M * dqk * 2 + stages * block_n * (dqk + dv) * 2 + bars + (8 if ws and persist else 0)


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

def launch(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
           causal: bool, config: dict | None = None) -> tuple[Tensor, Tensor]:
    """The kernel (callers check :func:`eligible`); ``config``: ``WS`` (the warp-specialized kernel), ``BLOCK_N``
    (default 64 plain, 128 warp-specialized), ``STAGES`` (warp-specialized: slots of the ring, default 2),
    ``KV_SPLIT`` (warp-specialized: keys and values on barriers of their own, default True), ``PIPE``
    (warp-specialized: the consumers software-pipelined, ``prefill_gluon_ws._ws_pipelined_tiles``, default True),
    ``PINGPONG`` (warp-specialized: the consumers issue their dots in turns, the module docstring; needs
    ``STAGES >= 2``; default False), ``PERSIST`` (warp-specialized, not with ``PINGPONG``: at most one program an
    SM, each looping over the work items, ``prefill_gluon_ws_kernel``; default False), ``HEADS_FIRST`` (True: grid
    ``(H, n_slots)``; False: ``(n_slots, H)``; default :func:`heads_first`; with ``PERSIST`` the work items' order),
    ``FOLD_SCALE`` (the softmax scale folded into the exponent's FMA, ``_prefill_gluon._softmax_tile``; default
    True, taken only for a positive ``scale``), ``TMA_OUT`` (warp-specialized, values as wide as the query's first
    part: 64-row blocks inside a sequence stored through shared memory and TMA; default True; with ``PERSIST`` the
    query buffer's release, and with it the next item's query rows, waits for the copy: the module docstring)."""
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
    counter = cu_seqlens_q  # the persistent programs' work-item counter (not read without PERSIST)
    if persist:  # the same work items, taken one at a time from the counter
        grid = (min(H * n_slots, num_sms(q.device)),)
        counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    if ws:
        # the output's full 64-row blocks through shared memory and TMA (a consumer's [64, da] query buffer holds them)
        tma_out = dv == da and bool(cfg.get("TMA_OUT", True))
        o_desc = TensorDescriptor.from_tensor(out.view(T, H * dv), [64, dv], SMEM_SL) if tma_out else None
        prefill_gluon_ws_kernel[grid](*args, DA=da, DB=db, DV=dv, BLOCK_N=block_n, CAUSAL=bool(causal),
                                      CHUNK=128, STAGES=stages, HEADS_FIRST=first, KV_SPLIT=kv_split, PIPE=pipe,
                                      FOLD=fold, PINGPONG=pingpong, PERSIST=persist, counter_ptr=counter,
                                      TMA_OUT=tma_out, o_desc=o_desc, num_warps=WS_WARPS)
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
