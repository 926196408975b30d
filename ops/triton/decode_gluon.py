"""An sm_90 Gluon kernel for bf16 absorbed-MLA decode (``mla::decode``), 64 query rows a program.

Layout of the work, as ``decode._decode_split_kernel``: the ``s_q * H`` query rows of a sequence are folded
into one row axis (row r is query ``r // H``, head ``r % H``, and sees the positions before
``seq_len - (s_q - 1 - r // H)``); a program owns 64 of those rows and one split of the sequence's positions
(grid ``(cdiv(s_q * H, 64), splits, B)``), so every 64-key tile of the cache is read once for 64 rows.

One program an SM, 8 warps (two warpgroups), no warp specialization:

- shared memory: the query rows ``Q [64, 576]`` bf16 (stored once), two tile slots ``K [64 keys, 576]`` bf16
  and ``P [64, 64]`` bf16, all with the 128-byte swizzle ``wgmma`` reads (216 + 8 KB);
- a tile (one block-table entry: pages hold a multiple of 64 rows) arrives by two TMA copies into its slot
  (the latent columns as eight ``[64, 64]`` blocks, the rope columns), on the slot's mbarrier (one arrival
  with the byte count a use);
- ``S = Q K^T [64, 64]`` (``wgmma``, fp32; each warpgroup computes 32 of the key columns), the online
  softmax in base 2 (``scale * log2 e``), ``P`` to shared memory, ``O += P V`` with ``V`` the tile's first
  512 columns in place (the latent is the value); ``O [64, 512]`` fp32 lives in registers, each warpgroup
  owning 256 columns (128 registers a thread);
- the steps of tile j: softmax of ``S_j``, ``P_j`` stored, ``P_j V_j``; once it is done (both warpgroups, a
  CTA barrier) slot j takes the copy of tile j + 2, then ``Q K_{j+1}^T`` once tile j + 1 is there, so a copy
  runs while the program works through the next tile, and two while it waits for one (``PIPE``); the default
  (``PIPE=False``, the first schedule; the two within ~2% of each other on the H200 at 128 heads, either way
  round: BENCHMARKS.md runs 128 and 202) issues ``P_j V_j`` and ``Q K_{j+1}^T`` back to back and copies tile
  j + 2 after the wait for tile j + 1. At 128 heads both leave the tensor cores idle while the two warpgroups
  run their softmax together (FlashMLA's sm_90 kernel alternates tiles between its warpgroups so that one's
  softmax runs under the other's ``wgmma``), the main part of the gap to FlashMLA there (#27).
  ``decode_gluon_seesaw.decode_gluon_seesaw_kernel`` (``config={"SEESAW": True}``) is that alternating schedule
  (its docstring); ``decode_gluon_seesaw_persist`` (``PERSIST`` too, :func:`persist_launch`) runs it persistent, one
  program an SM over balanced runs of key tiles, followed by ``tile_merge.merge_tile_pieces``.

``decode_gluon_swap.decode_gluon_swap_kernel`` (``config={"SWAP": True}``, the default where a sequence has at
most 16 query rows) is the same schedule with the dots' operands swapped, 16 query rows a program (its
docstring); with ``PERSIST`` ``decode_gluon_swap_persist`` runs it persistent as the seesaw's.

``decode_gluon_ws.decode_gluon_ws_kernel`` (``config={"WS": True}``) is the same work warp-specialized, after FlashMLA's
sm_90 decode: a producer (the 4 default warps) streams tiles into the two slots (``full`` / ``empty``
mbarriers, both consumers release a slot); consumer warpgroup c owns output columns ``[256 c, 256 c + 256)``
and the scores and softmax of the tiles t = c, c + 2, ...: it issues ``S_t`` before it folds in the other
consumer's tile t - 1 (its P, running max and rescale factor handed over in shared memory, ``pready``),
so one consumer's softmax runs while the other's dots do. Its own ``P V`` takes P from registers, the
other's from the one shared P buffer (written only after the writer's own read of the last P is done).
Both end with the same running max; consumer 1 hands its row sums to consumer 0, which stores the LSE.
The query rows' rope part, P and the dot operands' descriptors are indexed by an opaque zero in the loop
(``_fp8_tma.opaque_zero``: built there, not hoisted and held in registers).

The keys of a sequence's last, partial tile past its length may hold anything (NaN included): their
scores are masked and their value rows zeroed in shared memory before ``P V``. A row that sees no key has
LSE -inf and output 0. With one split the program writes the result (bf16 output, natural-log LSE); else
each split writes its normalized rows and base-2 LSE to the workspaces of ``_plan.split_buffers`` and
``decode.reduce_splits`` merges them.

Contract of :func:`launch`: what :func:`eligible` accepts (sm_90, bf16 q and cache, 512 + 64 head dims,
pages of a multiple of 64 rows, a contiguous cache with a 16-byte aligned base; any softmax scale: the
scores are scaled before their maxima are taken). :func:`decode_gluon` (``mla::decode_gluon``) runs
``mla::decode_triton`` for other calls.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla_compile.ops.decode import validate
from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton._bf16_tma import (BLOCK_M, BLOCK_N, BOX_SL, CHUNK, DC, DR, F32_BOX_SL, STAGES, TILE_BYTES,
                                              D, issue_tile, row_blocks_descriptor, zero_tail)
from mla_compile.ops.triton._common import check_config, last_dim_contiguous, num_sms
from mla_compile.ops.triton._pdl import launch_kwargs
from mla_compile.ops.triton._gluon import (O64, Q64, S64, SMEM_SL, alloc_tiles, causal_rows, mask_scores,
                                           online_softmax, split_range, stage_query_rows, store_rows, store_rows_tma,
                                           tile_page)
from mla_compile.ops.triton._plan import opaque_splits, split_buffers
from mla_compile.ops.triton.decode import _LOG2E, Split, decode_outputs, reduce_splits
from mla_compile.ops.triton.decode_gluon_seesaw import WARPS as SEESAW_WARPS
from mla_compile.ops.triton.decode_gluon_seesaw import decode_gluon_seesaw_kernel
from mla_compile.ops.triton.decode_gluon_seesaw_persist import decode_gluon_seesaw_persist_kernel
from mla_compile.ops.triton.decode_gluon_swap import SWAP_ROWS, SWAP_WARPS, decode_gluon_swap_kernel
from mla_compile.ops.triton.decode_gluon_swap_persist import WARPS as SWAP_PERSIST_WARPS
from mla_compile.ops.triton.decode_gluon_swap_persist import decode_gluon_swap_persist_kernel
from mla_compile.ops.triton.decode_gluon_ws import decode_gluon_ws_kernel
from mla_compile.ops.triton.tile_merge import merge_tile_pieces, tile_workspace

NUM_WARPS = 8
WS_WARPS = 4  # the warp-specialized kernel's default partition (the producer); two 4-warp consumers besides
PROGRAMS_PER_SM = 1
# A call of at most this many query rows in all (B * s_q * H) also takes the swapped kernel by default: its 16-row
# programs each read their sequence's cache, which L2 serves at so few sequences (BENCHMARKS.md runs 133-134: faster
# at B = 1 and 2 with 128 heads, slower from B = 4)
SWAP_CALL_ROWS = 256
# what :func:`launch`'s config may name
CONFIG_KEYS = frozenset({"SPLITS", "WS", "SEESAW", "FOLD_FIRST", "TMA_OUT", "TMA_Q", "SWAP", "PIPE", "EARLY",
                         "PERSIST"})
# the swapped kernel's ``EARLY`` copies (its docstring) where the config does not say: off (no measurable gain at
# full depth, BENCHMARKS.md run 186; its caller promise is the kernel's docstring)
EARLY_TILES = False
# the seesaw kernel's ``FOLD_FIRST`` order where the config does not say: on (faster in BENCHMARKS.md run 226)
SEESAW_FOLD_FIRST = True


@gluon.jit
def decode_gluon_kernel(
    q_ptr, desc_c, desc_r, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_bt,
    M, H, S_Q, n_splits,
    DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr, PIPE: gl.constexpr = True,
    TMA_OUT: gl.constexpr = False, desc_o=None,
):
    """Grid ``(cdiv(M, 64), n_splits, B)``, 8 warps; bf16 q ``[B, S_Q, H, 576]`` (last dim contiguous); ``desc_c``
    / ``desc_r`` span the cache's latent columns as ``[8, rows, 64]`` (box ``[8, 64, 64]``) and its rows
    ``[rows, 576]`` (box ``[64, 64]``, the rope columns); ``BLOCK_SIZE`` a multiple of 64. ``DIRECT`` (one
    split): the result into ``o_ptr`` (bf16 ``[B * M, 512]``) / ``lse_ptr`` (natural log); else each split's
    rows into the workspaces ``o_ptr`` / ``lse_ptr`` (``[B * M, n_splits, 512]`` fp32, base-2 LSE). ``PIPE``
    (the default): once ``P_j V_j`` is done the copy of tile j + 2 starts, then the wait for tile j + 1 and
    ``S_{j+1}``, so a late tile j + 1 no longer holds back the copy of tile j + 2 (two tiles in flight while
    the program waits); ``PIPE=False``: ``P_j V_j`` and ``S_{j+1}`` issued back to back, the copy after the wait
    for tile j + 1 (the first schedule, kept to time against).
    ``TMA_OUT`` (``DIRECT``, every row of a program the output's; GPU-tested, not timed): ``desc_o`` spans the
    output's rows as ``[8, rows, 64]`` column blocks (box ``[8, 64, 64]``), and the rows go through the query rows'
    buffer and one TMA copy (``_gluon.store_rows_tma``)."""
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    gl.static_assert(BLOCK_SIZE % 64 == 0)
    s_l: gl.constexpr = S64
    o_l: gl.constexpr = O64
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    q_l: gl.constexpr = Q64

    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64
    pid_h = gl.program_id(0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, 64)

    q_s, qr_s, kc_s, kr_s, p_s = alloc_tiles(64, DC, DR)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(ready.index(0), count=1)
    mbarrier.init(ready.index(1), count=1)
    fence_async_shared()
    gl.thread_barrier()  # the barriers initialized before any copy signals them
    for t in gl.static_range(2):
        issue_tile(desc_c, desc_r, kc_s, kr_s, ready, tile_page(bt_row, t, n_tiles, start, BLOCK_SIZE, 64), t,
                    n_tiles, start, BLOCK_SIZE)

    # the query rows, 64 columns at a time (rows past M: zeros, never stored)
    stage_query_rows(q_ptr, q_s, qr_s, b, pid_h, M, H, stride_qb, stride_qs, stride_qh, 64, DC, q_l)
    fence_async_shared()
    gl.thread_barrier()

    rows, row_ok, limit, lim_min = causal_rows(pid_h, 64, M, H, S_Q, seq_len, row_s)
    offs_n = gl.arange(0, 64, gl.SliceLayout(0, s_l))
    zero_s = gl.zeros([64, 64], gl.float32, s_l)
    m_i = gl.full([64], float("-inf"), gl.float32, row_s)
    l_part = gl.zeros([64, 64], gl.float32, s_l)
    o = gl.zeros([64, DC], gl.float32, o_l)

    s = zero_s
    if n_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(qr_s, kr_s.index(0).permute([1, 0]), zero_s)
        s = warpgroup_mma(q_s, kc_s.index(0).permute([1, 0]), s)
    for j in range(n_tiles):
        slot = j % 2
        n0 = start + j * 64
        k_cur = kc_s.index(slot)
        page_next = tile_page(bt_row, j + 2, n_tiles, start, BLOCK_SIZE, 64)  # read early, used after P V
        # online softmax of S_j (base 2)
        s = mask_scores(s, n0, end, lim_min, limit, offs_n, scale_log2)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p, m_i, l_part, o = online_softmax(s, m_i, m_new, l_part, o, scale_log2, row_o, False, False)
        if n0 + 64 > end:
            zero_tail(k_cur, end - n0, q_l)
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # every warp's P rows (and zeroed value rows) before either warpgroup's P V
        pv = warpgroup_mma(p_s, k_cur, o, is_async=True)
        if PIPE:
            # P V done (both warpgroups) before anything else: slot j takes tile j + 2 at once, then S_{j+1}
            o = warpgroup_mma_wait(0, deps=[pv])
            gl.thread_barrier()  # both warpgroups done with slot j and P
            issue_tile(desc_c, desc_r, kc_s, kr_s, ready, page_next, j + 2, n_tiles, start, BLOCK_SIZE)
            mbarrier.wait(ready.index(1 - slot), ((j + 1) // 2) & 1, pred=j + 1 < n_tiles)
            qk = warpgroup_mma(qr_s, kr_s.index(1 - slot).permute([1, 0]), zero_s, is_async=True)
            qk = warpgroup_mma(q_s, kc_s.index(1 - slot).permute([1, 0]), qk, is_async=True)
            s = warpgroup_mma_wait(0, deps=[qk])
        else:
            # S_{j+1} from the other slot (a dead product past the last tile: its slot holds an older tile)
            mbarrier.wait(ready.index(1 - slot), ((j + 1) // 2) & 1, pred=j + 1 < n_tiles)
            qk = warpgroup_mma(qr_s, kr_s.index(1 - slot).permute([1, 0]), zero_s, is_async=True)
            qk = warpgroup_mma(q_s, kc_s.index(1 - slot).permute([1, 0]), qk, is_async=True)
            o = warpgroup_mma_wait(2, deps=[pv])
            gl.thread_barrier()  # both warpgroups done with slot j and P
            issue_tile(desc_c, desc_r, kc_s, kr_s, ready, page_next, j + 2, n_tiles, start, BLOCK_SIZE)
            s = warpgroup_mma_wait(0, deps=[qk])

    l_i = gl.sum(l_part, axis=1)
    if TMA_OUT:
        store_rows_tma(o, l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, q_s, desc_o,
                       (b * M + pid_h * 64).to(gl.int32), DC, o_l)
    else:
        store_rows(o_ptr, o, l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT, o_l)


def smem_bytes(ws: bool = False, swap: bool = False) -> int:
    """Shared memory of one program's buffers: the query rows, the two tile slots, P and the slots' barriers
    (the sm_90 compile adds a little scratch for the cross-warpgroup row maxima; checked by a test); ``ws``:
    the warp-specialized kernel's (with its hand-over rows, max, alpha and row sums, and eight barriers; the
    compile adds the partitions' captured arguments); ``swap``: the swapped kernel's (``SWAP_ROWS`` query
    rows, P of as many rows)."""
    if ws:
        return BLOCK_M * D * 2 + STAGES * TILE_BYTES + BLOCK_M * BLOCK_N * 2 + 4 * BLOCK_M * 4 + 8 * 8
    if swap:
        return SWAP_ROWS * D * 2 + STAGES * TILE_BYTES + SWAP_ROWS * BLOCK_N * 2 + STAGES * 8
    return BLOCK_M * D * 2 + STAGES * TILE_BYTES + BLOCK_M * BLOCK_N * 2 + STAGES * 8


def eligible(q: Tensor, kv_cache: Tensor, kv_lora_rank: int) -> bool:
    """Whether :func:`launch` serves the call: an sm_90 GPU, bf16 q ``[B, s_q, H, 576]`` and cache
    ``[NB, BS, 576]``, ``kv_lora_rank`` 512, pages of a multiple of 64 rows, a contiguous cache (one TMA
    descriptor spans it: rows and pages dense, under 2^31 rows, a 16-byte aligned base)."""
    if q.device.type != "cuda" or kv_cache.device != q.device:
        return False
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or kv_lora_rank != DC:
        return False
    if q.dim() != 4 or q.shape[-1] != D or kv_cache.dim() != 3 or kv_cache.shape[-1] != D:
        return False
    if kv_cache.shape[1] % BLOCK_N or kv_cache.data_ptr() % 16:
        return False
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    if not (kv_cache.stride(2) == 1 and kv_cache.stride(1) == D and kv_cache.stride(0) == kv_cache.shape[1] * D
            and 0 < rows < 2 ** 31):
        return False
    return torch.cuda.get_device_capability(q.device) == (9, 0)


def swap_by_default(batch: int, rows: int) -> bool:
    """Whether :func:`launch` takes the swapped kernel without a SWAP config: for ``batch`` sequences of ``rows``
    query rows each (``s_q * H``), where a sequence has at most ``SWAP_ROWS`` rows, or the call at most
    ``SWAP_CALL_ROWS`` rows in all (``mla::decode_gluon`` is opaque: concrete sizes, no guard in a compiled graph)."""
    return rows <= SWAP_ROWS or batch * rows <= SWAP_CALL_ROWS


def launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
           config: dict | None = None) -> tuple[Tensor, Tensor]:
    """:func:`split_launch`, then ``decode.reduce_splits``: ``(out, lse)``; with ``PERSIST`` where
    :func:`persist_kind` allows, :func:`persist_launch`."""
    kind = persist_kind(q, block_table, config)
    if kind:
        return persist_launch(q, kv_cache, block_table, seq_lens, scale, kind)
    part = split_launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, config)
    reduce_splits(wrap_triton, part.o_buf, part.l_buf, part.out, part.lse, part.rows, part.splits, part.split_cap,
                  DC, DC, part.direct, pdl=True)
    return part.out, part.lse


def split_launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
                 config: dict | None = None) -> Split:
    """Run the kernel on a call :func:`eligible` accepts. ``config``: SPLITS (else the SMs filled in whole waves,
    ``_plan.opaque_splits``), WS (True: ``decode_gluon_ws_kernel``, else ``decode_gluon_kernel``), SEESAW (True:
    ``decode_gluon_seesaw.decode_gluon_seesaw_kernel``; FOLD_FIRST: its step order, default
    :data:`SEESAW_FOLD_FIRST`; TMA_OUT: whole 64-row programs store the output, or with several splits their
    float32 partial rows, through shared memory and TMA, default True with one split, False with several;
    TMA_Q, default True: whole 64-row programs over q's dense rows load them by TMA; the 64-row kernel's TMA_OUT,
    default False: one split stores by TMA), SWAP (``decode_gluon_swap_kernel``, 16 query rows a program; default:
    where a sequence has at most ``SWAP_ROWS`` rows, or the call has at most ``SWAP_CALL_ROWS`` rows in all,
    neither WS nor SEESAW set), PIPE
    (``decode_gluon_kernel``'s schedule, default False: the first one), EARLY (the swapped kernel under PDL starts its
    first copies of older keys before its wait, ``decode_gluon_swap_kernel``'s contract; default
    :data:`EARLY_TILES`); several splits are merged by ``decode.reduce_splits`` (:func:`launch`); this function
    leaves them: its ``decode.Split``. (``PERSIST``, the persistent kernels, is :func:`launch`'s: ignored here.)"""
    B, s_q, H, _ = q.shape
    M = s_q * H
    out, lse = decode_outputs(q, kv_lora_rank)
    if B == 0 or M == 0:
        return Split(out, lse, out, lse, 1, 1, True, B * M)
    config = check_config("mla.decode (gluon)", config, CONFIG_KEYS)
    ws = bool(config.get("WS", False))
    seesaw = not ws and bool(config.get("SEESAW", False))
    swap = not ws and not seesaw and bool(config.get("SWAP", swap_by_default(B, M)))
    rows_per_program = SWAP_ROWS if swap else BLOCK_M
    hb = triton.cdiv(M, rows_per_program)
    splits, direct = opaque_splits(config, B * hb, num_sms(q.device) * PROGRAMS_PER_SM,
                                   block_table.shape[1] * kv_cache.shape[1], BLOCK_N, "decode_gluon")
    o_buf, l_buf = split_buffers(out, lse, B * M, splits, DC, direct)
    q = last_dim_contiguous(q)
    # the latent copies' box: a tile's eight [64, 64] column blocks (the seesaw kernel: half of them a copy)
    desc_c, desc_r = _cache_descriptors(kv_cache, DC // CHUNK // (2 if seesaw else 1))
    if ws:
        kernel, warps, extra = decode_gluon_ws_kernel, WS_WARPS, {}
    elif seesaw:
        # a program's rows all its own; with several splits by name only (GPU-tested, not timed)
        tma_out = M % BLOCK_M == 0 and bool(config.get("TMA_OUT", direct))
        desc_o = _out_descriptor(out if direct else o_buf, B * M, splits, direct) if tma_out else None
        # the latent query rows by TMA where q's rows are dense (row b * M + m of q viewed as [rows, 576])
        tma_q = (M % BLOCK_M == 0 and _dense_rows(q) and q.data_ptr() % 16 == 0
                 and bool(config.get("TMA_Q", True)))
        desc_q = _q_descriptor(q, B * M, DC // CHUNK) if tma_q else None
        extra = {"FOLD_FIRST": bool(config.get("FOLD_FIRST", SEESAW_FOLD_FIRST)), "TMA_OUT": tma_out, "desc_o": desc_o,
                 "TMA_Q": tma_q, "desc_q": desc_q}
        kernel, warps = decode_gluon_seesaw_kernel, SEESAW_WARPS
    elif swap:
        pdl = launch_kwargs(q.device)
        early = bool(config.get("EARLY", EARLY_TILES)) and pdl["PDL"]
        kernel, warps, extra = decode_gluon_swap_kernel, SWAP_WARPS, {"BLOCK_R": SWAP_ROWS, "EARLY": early, **pdl}
    else:
        # TMA_OUT by name only (GPU-tested, not timed): one split, every row of a program the output's
        tma_out = direct and M % BLOCK_M == 0 and bool(config.get("TMA_OUT", False))
        kernel, warps, extra = decode_gluon_kernel, NUM_WARPS, {
            "PIPE": bool(config.get("PIPE", False)), "TMA_OUT": tma_out,
            "desc_o": row_blocks_descriptor(out, B * M) if tma_out else None}
    kernel[(hb, splits, B)](
        q, desc_c, desc_r, block_table, seq_lens, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        block_table.stride(0),
        M, H, s_q, splits, DC=DC, DR=DR, BLOCK_SIZE=kv_cache.shape[1], DIRECT=direct, **extra,
        num_warps=warps,
    )
    return Split(out, lse, o_buf, l_buf, splits, splits, direct, B * M)


def persist_kind(q: Tensor, block_table: Tensor, config: dict | None) -> str | None:
    """Which persistent kernel :func:`launch` takes (opt-in ``PERSIST``), or None:

    - "seesaw" (``decode_gluon_seesaw_persist``): the config asks for ``SEESAW`` in its ``FOLD_FIRST`` order, and the
      call has whole 64-row blocks of query rows a sequence over q's dense, 16-byte aligned rows (its query copies);
    - "swap" (``decode_gluon_swap_persist``): the call takes the swapped kernel (``SWAP``, or by default).

    Both need fewer than 2^31 elements of q and of the block table (32-bit offsets); other calls run as without
    ``PERSIST``."""
    config = check_config("mla.decode (gluon)", config, CONFIG_KEYS)
    B, s_q, H, _ = q.shape
    M = s_q * H
    if not config.get("PERSIST") or config.get("WS") or B == 0 or M == 0:
        return None
    if q.numel() >= 2 ** 31 or block_table.numel() >= 2 ** 31:
        return None
    if config.get("SEESAW"):
        ok = (config.get("FOLD_FIRST", SEESAW_FOLD_FIRST) and M % BLOCK_M == 0 and _dense_rows(q)
              and q.data_ptr() % 16 == 0)
        return "seesaw" if ok else None
    return "swap" if config.get("SWAP", swap_by_default(B, M)) else None


def persist_launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                   kind: str) -> tuple[Tensor, Tensor]:
    """A persistent kernel (:func:`persist_kind`'s ``kind``) on a call it accepts: one program an SM over balanced
    runs of key tiles, then ``tile_merge.merge_tile_pieces`` (items split between programs, empty sequences);
    ``(out, lse)``."""
    B, s_q, H, _ = q.shape
    M = s_q * H
    out, lse = decode_outputs(q, DC)
    ctas = num_sms(q.device)
    item_rows = BLOCK_M if kind == "seesaw" else SWAP_ROWS
    ws, wl = tile_workspace(ctas, DC, q.device, item_rows)
    if kind == "seesaw":
        half = DC // CHUNK // 2  # a warpgroup's share of a tile's or a piece's latent columns, in blocks
        desc_h, desc_r = _cache_descriptors(kv_cache, half)
        desc_q = _q_descriptor(q, B * M, half)
        decode_gluon_seesaw_persist_kernel[(ctas,)](
            q, desc_h, desc_r, desc_q, _out_descriptor(out, B * M, 1, True), block_table, seq_lens, ws, wl, lse,
            scale * _LOG2E,
            block_table.stride(0),
            B, M, H, s_q, DC=DC, DR=DR, BLOCK_SIZE=kv_cache.shape[1],
            num_warps=SEESAW_WARPS,
        )
    else:
        q = last_dim_contiguous(q)
        desc_c, desc_r = _cache_descriptors(kv_cache, DC // CHUNK)
        decode_gluon_swap_persist_kernel[(ctas,)](
            q, desc_c, desc_r, block_table, seq_lens, ws, wl, out, lse,
            scale * _LOG2E,
            q.stride(0), q.stride(1), q.stride(2),
            block_table.stride(0),
            B, M, H, s_q, DC=DC, DR=DR, BLOCK_SIZE=kv_cache.shape[1], BLOCK_R=SWAP_ROWS,
            **launch_kwargs(q.device), num_warps=SWAP_PERSIST_WARPS,
        )
    merge_tile_pieces(wrap_triton, seq_lens, ws, wl, out, lse, B, M, ctas, pdl=True, item_rows=item_rows)
    return out, lse


def _cache_descriptors(kv_cache: Tensor, box_blocks: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors over the cache's rows ``[rows, 576]``: its latent columns as ``[8, rows, 64]`` column blocks,
    box ``[box_blocks, 64, 64]`` (a tile's eight, or the seesaw kernels' half), and its rope columns, box ``[64,
    64]``."""
    rows = kv_cache.view(-1, D)
    blocks = rows.as_strided([DC // CHUNK, rows.shape[0], CHUNK], [CHUNK, D, 1])
    return (TensorDescriptor.from_tensor(blocks, [box_blocks, BLOCK_N, CHUNK], BOX_SL),
            TensorDescriptor.from_tensor(rows, [BLOCK_N, DR], SMEM_SL))


def _q_descriptor(q: Tensor, rows: int, box_blocks: int) -> TensorDescriptor:
    """A TMA descriptor over q's ``rows`` dense rows of 576 (:func:`_dense_rows`): their latent columns as ``[8, rows,
    64]`` column blocks, box ``[box_blocks, 64, 64]`` (a 64-row program's, or a warpgroup's half)."""
    return TensorDescriptor.from_tensor(q.as_strided([DC // CHUNK, rows, CHUNK], [CHUNK, D, 1]),
                                        [box_blocks, BLOCK_M, CHUNK], BOX_SL)


def _out_descriptor(buf: Tensor, rows: int, splits: int, direct: bool) -> TensorDescriptor:
    """The seesaw kernel's output copies (``TMA_OUT``): one split, ``out [rows, 512]`` bf16 as ``[8, rows, 64]``
    column blocks, box ``[4, 64, 64]`` (a warpgroup's half of a program's rows); several, the float32 workspace
    ``[rows, splits, 512]`` as ``[splits, 16, rows, 32]``, box ``[1, 8, 64, 32]`` (the same half at one split)."""
    if direct:
        return row_blocks_descriptor(buf, rows, DC // CHUNK // 2)
    f32 = CHUNK // 2  # float32 columns in 128 bytes
    blocks = buf.as_strided([splits, DC // f32, rows, f32], [DC, f32, splits * DC, 1])
    return TensorDescriptor.from_tensor(blocks, [1, DC // f32 // 2, BLOCK_M, f32], F32_BOX_SL)


def _dense_rows(q: Tensor) -> bool:
    """Whether q ``[B, s_q, H, 576]`` is rows of 576 one after the other (a ``[B * s_q * H, 576]`` view)."""
    try:
        return q.view(-1, D).stride(0) == D
    except RuntimeError:
        return False


def _run(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
         config: dict) -> tuple[Tensor, Tensor]:
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    if eligible(q, kv_cache, kv_lora_rank):
        return launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, config=config)
    return torch.ops.mla.decode_triton(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


@torch.library.custom_op("mla::decode_gluon", mutates_args=(), tags=LAYOUT_TAGS)
def decode_gluon(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                 kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Gluon ``mla::decode`` (same contract as ``mla::decode_ref``; an opaque call to Inductor): :func:`launch`
    (``decode_gluon_kernel``) where :func:`eligible`, else ``mla::decode_triton`` (a strided cache, a cache
    base off 16 bytes, another GPU or dtype; the reference off CUDA)."""
    return _run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, {"WS": False})


@torch.library.custom_op("mla::decode_gluon_ws", mutates_args=(), tags=LAYOUT_TAGS)
def decode_gluon_ws(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                    kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode_gluon`` with the warp-specialized kernel (``decode_gluon_ws_kernel``)."""
    return _run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, {"WS": True})


@torch.library.custom_op("mla::decode_gluon_seesaw", mutates_args=(), tags=LAYOUT_TAGS)
def decode_gluon_seesaw(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                        kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode_gluon`` with the alternating kernel (``decode_gluon_seesaw_kernel``, 64 query rows a program
    at every size)."""
    return _run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, {"SEESAW": True})


@torch.library.custom_op("mla::decode_gluon_persist", mutates_args=(), tags=LAYOUT_TAGS)
def decode_gluon_persist(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                         kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode_gluon`` with its swapped kernel persistent (:func:`persist_launch`) where it takes that kernel,
    else as ``mla::decode_gluon``."""
    return _run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, {"WS": False, "PERSIST": True})


@torch.library.custom_op("mla::decode_gluon_seesaw_persist", mutates_args=(), tags=LAYOUT_TAGS)
def decode_gluon_seesaw_persist(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                                kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode_gluon_seesaw`` persistent (:func:`persist_launch`) where :func:`persist_kind` allows, else the
    seesaw as ``mla::decode_gluon_seesaw``."""
    return _run(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, {"SEESAW": True, "PERSIST": True})


def _fake(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank):
    return decode_outputs(q, kv_lora_rank)


decode_gluon.register_fake(_fake)
decode_gluon_ws.register_fake(_fake)
decode_gluon_seesaw.register_fake(_fake)
decode_gluon_seesaw_persist.register_fake(_fake)
decode_gluon_persist.register_fake(_fake)
