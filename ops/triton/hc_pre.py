"""Triton ``mla::hc_pre``: a V4 hyper-connection before its block in two launches, for few tokens (more: the
reference's math with ``mla::hc_sinkhorn``'s kernel, see :func:`hc_pre_triton`).

``_hc_mix_kernel``, grid ``(splits, T)``: program ``(s, t)`` reads ``BLOCK_K`` of token t's ``n*D`` stream values and
the same columns of all ``2n + n*n`` rows of ``fn`` (in fn's dtype, converted in registers: no float32 copy of fn),
and stores the partial dots and the partial sum of squares (the RMS norm folds in afterwards: it scales a token's
whole row, so ``rms(x) @ fn.T = (x @ fn.T) * rsqrt(mean(x^2) + eps)``).

``_hc_finish_kernel``, grid ``(T, D blocks)``, one warp: program ``(t, d)`` sums token t's partials, scales them by the
norm, forms ``pre``, ``post`` and the ``n x n`` mixing logits (one-hot sums over the mixes: no register gather; the
logits as ``n * n`` scalars, so every Sinkhorn round runs within each thread, no shuffle), and collapses ``BLOCK_D``
columns of the streams with ``pre``; block 0 also stores ``post`` and ``comb``. Each program repeats the small work of
its token: no third launch. Python floats arrive as fp64 from Inductor's launches; the kernels cast them to fp32 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.hc_pre import MAX_N, MAX_TOKENS, OP, fake, hc_pre_math, validate
from mla_compile.ops.hc_sinkhorn import hc_sinkhorn
from mla_compile.ops.triton.hc_sinkhorn import sinkhorn_cells

BLOCK_K = 512  # stream values a split-K program reads (fn: (2n + n*n) x BLOCK_K)
BLOCK_D = 512  # columns of the collapse a finishing program writes


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, K, M, SPLITS, s_x, s_fn,
                   MP: tl.constexpr, BLOCK_K: tl.constexpr):
    s = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    k = s * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    m = tl.arange(0, MP)
    xv = tl.load(x_ptr + t * s_x + k, mask=k_ok, other=0.0).to(tl.float32)
    w = tl.load(fn_ptr + m[:, None].to(tl.int64) * s_fn + k[None, :], mask=(m < M)[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    tl.store(part_ptr + (t * SPLITS + s) * MP + m, tl.sum(w * xv[None, :], axis=1))
    tl.store(sq_ptr + t * SPLITS + s, tl.sum(xv * xv, axis=0))


@triton.jit
def _hc_finish_kernel(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
                      D, SPLITS, ITERS, norm_eps, hc_eps, s_x, s_out,
                      N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr, BLOCK_D: tl.constexpr):
    norm_eps = tl.full([], norm_eps, tl.float32)  # Inductor passes Python floats as fp64
    hc_eps = tl.full([], hc_eps, tl.float32)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    M = 2 * N + N * N
    m = tl.arange(0, MP)
    sp = tl.arange(0, SP)
    part = tl.load(part_ptr + (t * SPLITS + sp[:, None]) * MP + m[None, :], mask=(sp < SPLITS)[:, None], other=0.0)
    sq = tl.sum(tl.load(sq_ptr + t * SPLITS + sp, mask=sp < SPLITS, other=0.0), axis=0)
    r = tl.math.rsqrt(sq / (N * D) + norm_eps)
    # each mix's scale (pre, post, comb) and bias
    sc = tl.load(scale_ptr + tl.where(m < N, 0, tl.where(m < 2 * N, 1, 2))).to(tl.float32)
    z = tl.sum(part, axis=0) * r * sc + tl.load(base_ptr + m, mask=m < M, other=0.0).to(tl.float32)
    i = tl.arange(0, NP)
    # pre [NP] from z by one-hot sums (no gather from registers)
    pre = tl.sum(tl.where(i[:, None] == m[None, :], z[None, :], 0.0), axis=1)
    pre = 1.0 / (1.0 + tl.exp(-pre)) + hc_eps
    zc = ()  # the mixing logits as N * N scalars, row-major: every Sinkhorn sum within a thread
    for k in tl.static_range(N * N):
        zc = zc + (tl.sum(tl.where(m == 2 * N + k, z, 0.0), axis=0),)
    c = sinkhorn_cells(zc, N, ITERS, hc_eps)
    if blk == 0:
        post = 2.0 / (1.0 + tl.exp(-z))
        tl.store(post_ptr + t * N + (m - N), post, mask=(m >= N) & (m < 2 * N))
        for k in tl.static_range(N * N):
            tl.store(comb_ptr + t * N * N + k, c[k])
    d = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    xs = tl.load(x_ptr + t * s_x + i[:, None] * D + d[None, :], mask=(i < N)[:, None] & d_ok[None, :],
                 other=0.0).to(tl.float32)
    col = tl.sum(tl.where((i < N)[:, None], pre[:, None] * xs, 0.0), axis=0)
    tl.store(out_ptr + t * s_out + d, col.to(out_ptr.dtype.element_ty), mask=d_ok)


def _launch(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, norm_eps: float,
            hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract, at most ``MAX_TOKENS`` tokens
    and ``MAX_N`` streams."""
    T, n, D = x.shape
    if n > MAX_N:
        raise ValueError(f"{OP}: backend 'triton' takes at most {MAX_N} streams, got {n}; use backend 'reference'")
    post = torch.empty(T, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=x.device)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return post, comb, out
    x = x.contiguous()
    fn = fn if fn.stride(-1) == 1 else fn.contiguous()
    K, M = n * D, 2 * n + n * n
    mp = triton.next_power_of_2(M)
    splits = triton.cdiv(K, BLOCK_K)
    part = torch.empty(T, splits, mp, dtype=torch.float32, device=x.device)
    sq = torch.empty(T, splits, dtype=torch.float32, device=x.device)
    wrap_triton(_hc_mix_kernel)[(splits, T)](
        x, fn, part, sq, K, M, splits, x.stride(0), fn.stride(0), MP=mp, BLOCK_K=BLOCK_K, num_warps=4,
    )
    wrap_triton(_hc_finish_kernel)[(T, triton.cdiv(D, BLOCK_D))](
        x, part, sq, base.contiguous(), scale.contiguous(), post, comb, out, D, splits, iters, float(norm_eps),
        float(hc_eps), x.stride(0), out.stride(0), N=n, NP=triton.next_power_of_2(n), MP=mp,
        SP=triton.next_power_of_2(splits), BLOCK_D=BLOCK_D, num_warps=1,
    )
    return post, comb, out


@torch.library.custom_op("mla::hc_pre_triton", mutates_args=())
def hc_pre_triton(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, norm_eps: float,
                  hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Triton ``mla::hc_pre`` (contract of the ``_ref`` op): the two kernels up to ``MAX_TOKENS`` tokens and
    ``MAX_N`` streams on CUDA; more tokens (a prefill chunk) the reference's math with its GEMM and the Sinkhorn
    rounds through ``mla::hc_sinkhorn`` (one kernel); non-CUDA tensors, float64 or more streams the reference."""
    if x.device.type != "cuda" or x.dtype == torch.float64 or x.shape[1] > MAX_N:
        return torch.ops.mla.hc_pre_ref(x, fn, base, scale, iters, norm_eps, hc_eps)
    if x.shape[0] > MAX_TOKENS:
        out = hc_pre_math(x, fn, base, scale, iters, norm_eps, hc_eps, sinkhorn=hc_sinkhorn)
        return tuple(t.contiguous() for t in out)
    validate(x, fn, base, scale, iters)
    return _launch(x, fn, base, scale, iters, norm_eps, hc_eps)


hc_pre_triton.register_fake(fake)
