"""Triton ``mla::moe_experts_fp8``: the routed (and shared) fp8 experts for few tokens, reading only the picks.

The two kernels of :mod:`mla_compile.ops.triton.moe_experts` (rows are (token, slot) pairs, slot ``j < k`` the
j-th pick and ``j >= k`` the shared slice ``j - k``; kernel 1 gate/up GEMVs with ``silu(g) * u`` fused, kernel 2
down with the weighted combine fused, slots unrolled in a fixed order: deterministic) over e4m3 codes: each
weight tile is loaded as raw bytes, bitcast to float8e4nv and widened to float32. A program's output rows are
``BLOCK_N``/``BLOCK_H`` (dividing 128) consecutive rows starting at a multiple of the tile, so they share one
128-row block of scales; along the reduction each column ``c`` takes its block's scale ``scale[row_block,
c // 128]``, folded into the activation (``sum_c w[n, c] * (x[c] * s[c])``: one scale gather per column, not per
weight). For the shared slices (rows ``(j - k) * I + n`` of the shared weights) the launch picks ``BLOCK_N``
dividing I, so their tiles never straddle a block either. With a token mask (``HAS_MASK``) a program of a masked
token returns before any weight load (kernel 1 stores nothing, kernel 2 stores zeros). A routed pick of weight 0
(expert parallelism gives the other ranks' picks weight 0 and expert 0) reads no weights either: kernel 1 returns
before any load, kernel 2 masks its loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.moe_experts import _out_dtype
from mla_compile.ops.moe_experts_fp8 import validate
from mla_compile.ops.triton._common import last_dim_contiguous, num_sms, widest_tile


@triton.jit
def _moe_fp8_gate_up_kernel(
    x_ptr, ids_ptr, wt_ptr, g_ptr, u_ptr, gs_ptr, us_ptr, sg_ptr, su_ptr, sgs_ptr, sus_ptr, h_ptr, mask_ptr, limit,
    H, I, K, SLOTS,
    s_x, s_ids, s_wt, s_ge, s_gn, s_ue, s_un, s_gse, s_gsn, s_use, s_usn, s_sg, s_su, s_sgs, s_sus, s_h,
    LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    limit = tl.full([], limit, tl.float32)  # Inductor passes Python floats as fp64: the clamps would make acc fp64
    row = tl.program_id(0)
    t = row // SLOTS
    j = row % SLOTS
    if HAS_MASK:
        if tl.load(mask_ptr + t) == 0:  # a padding token: no weight reads, its activation rows are never read
            return
    routed = j < K
    if tl.load(wt_ptr + t.to(tl.int64) * s_wt + j, mask=routed, other=1.0) == 0:  # a routed pick of weight 0 (another
        return  # rank's under expert parallelism): no weight reads, its activation row is never read
    e = tl.load(ids_ptr + t.to(tl.int64) * s_ids + j, mask=routed, other=0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    shared_row = (j - K).to(tl.int64) * I  # first row of shared slice j - k
    g_base = tl.where(routed, g_ptr + e * s_ge, sg_ptr + shared_row * s_sg)
    u_base = tl.where(routed, u_ptr + e * s_ue, su_ptr + shared_row * s_su)
    g_stride = tl.where(routed, s_gn, s_sg).to(tl.int64)
    u_stride = tl.where(routed, s_un, s_su).to(tl.int64)
    # the tile's scale row (one 128-row block: BLOCK_N divides 128, and I when shared slices exist)
    g_srow = tl.where(routed, gs_ptr + e * s_gse + (n0 // 128) * s_gsn, sgs_ptr + ((shared_row + n0) // 128) * s_sgs)
    u_srow = tl.where(routed, us_ptr + e * s_use + (n0 // 128) * s_usn, sus_ptr + ((shared_row + n0) // 128) * s_sus)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    g_rows = g_base + offs_n.to(tl.int64) * g_stride
    u_rows = u_base + offs_n.to(tl.int64) * u_stride
    x_row = x_ptr + t.to(tl.int64) * s_x
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xk = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        xg = (xk * tl.load(g_srow + k // 128, mask=k_ok, other=0.0))[None, :]
        xu = (xk * tl.load(u_srow + k // 128, mask=k_ok, other=0.0))[None, :]
        m = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(g_rows[:, None] + k[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        wu = tl.load(u_rows[:, None] + k[None, :], mask=m, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        acc_g += tl.sum(wg * xg, axis=1)
        acc_u += tl.sum(wu * xu, axis=1)
    if LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    a = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + row.to(tl.int64) * s_h + offs_n, a.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_fp8_down_kernel(
    h_ptr, w_ptr, ids_ptr, dn_ptr, ds_ptr, sd_ptr, sds_ptr, out_ptr, mask_ptr,
    H, I,
    s_h, s_w, s_ids, s_de, s_dh, s_dse, s_dsh, s_sd, s_sds, s_out,
    K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MASK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    offs_h = h0 + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    if HAS_MASK:
        if tl.load(mask_ptr + t) == 0:  # a padding token: output 0, no weight reads
            tl.store(out_ptr + t * s_out + offs_h, tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty), mask=h_ok)
            return
    hb = h0 // 128  # the tile's scale row (BLOCK_H divides 128)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        m = h_ok[:, None] & k_ok[None, :]
        for j in tl.static_range(SLOTS):
            if j < K:
                e = tl.load(ids_ptr + t * s_ids + j).to(tl.int64)
                weight = tl.load(w_ptr + t * s_w + j)
                rows = dn_ptr + e * s_de + offs_h.to(tl.int64) * s_dh
                scales = ds_ptr + e * s_dse + hb * s_dsh + k // 128
                live = k < tl.where(weight != 0, I, 0)  # a pick of weight 0 loads nothing (its h row is unwritten)
            else:  # columns (j - k) * I + c of the shared down projection
                weight = 1.0
                rows = sd_ptr + (j - K) * I + offs_h.to(tl.int64) * s_sd
                scales = sds_ptr + hb * s_sds + ((j - K) * I + k) // 128
                live = k_ok
            a = tl.load(h_ptr + (t * SLOTS + j) * s_h + k, mask=live, other=0.0).to(tl.float32)
            a = a * tl.load(scales, mask=live, other=0.0)
            w = tl.load(rows[:, None] + k[None, :], mask=m & live[None, :], other=0).to(tl.float8e4nv, bitcast=True)
            w = w.to(tl.float32)
            acc += weight * tl.sum(w * a[None, :], axis=1)
    tl.store(out_ptr + t * s_out + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


# Launch parameters (a benchmark may swap them; each config is checked against the reference there).
# ``tile``: elements of a program's weight tile per load step; ``waves``: the widest output tile (16, 8 or 4) is
# taken that still gives every SM this many programs (``bench_moe --sweep --fp8``, BENCHMARKS.md).
CONFIG = dict(gate_up_tile=4096, down_tile=4096, waves=2, num_warps=4)
_MAX_BLOCK_K = 1024


def _blocks(programs_per_tile: int, width: int, device: torch.device, divides: int = 0) -> int:
    """The widest tile (16, 8 or 4 outputs) that still gives every SM ``CONFIG["waves"]`` programs; halved until
    it divides ``divides`` (when nonzero)."""
    return widest_tile(programs_per_tile, width, num_sms(device), CONFIG["waves"], divides)


def _wrap(kernel):
    """``wrap_triton(kernel)``; under Triton's interpreter (CPU tests) the kernel itself (torch 2.11's
    ``wrap_triton`` refuses an interpreted function; an interpreted launch is never traced)."""
    from triton.runtime.jit import JITFunction

    return wrap_triton(kernel) if isinstance(kernel, JITFunction) else kernel


def _launch(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
            up_scale: Tensor, down: Tensor, down_scale: Tensor, shared_gate: Tensor | None,
            shared_gate_scale: Tensor | None, shared_up: Tensor | None, shared_up_scale: Tensor | None,
            shared_down: Tensor | None, shared_down_scale: Tensor | None, out_float32: bool,
            swiglu_limit: float | None, token_mask: Tensor | None = None) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract."""
    T, H = x.shape
    K = ids.shape[1]
    I = gate.shape[1]
    S = 0 if shared_gate is None else shared_gate.shape[0] // I
    slots = K + S
    out = torch.empty(T, H, dtype=_out_dtype(x, out_float32), device=x.device)
    if T == 0:
        return out

    def codes(w: Tensor) -> Tensor:  # raw bytes: the interpreter has no float8 numpy dtype
        return last_dim_contiguous(w).view(torch.uint8)

    x = last_dim_contiguous(x)
    g, u, d = codes(gate), codes(up), codes(down)
    gs, us, ds = (last_dim_contiguous(s) for s in (gate_scale, up_scale, down_scale))
    ids, weights = ids.contiguous(), weights.float().contiguous()
    if S:
        sg, su, sd = codes(shared_gate), codes(shared_up), codes(shared_down)
        sgs, sus, sds = (last_dim_contiguous(s) for s in (shared_gate_scale, shared_up_scale, shared_down_scale))
    else:  # never read (every slot is routed); any pointers of the right type
        sg, su, sd, sgs, sus, sds = g[0], u[0], d[0], gs[0], us[0], ds[0]
    mask = ids if token_mask is None else token_mask.contiguous()  # never read without a mask
    h = torch.empty(T * slots, I, dtype=x.dtype, device=x.device)
    wide = 2 if x.dtype == torch.float32 else 1  # float32 activations: half the elements per tile (registers)
    block_n = _blocks(T * slots, I, x.device, divides=I if S else 0)
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    _wrap(_moe_fp8_gate_up_kernel)[(T * slots, triton.cdiv(I, block_n))](
        x, ids, weights, g, u, gs, us, sg, su, sgs, sus, h, mask, limit, H, I, K, slots,
        x.stride(0), ids.stride(0), weights.stride(0), g.stride(0), g.stride(1), u.stride(0), u.stride(1),
        gs.stride(0), gs.stride(1), us.stride(0), us.stride(1), sg.stride(0), su.stride(0), sgs.stride(0),
        sus.stride(0), h.stride(0),
        LIMIT=swiglu_limit is not None, BLOCK_N=block_n,
        BLOCK_K=min(CONFIG["gate_up_tile"] // block_n // wide, _MAX_BLOCK_K), HAS_MASK=token_mask is not None,
        num_warps=CONFIG["num_warps"],
    )
    block_h = _blocks(T, H, x.device)
    _wrap(_moe_fp8_down_kernel)[(T, triton.cdiv(H, block_h))](
        h, weights, ids, d, ds, sd, sds, out, mask, H, I,
        h.stride(0), weights.stride(0), ids.stride(0), d.stride(0), d.stride(1), ds.stride(0), ds.stride(1),
        sd.stride(0), sds.stride(0), out.stride(0),
        K=K, SLOTS=slots, BLOCK_H=block_h, BLOCK_K=min(CONFIG["down_tile"] // block_h // wide, _MAX_BLOCK_K),
        HAS_MASK=token_mask is not None, num_warps=CONFIG["num_warps"],
    )
    return out


@triton_op("mla::moe_experts_fp8_triton", mutates_args=())
def moe_experts_fp8_triton(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                           up_scale: Tensor, down: Tensor, down_scale: Tensor, shared_gate: Tensor | None,
                           shared_gate_scale: Tensor | None, shared_up: Tensor | None,
                           shared_up_scale: Tensor | None, shared_down: Tensor | None,
                           shared_down_scale: Tensor | None, out_float32: bool,
                           swiglu_limit: float | None, token_mask: Tensor | None = None) -> Tensor:
    """Triton ``mla::moe_experts_fp8`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    args = (x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, shared_gate, shared_gate_scale,
            shared_up, shared_up_scale, shared_down, shared_down_scale)
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return torch.ops.mla.moe_experts_fp8_ref(*args, out_float32, swiglu_limit, token_mask)
    validate(*args, token_mask)
    return _launch(*args, out_float32, swiglu_limit, token_mask)
