"""The sm_90 Gluon bf16 decode for few query rows (``decode_gluon.launch`` with ``config={"SWAP": True}``, the
default of backend "gluon" when a sequence has at most ``SWAP_ROWS`` query rows, e.g. 16 heads and one query).

``decode_gluon_kernel`` gives every program 64 query rows (``wgmma``'s M); with 16 real rows three quarters of
its dots and of its softmax are padding, and its shared memory holds 64 query rows. This kernel swaps the
operands so that the rows are the dots' N (16 or 32): ``S^T = K Q^T [64 keys, R]`` (``K`` the tile in its slot,
``Q`` the program's R query rows in shared memory, 18 KB for 16 rows) and ``O^T += V^T P^T [512, R]`` (``V^T`` the
tile's first 512 columns read transposed in place, ``P^T`` through shared memory), one warpgroup (4 warps).
A tile costs about a quarter of ``decode_gluon_kernel``'s dots, so the program waits on its copies (the
memory-bound case it is for) rather than on its dots. Tiles, slots, barriers and their phases are
``decode_gluon_kernel``'s (``PIPE`` schedule): two slots, the copy of tile j + 2 issued once ``P_j V_j`` is
done, then the wait for tile j + 1 and ``S_{j+1}``. The contract is ``decode_gluon_kernel``'s with
``BLOCK_R`` rows a program (grid ``(cdiv(M, BLOCK_R), n_splits, B)``)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from mla_compile.ops.triton._bf16_tma import issue_tile, issue_tile_if, zero_tail
from mla_compile.ops.triton._gluon import (alloc_tiles, causal_rows, finish_rows, pdl_start, split_range,
                                           stage_query_rows, tile_page)

SWAP_ROWS = 16  # query rows a program (BLOCK_R; 32 compiles with a few bytes of spills), and the most a
# sequence may have for "gluon" to take this kernel by default
SWAP_WARPS = 4
Q_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # the query rows' staging, a tile's zeroing


@gluon.constexpr_function
def acc_layout(BLOCK_R):
    """The layout of the swapped dots' accumulators (``S^T [64, R]``, ``O^T [512, R]``), ``R = BLOCK_R`` rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_R, 16])


@gluon.jit
def softmax_pv(s, m_i, l_part, o, k_cur, p_s, n0, end, lim_min, limit, offs_n, scale_log2, col_o: gl.constexpr,
               q_l: gl.constexpr):
    """One tile of the swapped schedule after its ``S^T`` (``s``, keys ``n0 ...`` of slot ``k_cur``): the online
    softmax in base 2 along the keys (axis 0; keys at or past ``end`` or a row's causal ``limit`` masked, a partial
    tile's value rows zeroed), ``P^T`` through ``p_s``, ``O^T += V^T P^T``; returns ``(o, m_i, l_part)`` once the
    dot is done (every warp: the slot and P are free)."""
    s = s * scale_log2
    if n0 + 64 > gl.minimum(end, lim_min):
        pos = n0 + offs_n
        s = gl.where((pos < end)[:, None] & (pos[:, None] < limit[None, :]), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
    alpha = gl.exp2(m_i - m_shift)
    p = gl.exp2(s - m_shift[None, :])
    l_part = l_part * alpha[None, :] + p
    o = o * gl.convert_layout(alpha, col_o)[None, :]
    if n0 + 64 > end:
        zero_tail(k_cur, end - n0, q_l)
    p_s.store(gl.permute(p.to(gl.bfloat16), [1, 0]))
    fence_async_shared()
    gl.thread_barrier()  # every warp's P columns (and zeroed value rows) before P V
    pv = warpgroup_mma(k_cur.permute([1, 0]), p_s.permute([1, 0]), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=[pv])
    gl.thread_barrier()  # every warp done with slot j and P
    return o, m_new, l_part


@gluon.jit
def decode_gluon_swap_kernel(
    q_ptr, desc_c, desc_r, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_bt,
    M, H, S_Q, n_splits,
    DC: gl.constexpr, DR: gl.constexpr, BLOCK_SIZE: gl.constexpr, DIRECT: gl.constexpr, BLOCK_R: gl.constexpr,
    PDL: gl.constexpr = False, EARLY: gl.constexpr = False,
):
    """``decode_gluon_kernel``'s contract with ``BLOCK_R`` (16 or 32) query rows a program, 4 warps; ``PDL``: launched
    with PDL, every program waits for the kernel before it first. ``EARLY`` (with ``PDL``): before that wait a
    program reads its sequence's length and block-table row and starts the copies of its first two tiles that end
    before the sequence's last ``S_Q`` positions (the step's new keys, which the kernel before may be writing);
    the rest after the wait. So the caller promises that the kernel launched directly before this one writes
    neither ``seq_lens``, ``block_table`` nor the cache rows of older positions."""
    if not EARLY:
        pdl_start(PDL)
    gl.static_assert(DC == 512)
    gl.static_assert(DR == 64)
    gl.static_assert(BLOCK_SIZE % 64 == 0)
    gl.static_assert((BLOCK_R == 16) | (BLOCK_R == 32))
    s_l: gl.constexpr = acc_layout(BLOCK_R)
    o_l: gl.constexpr = acc_layout(BLOCK_R)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)  # along the query rows (the dots' N)
    col_o: gl.constexpr = gl.SliceLayout(0, o_l)
    q_l: gl.constexpr = Q_L

    scale_log2 = gl.full([], scale_log2, gl.float32)  # Inductor may pass Python floats as fp64
    pid_h = gl.program_id(0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, 64)

    q_s, qr_s, kc_s, kr_s, p_s = alloc_tiles(BLOCK_R, DC, DR)  # P (rows x keys): P^T's K-major store
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(ready.index(0), count=1)
    mbarrier.init(ready.index(1), count=1)
    fence_async_shared()
    gl.thread_barrier()  # the barriers initialized before any copy signals them
    if EARLY:
        n_old = gl.minimum(gl.maximum((seq_len - S_Q - start) // 64, 0), n_tiles)  # tiles of older keys only
        page0 = tile_page(bt_row, 0, n_tiles, start, BLOCK_SIZE, 64)
        page1 = tile_page(bt_row, 1, n_tiles, start, BLOCK_SIZE, 64)
        issue_tile_if(desc_c, desc_r, kc_s, kr_s, ready, page0, 0, 0 < n_old, start, BLOCK_SIZE)
        issue_tile_if(desc_c, desc_r, kc_s, kr_s, ready, page1, 1, 1 < n_old, start, BLOCK_SIZE)
        pdl_start(PDL)
        issue_tile_if(desc_c, desc_r, kc_s, kr_s, ready, page0, 0, (0 >= n_old) & (0 < n_tiles), start, BLOCK_SIZE)
        issue_tile_if(desc_c, desc_r, kc_s, kr_s, ready, page1, 1, (1 >= n_old) & (1 < n_tiles), start, BLOCK_SIZE)
    else:
        for t in gl.static_range(2):
            issue_tile(desc_c, desc_r, kc_s, kr_s, ready, tile_page(bt_row, t, n_tiles, start, BLOCK_SIZE, 64), t,
                       n_tiles, start, BLOCK_SIZE)

    # the query rows, 64 columns at a time (rows past M: zeros, never stored)
    stage_query_rows(q_ptr, q_s, qr_s, b, pid_h, M, H, stride_qb, stride_qs, stride_qh, BLOCK_R, DC, q_l)
    fence_async_shared()
    gl.thread_barrier()

    rows, row_ok, limit, lim_min = causal_rows(pid_h, BLOCK_R, M, H, S_Q, seq_len, col_s)
    offs_n = gl.arange(0, 64, gl.SliceLayout(1, s_l))  # key positions along the dots' M
    zero_s = gl.zeros([64, BLOCK_R], gl.float32, s_l)
    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, col_s)
    l_part = gl.zeros([64, BLOCK_R], gl.float32, s_l)
    o = gl.zeros([DC, BLOCK_R], gl.float32, o_l)  # O^T

    s = zero_s
    if n_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(kr_s.index(0), qr_s.permute([1, 0]), zero_s)
        s = warpgroup_mma(kc_s.index(0), q_s.permute([1, 0]), s)
    for j in range(n_tiles):
        slot = j % 2
        n0 = start + j * 64
        k_cur = kc_s.index(slot)
        page_next = tile_page(bt_row, j + 2, n_tiles, start, BLOCK_SIZE, 64)  # read early, used after P V
        o, m_i, l_part = softmax_pv(s, m_i, l_part, o, k_cur, p_s, n0, end, lim_min, limit, offs_n, scale_log2, col_o,
                                    q_l)
        issue_tile(desc_c, desc_r, kc_s, kr_s, ready, page_next, j + 2, n_tiles, start, BLOCK_SIZE)
        # S_{j+1} from the other slot (a dead product past the last tile: its slot holds an older tile)
        mbarrier.wait(ready.index(1 - slot), ((j + 1) // 2) & 1, pred=j + 1 < n_tiles)
        qk = warpgroup_mma(kr_s.index(1 - slot), qr_s.permute([1, 0]), zero_s, is_async=True)
        qk = warpgroup_mma(kc_s.index(1 - slot), q_s.permute([1, 0]), qk, is_async=True)
        s = warpgroup_mma_wait(0, deps=[qk])

    l_i = gl.sum(l_part, axis=0)
    inv, o_first = finish_rows(l_i, m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT)
    inv_o = gl.convert_layout(inv, col_o)
    first = gl.convert_layout(o_first, col_o)
    ok = gl.convert_layout(row_ok, col_o)
    cols = gl.arange(0, DC, gl.SliceLayout(1, o_l))
    ty: gl.constexpr = o_ptr.dtype.element_ty
    gl.store(o_ptr + first[None, :] + cols[:, None], (o * inv_o[None, :]).to(ty), mask=ok[None, :])
