"""Triton ``mla::moe_experts`` for many tokens: a grouped GEMM over blocks of rows that share one expert.

Rows are (token, slot) pairs as in :mod:`mla_compile.ops.triton.moe_experts` (slot ``j < k`` the token's
j-th pick, ``j >= k`` the shared expert ``j - k``: an ``[I]``-wide slice of the shared MLP, weight 1). The
rows are laid out in blocks of ``BLOCK_M`` rows, every block belonging to one expert, so each program reads
a tile of its expert's weights once for up to ``BLOCK_M`` rows (at many tokens nearly every expert is hit:
the floor is reading every expert's weights once):

- the shared experts first: shared expert ``s`` owns ``cdiv(T, BLOCK_M)`` blocks, its rows the tokens in
  order (a layout known from shapes: nothing to sort);
- then the routed pairs, sorted by expert (a stable counting sort, ``_moe_sort_kernel``: one program an
  expert, no torch sort) and each expert's segment padded to a multiple of ``BLOCK_M`` by
  ``_moe_align_kernel``, which writes the sorted pair of every used row and,
  per block, its expert and number of used rows. The padded row count is bounded by shapes (``T*k +
  min(E, T*k) * (BLOCK_M - 1)``), so every buffer and grid has a static size; blocks past the used ones
  have no rows and their programs exit at once. Nothing is read on the host (CUDA-graph capturable).

Kernel 1, grid (blocks, I tiles): gathers the block's token rows of x and ``tl.dot``-s them with the gate and
the up rows of the same ``BLOCK_N`` columns (K = hidden, pipelined over ``num_stages``), then stores
``silu(g) * u`` in x's dtype into ``h`` (one row per block row). Kernel 2, grid (blocks, H tiles): ``h``'s
block times the expert's down tile, scaled by each row's routing weight (1 for the shared slots), stored
in float32 at the pair's own row of ``y [T * slots, H]``. Kernel 3 sums each token's slots of ``y`` in slot
order (picks, then shared experts) and casts: no atomics, the same bits every run.

With a token mask, the masked tokens' picks are sorted past the last expert (dropped: they hit no expert and
take no row), their shared rows are left out (a shared block with no token left exits before any weight
load) and their outputs are 0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.moe_experts import _out_dtype, sort_by_expert, validate
from mla_compile.ops.triton._common import pow2
from mla_compile.ops.triton.moe_experts import launch_operands


@triton.jit
def _moe_sort_kernel(
    ids_ptr, mask_ptr, order_ptr, sorted_e_ptr, offs_ptr,
    P, K, E,
    HAS_MASK: tl.constexpr, CHUNK: tl.constexpr,
):
    """A stable counting sort of the pairs by expert, program ``e`` for expert e (e == E: the masked tokens'
    picks, with ``HAS_MASK``): a first pass over ``ids [P]`` counts the pairs of smaller experts (its segment's
    start) and its own; a second writes its pairs, in pair order, to ``order[start + rank]`` and e to
    ``sorted_e`` there; ``offs[e]`` = its segment's end. A pair of a token whose ``mask`` is 0 counts as E."""
    e = tl.program_id(0)
    c = tl.arange(0, CHUNK)
    lt = tl.zeros([CHUNK], dtype=tl.int32)
    eq = tl.zeros([CHUNK], dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        p = p0 + c
        ok = p < P
        v = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
        if HAS_MASK:
            v = tl.where(tl.load(mask_ptr + p // K, mask=ok, other=1) != 0, v, E)
        v = tl.where(ok, v, E + 1)
        lt += (v < e).to(tl.int32)
        eq += (v == e).to(tl.int32)
    start = tl.sum(lt, axis=0)
    base = start
    for p0 in range(0, P, CHUNK):
        p = p0 + c
        ok = p < P
        v = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
        if HAS_MASK:
            v = tl.where(tl.load(mask_ptr + p // K, mask=ok, other=1) != 0, v, E)
        hit = ok & (v == e)
        rank = tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(order_ptr + base + rank, p, mask=hit)
        tl.store(sorted_e_ptr + base + rank, tl.zeros([CHUNK], dtype=tl.int32) + e, mask=hit)
        base += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(offs_ptr + e, start + tl.sum(eq, axis=0))


@triton.jit
def _moe_align_kernel(
    sorted_e_ptr, order_ptr, offs_ptr, rows_ptr, bexp_ptr, bcnt_ptr,
    P, E, NB,
    BLOCK_M: tl.constexpr, EP: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program ``pid``: the sorted pairs ``[pid * CHUNK, +CHUNK)`` to their padded rows, and the blocks
    ``[pid * CHUNK, +CHUNK)``'s expert and used-row count. Each program recomputes the padded segment
    starts from ``offs`` (E cumulative ends: a scan of E values); pairs of expert E (dropped) get no row."""
    pid = tl.program_id(0)
    g = tl.arange(0, EP)
    g_ok = g < E
    ends = tl.load(offs_ptr + g, mask=g_ok, other=0)
    starts = tl.load(offs_ptr + g - 1, mask=g_ok & (g >= 1), other=0)
    counts = tl.where(g_ok, ends - starts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, 0)
    pstart = pend - padded

    # sorted position r (expert e's rows are r in [starts[e], ends[e])) -> padded row pstart[e] + r - starts[e]
    r = pid * CHUNK + tl.arange(0, CHUNK)
    r_ok = r < P
    pair = tl.load(order_ptr + r, mask=r_ok, other=0)
    e = tl.load(sorted_e_ptr + r, mask=r_ok, other=0)
    hit = e[:, None] == g[None, :]
    shift = tl.sum(tl.where(hit, (pstart - starts)[None, :], 0), axis=1)
    tl.store(rows_ptr + r + shift, pair.to(tl.int32), mask=r_ok & (e < E))  # e == E: a masked token's pick

    # block b -> its expert: the number of padded segments ending at or before its first row (E: none)
    b = pid * CHUNK + tl.arange(0, CHUNK)
    b_ok = b < NB
    first = b * BLOCK_M
    ended = (pend[None, :] <= first[:, None]) & g_ok[None, :]
    owner = tl.sum(ended.to(tl.int32), axis=1)
    mine = g[None, :] == owner[:, None]
    used_end = tl.sum(tl.where(mine, (pstart + counts)[None, :], 0), axis=1)  # 0 for owner == E
    used = tl.minimum(tl.maximum(used_end - first, 0), BLOCK_M)
    tl.store(bexp_ptr + b, owner, mask=b_ok)
    tl.store(bcnt_ptr + b, used, mask=b_ok)


@triton.jit
def _block_layout(b, routed_e, routed_used, T, E, SB, TB, BLOCK_M: tl.constexpr):
    """Block ``b``'s ``(expert, shared index, first token, used rows)`` from its loaded routed entries: shared
    expert ``s = b // TB`` (expert id ``E + s``, tokens ``[first, first + used)``) for ``b < SB``, else routed
    block ``b - SB`` (``routed_e``, ``routed_used``). Takes loaded values, never pointers (see _common.py)."""
    is_shared = b < SB
    s = tl.minimum(b // TB, tl.maximum(SB // TB - 1, 0))
    first_t = (b - s * TB) * BLOCK_M
    e = tl.where(is_shared, E + s, routed_e)
    used = tl.where(is_shared, tl.minimum(T - first_t, BLOCK_M), routed_used)
    return e, s, first_t, used


@triton.jit
def _moe_grouped_gate_up_kernel(
    x_ptr, rows_ptr, bexp_ptr, bcnt_ptr, gu_ptr, sg_ptr, su_ptr, h_ptr, mask_ptr,
    T, H, I, E, K, SB, TB,
    s_x, s_gue, s_gun, s_sg, s_su, s_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    IEEE: tl.constexpr, HAS_MASK: tl.constexpr,
):
    b = tl.program_id(0)
    rb = tl.maximum(b - SB, 0)  # the routed block (when b >= SB)
    e, s, first_t, used = _block_layout(b, tl.load(bexp_ptr + rb, mask=b >= SB, other=0),
                                        tl.load(bcnt_ptr + rb, mask=b >= SB, other=0), T, E, SB, TB, BLOCK_M)
    if used <= 0:
        return
    m = tl.arange(0, BLOCK_M)
    valid = m < used
    pair = tl.load(rows_ptr + rb * BLOCK_M + m, mask=valid & (b >= SB), other=0)
    t = tl.where(b < SB, first_t + m, pair // K)
    if HAS_MASK:  # shared rows of masked tokens (their picks have no row): left out, a block of none exits
        valid = valid & (tl.load(mask_ptr + t, mask=valid, other=0) != 0)
        if tl.sum(valid.to(tl.int32), axis=0) == 0:
            return
    routed = e < E
    e64 = e.to(tl.int64)
    shared_row = s.to(tl.int64) * I
    g_base = tl.where(routed, gu_ptr + e64 * s_gue, sg_ptr + shared_row * s_sg)
    u_base = tl.where(routed, gu_ptr + e64 * s_gue + I * s_gun, su_ptr + shared_row * s_su)
    g_stride = tl.where(routed, s_gun, s_sg).to(tl.int64)
    u_stride = tl.where(routed, s_gun, s_su).to(tl.int64)

    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    g_cols = g_base + offs_n.to(tl.int64) * g_stride
    u_cols = u_base + offs_n.to(tl.int64) * u_stride
    x_rows = x_ptr + tl.where(valid, t, 0).to(tl.int64) * s_x
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xa = tl.load(x_rows[:, None] + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wm = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(g_cols[None, :] + k[:, None], mask=wm, other=0.0)
        wu = tl.load(u_cols[None, :] + k[:, None], mask=wm, other=0.0)
        if IEEE:
            acc_g = tl.dot(xa, wg, acc_g, input_precision="ieee")
            acc_u = tl.dot(xa, wu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(xa, wg, acc_g)
            acc_u = tl.dot(xa, wu, acc_u)
    a = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h_rows = h_ptr + (b.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) * s_h
    tl.store(h_rows[:, None] + offs_n[None, :], a.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _moe_grouped_down_kernel(
    h_ptr, rows_ptr, bexp_ptr, bcnt_ptr, w_ptr, dn_ptr, sd_ptr, y_ptr, mask_ptr,
    T, H, I, E, K, SB, TB,
    s_h, s_w, s_de, s_dh, s_sd, s_y,
    SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, IEEE: tl.constexpr, HAS_MASK: tl.constexpr,
):
    b = tl.program_id(0)
    rb = tl.maximum(b - SB, 0)  # the routed block (when b >= SB)
    e, s, first_t, used = _block_layout(b, tl.load(bexp_ptr + rb, mask=b >= SB, other=0),
                                        tl.load(bcnt_ptr + rb, mask=b >= SB, other=0), T, E, SB, TB, BLOCK_M)
    if used <= 0:
        return
    m = tl.arange(0, BLOCK_M)
    valid = m < used
    pair = tl.load(rows_ptr + rb * BLOCK_M + m, mask=valid & (b >= SB), other=0)
    t = tl.where(b < SB, first_t + m, pair // K)
    slot = tl.where(b < SB, K + s, pair % K)
    if HAS_MASK:  # shared rows of masked tokens (their picks have no row): left out, a block of none exits
        valid = valid & (tl.load(mask_ptr + t, mask=valid, other=0) != 0)
        if tl.sum(valid.to(tl.int32), axis=0) == 0:
            return
    routed = e < E
    d_base = tl.where(routed, dn_ptr + e.to(tl.int64) * s_de, sd_ptr + s.to(tl.int64) * I)
    d_stride = tl.where(routed, s_dh, s_sd).to(tl.int64)

    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    d_cols = d_base + offs_n.to(tl.int64) * d_stride
    h_rows = h_ptr + (b.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) * s_h
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(h_rows[:, None] + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(d_cols[None, :] + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    t64 = tl.where(valid, t, 0).to(tl.int64)
    weight = tl.load(w_ptr + t64 * s_w + slot, mask=valid & routed, other=1.0)
    y_rows = y_ptr + (t64 * SLOTS + slot) * s_y
    tl.store(y_rows[:, None] + offs_n[None, :], acc * weight[:, None], mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, out_ptr, mask_ptr, H, s_y, s_out, SLOTS: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_MASK: tl.constexpr):
    """``out[t] = sum_j y[t * SLOTS + j]`` over the slots in order (float32), cast to out's dtype; 0 for a
    masked token (its rows of y are never written nor read)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    if HAS_MASK:
        ok_load = ok & (tl.load(mask_ptr + t) != 0)
    else:
        ok_load = ok
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        acc += tl.load(y_ptr + (t * SLOTS + j) * s_y + offs, mask=ok_load, other=0.0)
    tl.store(out_ptr + t * s_out + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# Launch parameters (``bench_moe --sweep`` times alternatives at T >= 64, each checked against the default).
# ``block_m``: rows per block (0: chosen from the average rows per routed expert, :func:`block_m`);
# ``gate_up_n``/``gate_up_k``: kernel 1's I columns (of gate and of up each) and H step; ``down_n``/``down_k``:
# kernel 2's H columns and I step (halved K for float32 x: registers and shared memory); ``num_stages``: the
# K loop's software pipeline depth. sm_90 defaults: the kernels are memory bound (each expert's weights read
# about once); per stage kernel 1 streams 2 x 64 x 128 bf16 (32 KB) of weights and kernel 2 128 x 64 (16 KB),
# so three stages keep ~100 KB in flight per SM within its 228 KB of shared memory. The token side of a tile
# (x rows, h rows: BLOCK_M x K) comes from L2 once per column tile, so the column tiles are wide against
# BLOCK_M (kernel 2: 128 columns, h traffic a quarter of the weights' at BLOCK_M 32). BLOCK_M 16/32 runs
# mma.sync (wgmma wants 64 rows per warpgroup); the tensor cores idle either way. ``down_stages`` /
# ``down_warps``: kernel 2's own pipeline depth and warps (0: ``num_stages`` / ``num_warps``).
CONFIG = dict(block_m=0, gate_up_n=64, gate_up_k=128, down_n=128, down_k=64, num_warps=4, num_stages=3,
              down_stages=0, down_warps=0)
COMBINE_BLOCK = 1024
SORT_CHUNK = 256  # pairs a step of _moe_sort_kernel's two passes


def block_m(tokens: int, top_k: int, experts: int) -> int:
    """Rows per block: ``CONFIG["block_m"]`` if set, else the smallest of 16/32/64 covering the average
    rows per routed expert ``T * k / E`` (fewer padded rows at decode, fewer weight re-reads above)."""
    if CONFIG["block_m"]:
        return CONFIG["block_m"]
    avg = tokens * top_k / max(experts, 1)
    return 16 if avg <= 16 else 32 if avg <= 32 else 64


def counting_sort(ids: Tensor, num_experts: int, token_mask: Tensor | None = None,
                  order_dtype: torch.dtype = torch.int32) -> tuple[Tensor, Tensor, Tensor]:
    """``_moe_sort_kernel`` over the pairs of ``ids [T, k]`` (one launch, no host read): ``(order [T*k]``
    (``order_dtype``), ``sorted_e [T*k] int32, offs [E (+1 with token_mask)] int32)``: the pairs sorted by expert
    (stable), each sorted pair's expert and each segment's cumulative end; with ``token_mask [T]`` bool the picks of
    tokens where it is False count as expert E, sorted last."""
    T, k = ids.shape
    pairs = T * k
    has_mask = token_mask is not None
    dev = ids.device
    order = torch.empty(pairs, dtype=order_dtype, device=dev)
    sorted_e = torch.empty(pairs, dtype=torch.int32, device=dev)
    offs = torch.empty(num_experts + has_mask, dtype=torch.int32, device=dev)
    wrap_triton(_moe_sort_kernel)[(num_experts + has_mask,)](
        ids.reshape(-1), token_mask.contiguous() if has_mask else ids, order, sorted_e, offs, pairs, k,
        num_experts, HAS_MASK=has_mask, CHUNK=SORT_CHUNK, num_warps=4,
    )
    return order, sorted_e, offs


def sort_by_expert_triton(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """:func:`~mla_compile.ops.moe_experts.sort_by_expert`'s contract (``(order [T*k] int64, offs [E] int32)``)
    in one counting-sort launch instead of torch's scatter, radix sort and scan, where Triton runs the tensors (CUDA,
    or CPU under Triton's interpreter); elsewhere ``sort_by_expert`` itself."""
    if ids.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return sort_by_expert(ids, num_experts)
    order, _, offs = counting_sort(ids, num_experts, order_dtype=torch.int64)
    return order, offs


def align_blocks(ids: Tensor, num_experts: int, bm: int,
                 token_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The routed pairs of ``ids [T, k]`` in blocks of ``bm`` rows, one expert per block (device-side, no
    host read): ``(rows [NB * bm] int32, block_expert [NB] int32, block_used [NB] int32)``. ``rows[b * bm +
    m]`` for ``m < block_used[b]`` is the pair ``t * k + j`` (the others are never written nor read);
    ``block_expert[b]`` is E for the unused blocks past the last expert. ``NB`` comes from shapes only.
    ``token_mask [T]`` bool: the picks of tokens where it is False get no row."""
    T, k = ids.shape
    pairs = T * k
    nb = triton.cdiv(pairs + min(num_experts, pairs) * (bm - 1), bm)
    dev = ids.device
    order, sorted_e, offs = counting_sort(ids, num_experts, token_mask)
    rows = torch.empty(nb * bm, dtype=torch.int32, device=dev)
    bexp = torch.empty(nb, dtype=torch.int32, device=dev)
    bcnt = torch.empty(nb, dtype=torch.int32, device=dev)
    chunk = 32
    wrap_triton(_moe_align_kernel)[(triton.cdiv(max(pairs, nb), chunk),)](
        sorted_e, order, offs, rows, bexp, bcnt, pairs, num_experts, nb,
        BLOCK_M=bm, EP=pow2(num_experts), CHUNK=chunk, num_warps=4,
    )
    return rows, bexp, bcnt


def _launch(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, shared_gate: Tensor | None,
            shared_up: Tensor | None, shared_down: Tensor | None, out_float32: bool,
            token_mask: Tensor | None = None) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract."""
    T, H = x.shape
    E, K = gate_up.shape[0], ids.shape[1]
    I = gate_up.shape[1] // 2
    out = torch.empty(T, H, dtype=_out_dtype(x, out_float32), device=x.device)
    if T == 0:
        return out
    x, weights, ids, gate_up, down, sg, su, sd, S = launch_operands(x, weights, ids, gate_up, down, shared_gate,
                                                                    shared_up, shared_down)
    slots = K + S
    bm = block_m(T, K, E)
    rows, bexp, bcnt = align_blocks(ids, E, bm, token_mask)
    has_mask = token_mask is not None
    mask = token_mask.contiguous() if has_mask else ids  # never read without a mask
    tb = triton.cdiv(T, bm)  # blocks per shared expert
    sb = S * tb
    blocks = sb + bexp.shape[0]
    wide = 2 if x.dtype == torch.float32 else 1  # float32: half the K step (registers, shared memory)
    ieee = x.dtype == torch.float32
    cfg = CONFIG
    h = torch.empty(blocks * bm, I, dtype=x.dtype, device=x.device)
    wrap_triton(_moe_grouped_gate_up_kernel)[(blocks, triton.cdiv(I, cfg["gate_up_n"]))](
        x, rows, bexp, bcnt, gate_up, sg, su, h, mask, T, H, I, E, K, sb, tb,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), sg.stride(0), su.stride(0), h.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg["gate_up_n"], BLOCK_K=cfg["gate_up_k"] // wide, NUM_STAGES=cfg["num_stages"],
        IEEE=ieee, HAS_MASK=has_mask, num_warps=cfg["num_warps"],
    )
    y = torch.empty(T * slots, H, dtype=torch.float32, device=x.device)
    wrap_triton(_moe_grouped_down_kernel)[(blocks, triton.cdiv(H, cfg["down_n"]))](
        h, rows, bexp, bcnt, weights, down, sd, y, mask, T, H, I, E, K, sb, tb,
        h.stride(0), weights.stride(0), down.stride(0), down.stride(1), sd.stride(0), y.stride(0),
        SLOTS=slots, BLOCK_M=bm, BLOCK_N=cfg["down_n"], BLOCK_K=cfg["down_k"] // wide,
        NUM_STAGES=cfg["down_stages"] or cfg["num_stages"], IEEE=ieee, HAS_MASK=has_mask,
        num_warps=cfg["down_warps"] or cfg["num_warps"],
    )
    wrap_triton(_moe_combine_kernel)[(T, triton.cdiv(H, COMBINE_BLOCK))](
        y, out, mask, H, y.stride(0), out.stride(0), SLOTS=slots, BLOCK=COMBINE_BLOCK, HAS_MASK=has_mask,
        num_warps=4,
    )
    return out


@triton_op("mla::moe_experts_grouped_triton", mutates_args=())
def moe_experts_grouped_triton(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor,
                               shared_gate: Tensor | None, shared_up: Tensor | None, shared_down: Tensor | None,
                               out_float32: bool, token_mask: Tensor | None = None) -> Tensor:
    """Grouped Triton ``mla::moe_experts`` (contract of the ``_ref`` op; ``token_mask [T]`` bool: False rows give
    0 and read no expert); non-CUDA or float64 runs the reference."""
    validate(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, token_mask)
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return torch.ops.mla.moe_experts_ref(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down,
                                             out_float32, token_mask)
    return _launch(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, out_float32, token_mask)
