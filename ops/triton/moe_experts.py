"""Triton ``mla::moe_experts``: the routed (and shared) experts for few tokens, reading only the picked experts.

Rows are (token, slot) pairs, slot ``j < k`` the j-th pick of the token and ``j >= k`` the shared expert
``j - k`` (a ``[I]``-wide slice of the shared MLP, weight 1). Kernel 1, grid (rows, I tiles): one
program computes ``BLOCK_N`` columns of the row's gate and up products over all of H (a GEMV on the
expert's rows) and stores ``silu(g) * u`` in x's dtype; the
routed and shared weights live in different tensors, so a row's base pointer and row stride are selected
with ``tl.where`` (no branch). Kernel 2, grid (tokens, H tiles): one program computes ``BLOCK_H`` outputs
of its token, walking I in chunks and, per chunk, every slot (unrolled: k and the slot count are
compile-time constants) with the slot's weight, in float32: no atomics, the same sum order every run.
With a token mask (``HAS_MASK``) a program of a masked token returns before any weight load: kernel 1
stores nothing (its rows of the activation stay unwritten), kernel 2 stores zeros.

Kernel 1's pipelined GEMV form (``CONFIG["gate_up_pipe"]``, the default for bf16 / fp16 x): the same grid with
narrow tiles (16 outputs), each step's products kept element-wise in float32 and summed along H once at the end, the
steps' loads software-pipelined (``tl.range``'s stages), so many small programs, several an SM, stream the weights.

The tensor-core forms (``CONFIG["gate_up_dot"]``, kernel 1's for bf16 / fp16 x without ``gate_up_pipe``, and
``CONFIG["down_dot"]``): the
same grids and outputs, but each step multiplies the weight tiles by the activation broadcast to 16 columns with
``tl.dot`` (float32 accumulation; the columns are equal, column 0 is kept), so Triton's software pipeliner
streams the weight tiles through shared memory (cp.async) several steps deep instead of one register load a
step; the down form walks every (slot, chunk) in one loop, weighting each chunk's product.

On sm_90, where the op runs eagerly (inside the opaque ``mla::moe_experts_split``, as the model's "auto" runs it),
both kernels are launched with PDL (``_pdl.py``): every program waits before it reads anything a kernel of the step
writes, then triggers; a masked token's too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.moe_experts import _out_dtype, validate
from mla_compile.ops.triton._common import last_dim_contiguous, num_sms, widest_tile
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait


@triton.jit
def _slot_rows(ids_ptr, gu_ptr, sg_ptr, su_ptr, t, j, K, I, s_ids, s_gue, s_gun, s_sg, s_su, offs_n):
    """Row pointers ``(gate, up)`` of the columns ``offs_n`` of slot ``j`` of token ``t``: the j-th pick's expert in
    ``gate_up`` for ``j < K``, else slice ``j - K`` of the shared weights (selected with ``tl.where``, no branch)."""
    routed = j < K
    e = tl.load(ids_ptr + t.to(tl.int64) * s_ids + j, mask=routed, other=0).to(tl.int64)
    shared_row = (j - K).to(tl.int64) * I  # first row of shared slice j - k
    g_base = tl.where(routed, gu_ptr + e * s_gue, sg_ptr + shared_row * s_sg)
    u_base = tl.where(routed, gu_ptr + e * s_gue + I * s_gun, su_ptr + shared_row * s_su)
    g_stride = tl.where(routed, s_gun, s_sg).to(tl.int64)
    u_stride = tl.where(routed, s_gun, s_su).to(tl.int64)
    return g_base + offs_n.to(tl.int64) * g_stride, u_base + offs_n.to(tl.int64) * u_stride


@triton.jit
def _gate_up_row(I, SLOTS, BLOCK_N: tl.constexpr):
    """Kernel 1's program: its row (token ``t``, slot ``j``) and ``BLOCK_N`` columns ``offs_n``, real where ``n_ok``.
    Returns ``(row, t, j, offs_n, n_ok)``."""
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return row, row // SLOTS, row % SLOTS, offs_n, offs_n < I


@triton.jit
def _gate_up_prologue(mask_ptr, t, HAS_MASK: tl.constexpr, PDL: tl.constexpr):
    """Kernel 1's start: under ``PDL`` the wait (the picks, x and the mask may be the previous kernel's outputs) and
    the trigger; returns whether the token is real (a masked token's program then stores nothing)."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    return tl.load(mask_ptr + t, mask=HAS_MASK, other=1) != 0


@triton.jit
def _store_activation(h_ptr, row, s_h, offs_n, n_ok, g, u):
    """Kernel 1's end: ``silu(g) * u`` of the row's columns into ``h`` in its dtype."""
    a = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + row.to(tl.int64) * s_h + offs_n, a.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_prologue(out_ptr, mask_ptr, t, s_out, offs_h, h_ok, BLOCK_H: tl.constexpr, HAS_MASK: tl.constexpr,
                   PDL: tl.constexpr):
    """Kernel 2's start: under ``PDL`` the wait and the trigger; a masked token's program stores its zeros and the
    caller returns; returns whether the token is real."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    live = tl.load(mask_ptr + t, mask=HAS_MASK, other=1) != 0
    if not live:
        tl.store(out_ptr + t * s_out + offs_h, tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty), mask=h_ok)
    return live


@triton.jit
def _down_sum(h_ptr, w_ptr, ids_ptr, dn_ptr, sd_ptr, t, offs_h, h_ok, I, s_h, s_w, s_ids, s_de, s_dh, s_sd,
              K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Kernel 2's float32 sums for token ``t``'s outputs ``offs_h``: every slot's down rows times the slot's
    activation, weighted by its pick (1 for a shared slot)."""
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    # K chunks outside, the slots unrolled inside: every slot's loads of a chunk are independent and issue
    # together (memory-level parallelism); the sum order is fixed by the code, the same every run
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        m = h_ok[:, None] & k_ok[None, :]
        for j in tl.static_range(SLOTS):
            if j < K:
                e = tl.load(ids_ptr + t * s_ids + j).to(tl.int64)
                weight = tl.load(w_ptr + t * s_w + j)
                rows = dn_ptr + e * s_de + offs_h.to(tl.int64) * s_dh
            else:
                weight = 1.0
                rows = sd_ptr + (j - K) * I + offs_h.to(tl.int64) * s_sd
            a = tl.load(h_ptr + (t * SLOTS + j) * s_h + k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(rows[:, None] + k[None, :], mask=m, other=0.0).to(tl.float32)
            acc += weight * tl.sum(w * a[None, :], axis=1)
    return acc


@triton.jit
def _gate_up_pipe_sums(x_row, g_rows, u_rows, n_ok, H, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    """The pipelined GEMV form's ``(gate, up)`` float32 sums of one row's columns over all of H."""
    # element-wise float32 products summed along K once at the end: no reduction a step, so the pipeliner's
    # copies of the next steps' tiles are all that a step waits on
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xk = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(g_rows[:, None] + k[None, :], mask=m, other=0.0).to(tl.float32) * xk
        acc_u += tl.load(u_rows[:, None] + k[None, :], mask=m, other=0.0).to(tl.float32) * xk
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, ids_ptr, gu_ptr, sg_ptr, su_ptr, h_ptr, mask_ptr,
    H, I, K, SLOTS,
    s_x, s_ids, s_gue, s_gun, s_sg, s_su, s_h,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, PDL: tl.constexpr,
):
    row, t, j, offs_n, n_ok = _gate_up_row(I, SLOTS, BLOCK_N)
    if not _gate_up_prologue(mask_ptr, t, HAS_MASK, PDL):
        return  # a padding token: no weight reads, its activation rows are never read
    g_rows, u_rows = _slot_rows(ids_ptr, gu_ptr, sg_ptr, su_ptr, t, j, K, I, s_ids, s_gue, s_gun, s_sg, s_su, offs_n)
    x_row = x_ptr + t.to(tl.int64) * s_x
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xk = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.sum(tl.load(g_rows[:, None] + k[None, :], mask=m, other=0.0).to(tl.float32) * xk, axis=1)
        acc_u += tl.sum(tl.load(u_rows[:, None] + k[None, :], mask=m, other=0.0).to(tl.float32) * xk, axis=1)
    _store_activation(h_ptr, row, s_h, offs_n, n_ok, acc_g, acc_u)


@triton.jit
def _moe_gate_up_dot_kernel(
    x_ptr, ids_ptr, gu_ptr, sg_ptr, su_ptr, h_ptr, mask_ptr,
    H, I, K, SLOTS,
    s_x, s_ids, s_gue, s_gun, s_sg, s_su, s_h,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    row, t, j, offs_n, n_ok = _gate_up_row(I, SLOTS, BLOCK_N)
    if not _gate_up_prologue(mask_ptr, t, HAS_MASK, PDL):
        return  # a padding token: no weight reads, its activation rows are never read
    g_rows, u_rows = _slot_rows(ids_ptr, gu_ptr, sg_ptr, su_ptr, t, j, K, I, s_ids, s_gue, s_gun, s_sg, s_su, offs_n)
    cols = tl.arange(0, 16)
    x_row = x_ptr + t.to(tl.int64) * s_x
    acc_g = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xk = tl.load(x_row + k[:, None] + 0 * cols[None, :], mask=k_ok[:, None], other=0.0)  # [BLOCK_K, 16]
        m = n_ok[:, None] & k_ok[None, :]
        acc_g = tl.dot(tl.load(g_rows[:, None] + k[None, :], mask=m, other=0.0), xk, acc_g)
        acc_u = tl.dot(tl.load(u_rows[:, None] + k[None, :], mask=m, other=0.0), xk, acc_u)
    first = cols[None, :] == 0
    _store_activation(h_ptr, row, s_h, offs_n, n_ok, tl.sum(tl.where(first, acc_g, 0.0), axis=1),
                      tl.sum(tl.where(first, acc_u, 0.0), axis=1))


@triton.jit
def _moe_gate_up_pipe_kernel(
    x_ptr, ids_ptr, gu_ptr, sg_ptr, su_ptr, h_ptr, mask_ptr,
    H, I, K, SLOTS,
    s_x, s_ids, s_gue, s_gun, s_sg, s_su, s_h,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    row, t, j, offs_n, n_ok = _gate_up_row(I, SLOTS, BLOCK_N)
    if not _gate_up_prologue(mask_ptr, t, HAS_MASK, PDL):
        return  # a padding token: no weight reads, its activation rows are never read
    g_rows, u_rows = _slot_rows(ids_ptr, gu_ptr, sg_ptr, su_ptr, t, j, K, I, s_ids, s_gue, s_gun, s_sg, s_su, offs_n)
    g, u = _gate_up_pipe_sums(x_ptr + t.to(tl.int64) * s_x, g_rows, u_rows, n_ok, H, BLOCK_N, BLOCK_K, NUM_STAGES)
    _store_activation(h_ptr, row, s_h, offs_n, n_ok, g, u)


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, ids_ptr, dn_ptr, sd_ptr, out_ptr, mask_ptr,
    H, I,
    s_h, s_w, s_ids, s_de, s_dh, s_sd, s_out,
    K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    if not _down_prologue(out_ptr, mask_ptr, t, s_out, offs_h, h_ok, BLOCK_H, HAS_MASK, PDL):
        return  # a padding token: output 0, no weight reads
    acc = _down_sum(h_ptr, w_ptr, ids_ptr, dn_ptr, sd_ptr, t, offs_h, h_ok, I, s_h, s_w, s_ids, s_de, s_dh, s_sd, K,
                    SLOTS, BLOCK_H, BLOCK_K)
    tl.store(out_ptr + t * s_out + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _moe_down_dot_kernel(
    h_ptr, w_ptr, ids_ptr, dn_ptr, sd_ptr, out_ptr, mask_ptr,
    H, I,
    s_h, s_w, s_ids, s_de, s_dh, s_sd, s_out,
    K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    if not _down_prologue(out_ptr, mask_ptr, t, s_out, offs_h, h_ok, BLOCK_H, HAS_MASK, PDL):
        return  # a padding token: output 0, no weight reads
    cols = tl.arange(0, 16)
    n_k = tl.cdiv(I, BLOCK_K)
    acc = tl.zeros([BLOCK_H, 16], dtype=tl.float32)
    # one loop over (slot, I chunk), slot-major: the pipeliner streams every slot's tiles without a drain between
    # slots; each chunk's product is weighted and added in the same order every run
    for it in tl.range(0, SLOTS * n_k, num_stages=NUM_STAGES):
        j = it // n_k
        k = (it - j * n_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < I
        routed = j < K
        e = tl.load(ids_ptr + t * s_ids + j, mask=routed, other=0).to(tl.int64)
        weight = tl.where(routed, tl.load(w_ptr + t * s_w + j, mask=routed, other=0.0), 1.0)
        base = tl.where(routed, dn_ptr + e * s_de, sd_ptr + (j - K).to(tl.int64) * I)
        stride = tl.where(routed, s_dh, s_sd).to(tl.int64)
        w = tl.load(base + offs_h.to(tl.int64)[:, None] * stride + k[None, :], mask=h_ok[:, None] & k_ok[None, :],
                    other=0.0)
        a = tl.load(h_ptr + (t * SLOTS + j) * s_h + k[:, None] + 0 * cols[None, :], mask=k_ok[:, None], other=0.0)
        acc += weight * tl.dot(w, a)
    out = tl.sum(tl.where(cols[None, :] == 0, acc, 0.0), axis=1)
    tl.store(out_ptr + t * s_out + offs_h, out.to(out_ptr.dtype.element_ty), mask=h_ok)


# Launch parameters (a benchmark may swap them; each config is checked against the reference there).
# ``tile``: elements of a program's weight tile per load step (BLOCK_N * BLOCK_K, BLOCK_H * BLOCK_K); ``waves``:
# the widest output tile (16, 8 or 4) is taken that still gives every SM this many programs; ``narrow_tile``: the
# elements a load step of a 4-wide tile (few tokens: the whole of H or I in one step, the most bytes in flight;
# wider tiles keep the smaller tiles, which do not spill). Timings: ``bench_moe --sweep``, BENCHMARKS.md.
# ``gate_up_dot`` / ``down_dot``: the kernels' tensor-core forms for bf16 / fp16 x, ``dot_n`` x ``dot_k`` (``down_h`` x
# ``down_k``) weight tiles ``dot_stages`` (``down_stages``) deep, ``dot_warps`` warps; float32 x always takes the
# GEMV forms (tl.dot would round it to tf32). Without ``gate_up_pipe``, kernel 1 takes its tensor-core form (as fast
# as its GEMV at one token, faster at two and more); kernel 2 keeps the GEMV (its tensor-core form has too few programs at few tokens). Kernel 1's tiles:
# 64 outputs by 64 of H, 10 deep (``bench_moe --sweep dot`` at one and two tokens: the more bytes in flight a
# program the faster, one program an SM then; narrower tiles with more programs an SM were slower).
# ``gate_up_pipe`` (over ``gate_up_dot``, bf16 / fp16 x; the default): kernel 1's pipelined GEMV form, ``pipe_n`` x
# ``pipe_k`` weight tiles ``pipe_stages`` deep, ``pipe_warps`` warps: many small programs, several an SM, as a plain
# streaming read of the same bytes; at one and two tokens it reads at the speed of such a read where the tensor-core
# form's one program an SM does not (its 176 programs at V2-Lite's dims fill the 132 SMs once and a third).
# ``gemv_down_h`` / ``gemv_down_k`` / ``gemv_down_warps``: the down GEMV's output rows, I step and warps a program
# when set (0: from ``waves`` / ``down_tile`` / ``narrow_tile`` / ``num_warps`` as above).
CONFIG = dict(gate_up_tile=4096, down_tile=2048, waves=8, num_warps=4, narrow_tile=8192,
              gate_up_dot=True, dot_n=64, dot_k=64, dot_stages=10, down_dot=False, down_h=16, down_k=256,
              down_stages=5, dot_warps=4, gate_up_pipe=True, pipe_n=16, pipe_k=256, pipe_stages=3, pipe_warps=4,
              gemv_down_h=0, gemv_down_k=0, gemv_down_warps=0)


def _tile(name: str, block: int) -> int:
    """Elements of a program's weight tile per load step for ``block`` outputs (``CONFIG[name]``, or
    ``narrow_tile`` for 4-wide tiles where the config has one)."""
    return CONFIG.get("narrow_tile", CONFIG[name]) if block == 4 else CONFIG[name]


def _blocks(programs_per_tile: int, width: int, device: torch.device) -> int:
    """The widest tile (16, 8 or 4 outputs) that still gives every SM ``CONFIG["waves"]`` programs."""
    return widest_tile(programs_per_tile, width, num_sms(device), CONFIG["waves"])


def launch_operands(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, shared_gate: Tensor | None,
                    shared_up: Tensor | None, shared_down: Tensor | None) -> tuple:
    """The operands as the MoE launchers (this module's and ``moe_grouped``'s) pass them to their kernels:
    ``(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, S)`` with contiguous last dims,
    contiguous ids, float32 weights and ``S`` the shared experts' width in units of I; without shared experts
    ``gate_up`` / ``down`` stand in for them (never read: any pointers of the right type)."""
    I = gate_up.shape[1] // 2
    S = 0 if shared_gate is None else shared_gate.shape[0] // I
    x = last_dim_contiguous(x)
    gate_up, down = last_dim_contiguous(gate_up), last_dim_contiguous(down)
    ids, weights = ids.contiguous(), weights.float().contiguous()
    if S:
        sg, su, sd = (last_dim_contiguous(t) for t in (shared_gate, shared_up, shared_down))
    else:
        sg, su, sd = gate_up, gate_up, down
    return x, weights, ids, gate_up, down, sg, su, sd, S


def _launch(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, shared_gate: Tensor | None,
            shared_up: Tensor | None, shared_down: Tensor | None, out_float32: bool,
            token_mask: Tensor | None = None) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract."""
    T, H = x.shape
    K = ids.shape[1]
    I = gate_up.shape[1] // 2
    out = torch.empty(T, H, dtype=_out_dtype(x, out_float32), device=x.device)
    if T == 0:
        return out
    x, weights, ids, gate_up, down, sg, su, sd, S = launch_operands(x, weights, ids, gate_up, down, shared_gate,
                                                                    shared_up, shared_down)
    slots = K + S
    mask = ids if token_mask is None else token_mask.contiguous()  # never read without a mask
    h = torch.empty(T * slots, I, dtype=x.dtype, device=x.device)
    wide = 2 if x.dtype == torch.float32 else 1  # float32 weights: half the elements per tile (registers)
    # PDL where the op runs eagerly (inside the opaque split op, or called directly), not while Inductor traces it
    pdl = launch_kwargs(x.device, eager_only=True)
    block_h = CONFIG["gemv_down_h"] or _blocks(T, H, x.device)
    block_k = CONFIG["gemv_down_k"] or _tile("down_tile", block_h) // block_h // wide
    gate_up_args = (x, ids, gate_up, sg, su, h, mask, H, I, K, slots, x.stride(0), ids.stride(0), gate_up.stride(0),
                    gate_up.stride(1), sg.stride(0), su.stride(0), h.stride(0))
    if CONFIG["gate_up_pipe"] and x.dtype != torch.float32:
        wrap_triton(_moe_gate_up_pipe_kernel)[(T * slots, triton.cdiv(I, CONFIG["pipe_n"]))](
            *gate_up_args, BLOCK_N=CONFIG["pipe_n"], BLOCK_K=CONFIG["pipe_k"], HAS_MASK=token_mask is not None,
            NUM_STAGES=CONFIG["pipe_stages"], num_warps=CONFIG["pipe_warps"], **pdl,
        )
    elif CONFIG["gate_up_dot"] and x.dtype != torch.float32:
        wrap_triton(_moe_gate_up_dot_kernel)[(T * slots, triton.cdiv(I, CONFIG["dot_n"]))](
            *gate_up_args, BLOCK_N=CONFIG["dot_n"], BLOCK_K=CONFIG["dot_k"], HAS_MASK=token_mask is not None,
            NUM_STAGES=CONFIG["dot_stages"], num_warps=CONFIG["dot_warps"], **pdl,
        )
    else:
        block_n = _blocks(T * slots, I, x.device)
        wrap_triton(_moe_gate_up_kernel)[(T * slots, triton.cdiv(I, block_n))](
            *gate_up_args, BLOCK_N=block_n, BLOCK_K=_tile("gate_up_tile", block_n) // block_n // wide,
            HAS_MASK=token_mask is not None, num_warps=CONFIG["num_warps"], **pdl,
        )
    down_args = (h, weights, ids, down, sd, out, mask, H, I, h.stride(0), weights.stride(0), ids.stride(0),
                 down.stride(0), down.stride(1), sd.stride(0), out.stride(0))
    if CONFIG["down_dot"] and x.dtype != torch.float32:
        wrap_triton(_moe_down_dot_kernel)[(T, triton.cdiv(H, CONFIG["down_h"]))](
            *down_args, K=K, SLOTS=slots, BLOCK_H=CONFIG["down_h"], BLOCK_K=CONFIG["down_k"],
            HAS_MASK=token_mask is not None, NUM_STAGES=CONFIG["down_stages"], num_warps=CONFIG["dot_warps"], **pdl,
        )
    else:
        wrap_triton(_moe_down_kernel)[(T, triton.cdiv(H, block_h))](
            *down_args, K=K, SLOTS=slots, BLOCK_H=block_h, BLOCK_K=block_k, HAS_MASK=token_mask is not None,
            num_warps=CONFIG["gemv_down_warps"] or CONFIG["num_warps"], **pdl,
        )
    return out


@triton_op("mla::moe_experts_triton", mutates_args=())
def moe_experts_triton(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor,
                       shared_gate: Tensor | None, shared_up: Tensor | None, shared_down: Tensor | None,
                       out_float32: bool, token_mask: Tensor | None = None) -> Tensor:
    """Triton ``mla::moe_experts`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return torch.ops.mla.moe_experts_ref(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down,
                                             out_float32, token_mask)
    validate(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, token_mask)
    return _launch(x, weights, ids, gate_up, down, shared_gate, shared_up, shared_down, out_float32, token_mask)
