"""Triton ``mla::hc_sinkhorn``: every Sinkhorn round of ``BLOCK_T`` tokens' mixing matrices in one kernel.

A program is one warp over ``BLOCK_T`` (32) tokens, one a lane: a token's ``n * n`` logits are ``n * n`` values of
that lane (:func:`sinkhorn_cells` takes them as a tuple of cells, one ``[BLOCK_T]`` tensor each). It takes the row
softmax plus ``eps`` and runs the column and row normalisations, ``iters`` rounds, before one store: every sum is
within a thread, no shuffle, shared memory or barrier. torch.compile lowers the same math to two small kernels a
round (each reads the whole previous matrix), so a 20-round mHC costs about 40 launches; here it is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.hc_sinkhorn import MAX_N, OP, fake, validate

BLOCK_T = 32  # tokens a program: one a lane of its one warp


@triton.jit
def _divide_rows(c, N: tl.constexpr, eps):
    """The cells ``c`` (a tuple of ``N * N``, row-major) divided by their row's sum plus ``eps`` (one reciprocal a
    row, then products)."""
    out = ()
    for i in tl.static_range(N):
        s = c[i * N]
        for j in tl.static_range(1, N):
            s = s + c[i * N + j]
        r = 1.0 / (s + eps)
        for j in tl.static_range(N):
            out = out + (c[i * N + j] * r,)
    return out


@triton.jit
def _divide_columns(c, N: tl.constexpr, eps):
    """The cells ``c`` (a tuple of ``N * N``, row-major) divided by their column's sum plus ``eps`` (one reciprocal a
    column, then products)."""
    r = ()
    for j in tl.static_range(N):
        s = c[j]
        for i in tl.static_range(1, N):
            s = s + c[i * N + j]
        r = r + (1.0 / (s + eps),)
    out = ()
    for k in tl.static_range(N * N):
        out = out + (c[k] * r[k % N],)
    return out


@triton.jit
def sinkhorn_cells(z, N: tl.constexpr, ITERS, eps):
    """The Sinkhorn normalisation of ``N x N`` logits ``z``, a tuple of ``N * N`` cells (row-major), each a tensor of
    one shape (e.g. one value a token, or a scalar): a softmax along each row plus ``eps``, a column normalisation,
    then ``ITERS - 1`` rounds of row and column normalisation (each sum plus ``eps``); the cells in the same order.
    Element-wise across the cells' shape, so every sum stays within a thread (no shuffle, shared memory or
    barrier). Shared by this op's kernel and ``mla::hc_pre``'s finishing kernel."""
    e = ()
    for i in tl.static_range(N):
        m = z[i * N]
        for j in tl.static_range(1, N):
            m = tl.maximum(m, z[i * N + j])
        for j in tl.static_range(N):
            e = e + (tl.exp(z[i * N + j] - m),)
    e = _divide_rows(e, N, 0.0)
    c = ()
    for k in tl.static_range(N * N):
        c = c + (e[k] + eps,)
    c = _divide_columns(c, N, eps)
    for _ in range(ITERS - 1):
        c = _divide_columns(_divide_rows(c, N, eps), N, eps)
    return c


@triton.jit
def _hc_sinkhorn_kernel(x_ptr, out_ptr, T, ITERS, eps, s_x, s_o, N: tl.constexpr, BLOCK_T: tl.constexpr):
    eps = tl.full([], eps, tl.float32)  # Inductor passes Python floats as fp64: every round would run in fp64
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    t64 = t.to(tl.int64)
    z = ()
    for k in tl.static_range(N * N):
        z = z + (tl.load(x_ptr + t64 * s_x + k, mask=ok, other=0.0).to(tl.float32),)
    c = sinkhorn_cells(z, N, ITERS, eps)
    for k in tl.static_range(N * N):
        tl.store(out_ptr + t64 * s_o + k, c[k], mask=ok)


def _launch(logits: Tensor, iters: int, eps: float) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract."""
    T, n, _ = logits.shape
    if n > MAX_N:
        raise ValueError(f"{OP}: backend 'triton' takes matrices of at most {MAX_N} x {MAX_N}, got {n} x {n}; "
                         "use backend 'reference'")
    out = torch.empty(T, n, n, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return out
    x = logits.contiguous()
    wrap_triton(_hc_sinkhorn_kernel)[(triton.cdiv(T, BLOCK_T),)](
        x, out, T, iters, float(eps), x.stride(0), out.stride(0), N=n, BLOCK_T=BLOCK_T, num_warps=1,
    )
    return out


@torch.library.custom_op("mla::hc_sinkhorn_triton", mutates_args=())
def hc_sinkhorn_triton(logits: Tensor, iters: int, eps: float) -> Tensor:
    """Triton ``mla::hc_sinkhorn`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference. An opaque
    custom op: compiled graphs call this launch as is, the form GPU-timed in the model (the kernel casts ``eps`` to
    fp32 anyway: Inductor's own launch of a ``triton_op``'s kernel passes Python floats as fp64)."""
    if logits.device.type != "cuda" or logits.dtype == torch.float64:
        return torch.ops.mla.hc_sinkhorn_ref(logits, iters, eps)
    validate(logits, iters, eps)
    return _launch(logits, iters, eps)


hc_sinkhorn_triton.register_fake(fake)
