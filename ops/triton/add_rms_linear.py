"""Triton ``mla::add_rms_linear``: the residual add and RMSNorm done by the GEMV's own programs, for few rows.

Up to ``MAX_ROWS`` rows, one launch, the grid of ``skinny_linear._skinny_linear_kernel`` (``BLOCK_N`` rows of one
weight a program, the first weight's tiles then the second's, ``M_BLOCK`` rows of h): a program requests its
weight's first tile, waits (PDL), then sums its rows' ``h + residual`` over K (rounded to the dtype; the
programs of the first tile store them), takes ``rsqrt(mean + eps)`` and walks K again, forming the normed rows
(rounded as the contract says) and their products with the weight tile. Each program reads the rows itself (a
few KB from L2 against its weight tile's 16 KB from memory), so no kernel has to write the normed rows first.
More rows: ``_add_rms_kernel`` (one program a row: the sum and the normed rows) and ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.add_rms_linear import fake, validate
from mla_compile.ops.skinny_linear import MAX_ROWS
from mla_compile.ops.triton._common import last_dim_contiguous
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait
from mla_compile.ops.triton.skinny_linear import BLOCK_N, M_BLOCK, MAX_BLOCK_K


@triton.jit
def _sum_rows(h_ptr, r_ptr, m, k, ok, s_h, s_r):
    """The rows ``m`` of ``h + residual`` at columns ``k``, rounded to h's dtype (the model's add), as float32."""
    a = tl.load(h_ptr + m[:, None].to(tl.int64) * s_h + k[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(r_ptr + m[:, None].to(tl.int64) * s_r + k[None, :], mask=ok, other=0.0).to(tl.float32)
    return (a + b).to(h_ptr.dtype.element_ty)


@triton.jit
def _add_rms_linear_kernel(
    h_ptr, r_ptr, nw_ptr, w1_ptr, w2_ptr, s_ptr, y1_ptr, y2_ptr,
    M, N1, N2, K, TILES1, eps,
    s_h, s_r, s_s, s_w1, s_w2, s_y1, s_y2,
    M_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    first = tile < TILES1
    n0 = tl.where(first, tile, tile - TILES1) * BLOCK_N
    n_max = tl.where(first, N1, N2)
    w_base = tl.where(first, w1_ptr, w2_ptr)
    w_stride = tl.where(first, s_w1, s_w2).to(tl.int64)
    y_base = tl.where(first, y1_ptr, y2_ptr)
    y_stride = tl.where(first, s_y1, s_y2).to(tl.int64)

    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < n_max
    rows = tl.arange(0, M_BLOCK)
    m = tl.program_id(1) * M_BLOCK + rows
    m_ok = m < M
    w_rows = w_base + n.to(tl.int64) * w_stride
    cols = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows[:, None] + cols[None, :], mask=n_ok[:, None] & (cols < K)[None, :], other=0.0)
    pdl_wait(PDL)  # the first weight tile is in flight before h and the residual, earlier kernels' outputs, are read
    pdl_launch_dependents(PDL)
    squares = tl.zeros([M_BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        ok = m_ok[:, None] & (k < K)[None, :]
        s = _sum_rows(h_ptr, r_ptr, m, k, ok, s_h, s_r)
        if tile == 0:
            tl.store(s_ptr + m[:, None].to(tl.int64) * s_s + k[None, :], s, mask=ok)
        sf = s.to(tl.float32)
        squares += tl.sum(sf * sf, axis=1)
    rstd = tl.rsqrt(squares / K + eps)
    acc = tl.zeros([M_BLOCK, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        if k0 > 0:
            w = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        ok = m_ok[:, None] & k_ok[None, :]
        s = _sum_rows(h_ptr, r_ptr, m, k, ok, s_h, s_r).to(tl.float32)
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        normed = (s * rstd[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)
        x = (normed * nw[None, :]).to(h_ptr.dtype.element_ty).to(tl.float32)
        wf = w.to(tl.float32)
        for i in tl.static_range(M_BLOCK):
            xr = tl.sum(tl.where(rows[:, None] == i, x, 0.0), axis=0)
            part = tl.sum(wf * xr[None, :], axis=1)
            acc += tl.where(rows[:, None] == i, part[None, :], 0.0)
    out = y_base + m[:, None].to(tl.int64) * y_stride + n[None, :]
    tl.store(out, acc.to(y1_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _add_rms_kernel(h_ptr, r_ptr, nw_ptr, s_ptr, x_ptr, K, eps, s_h, s_r, s_s, s_x,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program a row: ``s = h + residual`` and the normed row ``x`` (the contract's roundings)."""
    m = tl.program_id(0).to(tl.int64) + tl.zeros([1], dtype=tl.int64)
    cols = tl.arange(0, BLOCK_K)
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    squares = tl.zeros([1], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        ok = (k < K)[None, :]
        s = _sum_rows(h_ptr, r_ptr, m, k, ok, s_h, s_r)
        tl.store(s_ptr + m[:, None] * s_s + k[None, :], s, mask=ok)
        sf = s.to(tl.float32)
        squares += tl.sum(sf * sf, axis=1)
    rstd = tl.rsqrt(squares / K + eps)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        ok = (k < K)[None, :]
        s = _sum_rows(h_ptr, r_ptr, m, k, ok, s_h, s_r).to(tl.float32)  # again: no read of this program's stores
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        normed = (s * rstd[:, None]).to(h_ptr.dtype.element_ty).to(tl.float32)
        tl.store(x_ptr + m[:, None] * s_x + k[None, :], (normed * nw[None, :]).to(x_ptr.dtype.element_ty), mask=ok)


def _launch(h: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weights: list[Tensor]) -> list[Tensor]:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract, any number of rows."""
    M, K = h.shape
    h, residual, norm_weight = last_dim_contiguous(h), last_dim_contiguous(residual), norm_weight.contiguous()
    s = torch.empty(M, K, dtype=h.dtype, device=h.device)
    ws = [last_dim_contiguous(w) for w in weights]
    if M > MAX_ROWS:
        x = torch.empty(M, K, dtype=h.dtype, device=h.device)
        wrap_triton(_add_rms_kernel)[(M,)](h, residual, norm_weight, s, x, K, float(eps), h.stride(0), residual.stride(0),
                              s.stride(0), x.stride(0), BLOCK_K=min(triton.next_power_of_2(K), MAX_BLOCK_K),
                              num_warps=4, **launch_kwargs(h.device, K > 0))
        return [s] + [F.linear(x, w) for w in ws]
    outs = [torch.empty(M, w.shape[0], dtype=h.dtype, device=h.device) for w in ws]
    if M == 0:
        return [s] + outs
    w1, w2 = ws[0], ws[-1]
    y1, y2 = outs[0], outs[-1]
    n2 = w2.shape[0] if len(ws) == 2 else 0
    tiles1 = triton.cdiv(w1.shape[0], BLOCK_N)
    grid = (tiles1 + triton.cdiv(n2, BLOCK_N), triton.cdiv(M, M_BLOCK))
    wrap_triton(_add_rms_linear_kernel)[grid](
        h, residual, norm_weight, w1, w2, s, y1, y2, M, w1.shape[0], n2, K, tiles1, float(eps),
        h.stride(0), residual.stride(0), s.stride(0), w1.stride(0), w2.stride(0), y1.stride(0), y2.stride(0),
        M_BLOCK=M_BLOCK, BLOCK_N=BLOCK_N, BLOCK_K=min(triton.next_power_of_2(K), MAX_BLOCK_K), num_warps=4,
        **launch_kwargs(h.device, K > 0),
    )
    return [s] + outs


@torch.library.custom_op("mla::add_rms_linear_triton", mutates_args=())
def add_rms_linear_triton(h: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                          weights: list[Tensor]) -> list[Tensor]:
    """Triton ``mla::add_rms_linear`` (contract of the ``_ref`` op); non-CUDA tensors or float32/float64 run the
    reference."""
    if h.device.type != "cuda" or h.dtype not in (torch.bfloat16, torch.float16):
        return torch.ops.mla.add_rms_linear_ref(h, residual, norm_weight, eps, weights)
    validate(h, residual, norm_weight, weights)
    return _launch(h, residual, norm_weight, eps, weights)


add_rms_linear_triton.register_fake(fake)
