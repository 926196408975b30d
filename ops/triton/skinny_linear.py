"""Triton ``mla::skinny_linear``: a GEMV over the weights' rows for up to ``MAX_ROWS`` rows of x.

Grid (row tiles of all weights, row blocks of x): a program takes ``BLOCK_N`` (4) rows of one weight (the first
weight's tiles, then the second's: base pointer, stride and output selected with ``tl.where``, no branch) and
``M_BLOCK`` rows of x, loads the weight tile over the whole of K in one step where K allows (``BLOCK_K`` up to
``MAX_BLOCK_K``: the most bytes in flight, as the fused MoE kernels' measured best), and writes each row's
``BLOCK_N`` outputs from float32 sums. Rows of x past ``M_BLOCK`` go to another program, which reads the same
weight rows again (from L2 for a few rows). Where the weights hold at least ``PIPE["min_bytes"]`` or K is past
``MAX_BLOCK_K``, the pipelined form takes over: 16 weight rows and two rows of x a program, K in 256-wide steps
whose loads ``tl.range`` pipelines, many programs an SM (a plain streaming read's speed). On sm_90 either is
launched with PDL (``_pdl.py``): the first weight tile is requested before the kernel waits for the one before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.skinny_linear import MAX_ROWS, fake, validate
from mla_compile.ops.triton._common import last_dim_contiguous
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait

BLOCK_N = 4
MAX_BLOCK_K = 2048
M_BLOCK = 2  # rows of x a program (more rows: more programs over the same weight rows)
# The pipelined form (``_skinny_linear_pipe_kernel``) for weights of at least ``min_bytes`` in all or K past
# ``MAX_BLOCK_K``: ``n`` x ``k`` tiles, ``stages`` deep, ``warps`` warps (a plain streaming read's speed where there are
# enough bytes; below, the one-step form's whole-K tiles in flight at once are faster). Timings: BENCHMARKS.md.
PIPE = dict(min_bytes=12 << 20, n=16, k=256, stages=4, warps=4)


@triton.jit
def _weight_tile(w1_ptr, w2_ptr, y1_ptr, y2_ptr, N1, N2, TILES1, s_w1, s_w2, s_y1, s_y2, BLOCK_N: tl.constexpr):
    """The program's ``BLOCK_N`` weight rows: the first weight's tiles, then the second's (base pointer, stride and
    output selected with ``tl.where``, no branch). Returns ``(n, n_ok, w_rows, y_base, y_stride)``: the rows'
    indices in their weight, which are real, their row pointers, and the output's base and row stride."""
    tile = tl.program_id(0)
    first = tile < TILES1
    n = tl.where(first, tile, tile - TILES1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < tl.where(first, N1, N2)
    w_rows = tl.where(first, w1_ptr, w2_ptr) + n.to(tl.int64) * tl.where(first, s_w1, s_w2).to(tl.int64)
    return n, n_ok, w_rows, tl.where(first, y1_ptr, y2_ptr), tl.where(first, s_y1, s_y2).to(tl.int64)


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w1_ptr, w2_ptr, y1_ptr, y2_ptr,
    M, N1, N2, K, TILES1,
    s_x, s_w1, s_w2, s_y1, s_y2,
    M_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    n, n_ok, w_rows, y_base, y_stride = _weight_tile(w1_ptr, w2_ptr, y1_ptr, y2_ptr, N1, N2, TILES1, s_w1, s_w2, s_y1,
                                                      s_y2, BLOCK_N)
    m0 = tl.program_id(1) * M_BLOCK
    rows = tl.arange(0, M_BLOCK)
    acc = tl.zeros([M_BLOCK, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        pdl_wait(PDL)  # the weight tile is in flight before x, the previous kernel's output, is read
        pdl_launch_dependents(PDL)
        for i in tl.static_range(M_BLOCK):
            m = m0 + i
            xr = tl.load(x_ptr + m.to(tl.int64) * s_x + k, mask=k_ok & (m < M), other=0.0).to(tl.float32)
            part = tl.sum(w * xr[None, :], axis=1)
            acc += tl.where(rows[:, None] == i, part[None, :], 0.0)
    m = m0 + rows
    out = y_base + m[:, None].to(tl.int64) * y_stride + n[None, :]
    tl.store(out, acc.to(y1_ptr.dtype.element_ty), mask=(m < M)[:, None] & n_ok[None, :])


@triton.jit
def hidden_values(x_row, r_row, h_row, k, ok, HAS_RES: tl.constexpr, write):
    """One row's hidden values at ``k`` as float32 (``x + residual`` rounded to x's dtype, as the eager add), stored
    to ``h_row`` when ``write`` (a scalar) holds. Shared by the kernels that fold a residual add and an RMSNorm."""
    x = tl.load(x_row + k, mask=ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_row + k, mask=ok, other=0.0).to(tl.float32)).to(x_row.dtype.element_ty)
    tl.store(h_row + k, x, mask=ok & write)
    return x.to(tl.float32)


@triton.jit
def hf_normed(h, inv, g, ty):
    """HF DeepSeek's RMSNorm rounding of float32 hidden values ``h`` with their row's ``inv = rsqrt(mean + eps)`` and
    the norm's float32 weight ``g``: ``h * inv`` rounded to ``ty``, times ``g``, rounded to ``ty`` (as torch)."""
    return ((h * inv).to(ty).to(tl.float32) * g).to(ty)


@triton.jit
def _pipe_term(w, x_row, r_row, h_row, g, k, ok, write, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """One K step's element-wise products of the weight tile ``w`` with one row of x at ``k``, and (``NORM``) that
    row's squares: without ``NORM`` ``w * x``; with it ``w * (g * h)``, ``h`` = :func:`hidden_values` (stored when
    ``write``) and ``g`` the norm's weight at ``k``. Without ``NORM`` the second value is x, for no use."""
    if NORM:
        a = hidden_values(x_row, r_row, h_row, k, ok, HAS_RES, write)
        return w * (a * g)[None, :], a * a
    else:
        a = tl.load(x_row + k, mask=ok, other=0.0).to(tl.float32)
        return w * a[None, :], a


@triton.jit
def _skinny_linear_pipe_kernel(
    x_ptr, w1_ptr, w2_ptr, y1_ptr, y2_ptr,
    M, N1, N2, K, TILES1,
    s_x, s_w1, s_w2, s_y1, s_y2,
    r_ptr, g_ptr, h_ptr, s_r, s_h, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr,
):
    """The pipelined form for two rows of x a program: ``BLOCK_N`` weight rows over K in ``BLOCK_K`` steps,
    element-wise float32 products summed along K once at the end; the first step's weight tile is requested before
    the PDL wait, the rest through ``tl.range``'s stages after it.

    ``NORM`` (``mla::skinny_norm_linear``): the rows are ``h = x + residual`` (``HAS_RES``; rounded to x's dtype, the
    first weight tile's programs store them to ``h_ptr``) times the norm's weight ``g_ptr`` (requested before the
    wait too), their squares summed along K, and the dots scaled by ``rsqrt(sum / K + eps)`` at the end: the norm of
    the whole row, which every program reads anyway. Without ``NORM`` those arguments are not read."""
    n, n_ok, w_rows, y_base, y_stride = _weight_tile(w1_ptr, w2_ptr, y1_ptr, y2_ptr, N1, N2, TILES1, s_w1, s_w2, s_y1,
                                                      s_y2, BLOCK_N)
    m0 = tl.program_id(1) * 2
    has1 = m0 + 1 < M
    writes = tl.program_id(0) == 0  # NORM: the first weight tile's programs store h
    x0_row = x_ptr + m0.to(tl.int64) * s_x
    x1_row = x0_row + s_x
    r0, h0 = r_ptr + m0.to(tl.int64) * s_r, h_ptr + m0.to(tl.int64) * s_h
    r1, h1 = r0 + s_r, h0 + s_h
    k = tl.arange(0, BLOCK_K)
    k_ok = k < K
    w = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32) if NORM else 0.0
    pdl_wait(PDL)  # the first weight tile is in flight before x, the previous kernel's output, is read
    pdl_launch_dependents(PDL)
    acc0, ss0 = _pipe_term(w, x0_row, r0, h0, g, k, k_ok, writes, NORM, HAS_RES)
    acc1, ss1 = _pipe_term(w, x1_row, r1, h1, g, k, k_ok & has1, writes, NORM, HAS_RES)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if NORM:
            g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        t0, q0 = _pipe_term(w, x0_row, r0, h0, g, k, k_ok, writes, NORM, HAS_RES)
        acc0 += t0
        t1, q1 = _pipe_term(w, x1_row, r1, h1, g, k, k_ok & has1, writes, NORM, HAS_RES)
        acc1 += t1
        if NORM:
            ss0 += q0
            ss1 += q1
    out = y_base + m0.to(tl.int64) * y_stride + n
    y = tl.sum(acc0, axis=1)
    if NORM:
        y = y * tl.math.rsqrt(tl.sum(ss0, axis=0) / K + eps)
    tl.store(out, y.to(y1_ptr.dtype.element_ty), mask=n_ok)
    ok, out = n_ok & has1, out + y_stride
    y = tl.sum(acc1, axis=1)
    if NORM:
        y = y * tl.math.rsqrt(tl.sum(ss1, axis=0) / K + eps)
    tl.store(out, y.to(y1_ptr.dtype.element_ty), mask=ok)


def weight_pair(weights: list[Tensor], outs: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """``_weight_tile``'s operands for one or two weights and their outputs: ``(w1, w2, y1, y2, n2)``, the weights
    with contiguous last dims; a single weight stands in as its own second with ``n2 = 0`` (no tile of it)."""
    ws = [last_dim_contiguous(w) for w in weights]
    return ws[0], ws[-1], outs[0], outs[-1], ws[-1].shape[0] if len(ws) == 2 else 0


def pipe_grid(n1: int, n2: int, M: int) -> tuple[int, tuple[int, int]]:
    """``(tiles of the first weight, grid)`` of a pipelined-form launch (``PIPE["n"]`` weight rows, two rows of x a
    program) over weights of ``n1`` and ``n2`` rows and ``M`` rows of x."""
    tiles1 = triton.cdiv(n1, PIPE["n"])
    return tiles1, (tiles1 + triton.cdiv(n2, PIPE["n"]), triton.cdiv(M, 2))


def _launch(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract, at most ``MAX_ROWS`` rows."""
    M, K = x.shape
    outs = [torch.empty(M, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    if M == 0:
        return outs
    x = last_dim_contiguous(x)
    w1, w2, y1, y2, n2 = weight_pair(weights, outs)
    args = (x, w1, w2, y1, y2, M, w1.shape[0], n2, K)
    strides = (x.stride(0), w1.stride(0), w2.stride(0), y1.stride(0), y2.stride(0))
    pdl = launch_kwargs(x.device, K > 0)
    if K > MAX_BLOCK_K or (w1.shape[0] + n2) * K * x.element_size() >= PIPE["min_bytes"]:
        tiles1, grid = pipe_grid(w1.shape[0], n2, M)
        wrap_triton(_skinny_linear_pipe_kernel)[grid](
            *args, tiles1, *strides, x, x, x, 0, 0, 1.0, BLOCK_N=PIPE["n"], BLOCK_K=PIPE["k"], STAGES=PIPE["stages"],
            NORM=False, HAS_RES=False, num_warps=PIPE["warps"], **pdl,
        )
        return outs
    tiles1 = triton.cdiv(w1.shape[0], BLOCK_N)
    grid = (tiles1 + triton.cdiv(n2, BLOCK_N), triton.cdiv(M, M_BLOCK))
    wrap_triton(_skinny_linear_kernel)[grid](
        *args, tiles1, *strides, M_BLOCK=M_BLOCK, BLOCK_N=BLOCK_N,
        BLOCK_K=min(triton.next_power_of_2(K), MAX_BLOCK_K), num_warps=4, **pdl,
    )
    return outs


@torch.library.custom_op("mla::skinny_linear_triton", mutates_args=())
def skinny_linear_triton(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """Triton ``mla::skinny_linear`` (contract of the ``_ref`` op): the GEMV kernel up to ``MAX_ROWS`` rows of x;
    more rows, non-CUDA tensors or float32/float64 run the reference (``F.linear``)."""
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16) or x.shape[0] > MAX_ROWS:
        return torch.ops.mla.skinny_linear_ref(x, weights)
    validate(x, weights)
    return _launch(x, weights)


skinny_linear_triton.register_fake(fake)
