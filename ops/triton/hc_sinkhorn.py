"""Triton ``mla::hc_sinkhorn``: every Sinkhorn round of ``BLOCK_T`` tokens' mixing matrices in one kernel.

A program is one warp over ``BLOCK_T`` (32) tokens, a token's ``[n, n]`` logits a thread's (the ``[BLOCK_T, NP, NP]``
block's layout puts the 32 lanes on the tokens and both matrix dims in registers: ``NP`` the power of two at or above
``n``; the padding holds 0 after the softmax, so it adds nothing to any sum). It takes the row softmax plus ``eps`` and
runs the column and row normalisations, ``iters`` rounds, before one store: every sum is within a thread, no shuffle,
shared memory or barrier (with the rows across warps each round's column sums go through shared memory and a
barrier). torch.compile lowers the same math to two small kernels a round (each reads the whole
previous matrix), so a 20-round mHC costs about 40 launches; here it is one.
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
def sinkhorn_rounds(z, ok, ITERS, eps, ROW: tl.constexpr, COL: tl.constexpr):
    """The Sinkhorn normalisation of logits ``z`` (-inf outside ``ok``) whose matrices' rows run along axis ``ROW``
    and columns along ``COL``: a softmax along each row plus ``eps``, a column normalisation, then ``ITERS - 1``
    rounds of row and column normalisation (each sum plus ``eps``); 0 outside ``ok``. Shared by this op's kernel
    and ``mla::hc_pre``'s finishing kernel."""
    m = tl.max(z, axis=ROW)
    m = tl.where(m == float("-inf"), 0.0, m)  # rows of padding only: exp(-inf) = 0, no NaN
    e = tl.exp(z - tl.expand_dims(m, ROW))
    c = tl.where(ok, e / tl.expand_dims(tl.sum(e, axis=ROW), ROW) + eps, 0.0)
    c = c / (tl.expand_dims(tl.sum(c, axis=COL), COL) + eps)
    for _ in range(ITERS - 1):
        c = c / (tl.expand_dims(tl.sum(c, axis=ROW), ROW) + eps)
        c = c / (tl.expand_dims(tl.sum(c, axis=COL), COL) + eps)
    return c


@triton.jit
def _hc_sinkhorn_kernel(x_ptr, out_ptr, T, ITERS, eps, s_x, s_o, N: tl.constexpr, NP: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    eps = tl.full([], eps, tl.float32)  # Inductor passes Python floats as fp64: every round would run in fp64
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, NP)
    ok = (t < T)[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
    cell = i[None, :, None] * N + i[None, None, :]
    t64 = t.to(tl.int64)[:, None, None]
    z = tl.load(x_ptr + t64 * s_x + cell, mask=ok, other=float("-inf"))
    c = sinkhorn_rounds(z, ok, ITERS, eps, 2, 1)
    tl.store(out_ptr + t64 * s_o + cell, c, mask=ok)


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
        x, out, T, iters, float(eps), x.stride(0), out.stride(0), N=n, NP=triton.next_power_of_2(n), BLOCK_T=BLOCK_T,
        num_warps=1,
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
