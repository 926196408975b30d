"""Triton ``mla::skinny_norm_linear``: ``mla::skinny_linear``'s pipelined GEMV with the residual add and the RMSNorm
in its K loop, for up to ``MAX_ROWS`` rows.

Up to ``MAX_ROWS`` rows: ``_skinny_linear_pipe_kernel`` (``ops/triton/skinny_linear.py``) launched with ``NORM``: its
grid and tiles, and in each K step the rows' hidden values ``h = x + residual`` (rounded to x's dtype, as the eager
add) times the norm's weight in place of x, their squares summed; at the end a row's dots are scaled by
``rsqrt(sum / K + eps)``: the norm of the whole row, which every program reads anyway. The programs of the first
weight tile also store ``h``. More rows: ``_add_norm_kernel`` (the add and the norm, one launch; also
``mla::moe_norm_gate_route``'s for more tokens) and ``F.linear``. On sm_90 both are launched with PDL (``_pdl.py``):
the GEMV requests its first weight tile and the norm's weight before it waits for the kernel before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.skinny_norm_linear import MAX_ROWS, fake, reference, validate
from mla_compile.ops.triton._common import last_dim_contiguous
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait
from mla_compile.ops.triton.skinny_linear import (PIPE, _skinny_linear_pipe_kernel, hf_normed, hidden_values,
                                                  pipe_grid, weight_pair)


@triton.jit
def _add_norm_kernel(x_ptr, r_ptr, g_ptr, h_ptr, n_ptr, K, eps, s_x, s_r, s_h, s_n,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program a row: ``h = x + residual`` (stored) and its sum of squares, then ``norm(h)`` as HF's RMSNorm
    rounds it (``(h * rsqrt(mean(h^2) + eps))`` to x's dtype, times the norm's weight), stored to ``n_ptr``; the
    second pass forms ``h`` again from x and the residual (no read of this program's own stores)."""
    pdl_wait(PDL)  # x and the residual may be the previous kernel's outputs
    pdl_launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row, r_row, h_row, n_row = x_ptr + row * s_x, r_ptr + row * s_r, h_ptr + row * s_h, n_ptr + row * s_n
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        a = hidden_values(x_row, r_row, h_row, k, k < K, HAS_RES, True)
        ss += a * a
    inv = tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
    ty = x_ptr.dtype.element_ty
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        ok = k < K
        a = hidden_values(x_row, r_row, h_row, k, ok, HAS_RES, False)
        g = tl.load(g_ptr + k, mask=ok, other=0.0).to(tl.float32)
        tl.store(n_row + k, hf_normed(a, inv, g, ty), mask=ok)


def add_norm(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(h, normed)``: ``h = x + residual`` (a copy of x without a residual) and HF's RMSNorm of it, both
    ``[M, K]`` of x's dtype, in one launch (:func:`_add_norm_kernel`, as Inductor's fused kernel would be; the
    interpreter on CPU tensors too). Shapes as ``mla::skinny_norm_linear``'s contract, any number of rows."""
    M, K = x.shape
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    normed = torch.empty_like(h)
    if M and K:
        x = last_dim_contiguous(x)
        r = last_dim_contiguous(residual) if residual is not None else x  # never read without a residual
        wrap_triton(_add_norm_kernel)[(M,)](
            x, r, norm_weight.contiguous(), h, normed, K, float(eps), x.stride(0), r.stride(0), h.stride(0),
            normed.stride(0), HAS_RES=residual is not None, BLOCK=min(triton.next_power_of_2(K), 2048), num_warps=4,
            **launch_kwargs(x.device),
        )
    return h, normed


def _many_rows(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
               weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """More rows than the GEMV serves: :func:`add_norm`, then ``F.linear`` per weight."""
    h, normed = add_norm(x, residual, norm_weight, eps)
    return h, [torch.nn.functional.linear(normed, w) for w in weights]


def _launch(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
            weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract, at most ``MAX_ROWS`` rows."""
    M, K = x.shape
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    outs = [torch.empty(M, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    if M == 0:
        return h, outs
    if K == 0:  # no column: h is empty and every output row is 0 (an empty sum)
        return h, [o.zero_() for o in outs]
    x = last_dim_contiguous(x)
    r = last_dim_contiguous(residual) if residual is not None else x  # never read without a residual
    g = norm_weight.contiguous()
    w1, w2, y1, y2, n2 = weight_pair(weights, outs)
    tiles1, grid = pipe_grid(w1.shape[0], n2, M)
    wrap_triton(_skinny_linear_pipe_kernel)[grid](
        x, w1, w2, y1, y2, M, w1.shape[0], n2, K, tiles1, x.stride(0), w1.stride(0), w2.stride(0), y1.stride(0),
        y2.stride(0), r, g, h, r.stride(0), h.stride(0), float(eps), BLOCK_N=PIPE["n"], BLOCK_K=PIPE["k"],
        STAGES=PIPE["stages"], NORM=True, HAS_RES=residual is not None, num_warps=PIPE["warps"],
        **launch_kwargs(x.device),
    )
    return h, outs


@torch.library.custom_op("mla::skinny_norm_linear_triton", mutates_args=())
def skinny_norm_linear_triton(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                              weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Triton ``mla::skinny_norm_linear`` (contract of the ``_ref`` op): the GEMV kernel up to ``MAX_ROWS`` rows of x,
    the add + norm kernel and ``F.linear`` above; non-CUDA tensors or float32/float64 run the reference."""
    validate(x, residual, norm_weight, eps, weights)
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return reference(x, residual, norm_weight, eps, weights)
    if x.shape[0] > MAX_ROWS:
        return _many_rows(x, residual, norm_weight, eps, weights)
    return _launch(x, residual, norm_weight, eps, weights)


skinny_norm_linear_triton.register_fake(fake)
