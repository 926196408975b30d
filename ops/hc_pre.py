"""``mla::hc_pre``: DeepSeek-V4's manifold-constrained hyper-connection before a block, in one op: the mixing
weights of the streams and their collapse.

Contract. ``x [T, n, D]`` (bf16 / fp16 / float32; float64 allowed: the reference then runs in float64) holds each
token's ``n`` residual streams; ``fn [2n + n*n, n*D]``, ``base [2n + n*n]`` and ``scale [3]`` are HF
``DeepseekV4HyperConnection``'s parameters (any float dtype). With ``flat = x.reshape(T, n*D)`` in float32, unweighted
RMS-normalised (``norm_eps``), ``mixes = flat @ fn.T`` splits into ``pre_w [n]``, ``post_w [n]`` and ``comb_w [n, n]``:
``pre = sigmoid(pre_w * scale[0] + base[:n]) + hc_eps``, ``post = 2 * sigmoid(post_w * scale[1] + base[n:2n])``,
``comb = hc_sinkhorn(comb_w * scale[2] + base[2n:], iters, hc_eps)`` (``mla::hc_sinkhorn``) and ``collapsed =
sum_i pre_i * x[:, i]`` (float32 sums, x's dtype). Returns ``(post [T, n] float32, comb [T, n, n] float32, collapsed
[T, D])`` (float64 for float64 x), contiguous. ``iters >= 1``.

Backends: "reference" (plain torch, any device: :func:`hc_pre_math`, the numerical ground truth), "triton" (CUDA: a
split-K pass over ``fn`` for up to ``MAX_TOKENS`` tokens, then one kernel for the norm, the weights, the Sinkhorn
rounds and the collapse; more tokens (a prefill chunk) the reference's math, whose GEMM suits them, with the Sinkhorn
rounds through ``mla::hc_sinkhorn``'s kernel). "auto" takes "triton" on CUDA.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.hc_sinkhorn import sinkhorn_math
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("hc_pre", "mla.hc_pre")
MAX_TOKENS = 256  # the Triton backend's split-K pass reads fn once a token (from L2): past this, a GEMM
MAX_N = 8  # the most streams the Triton kernels take (V4 has 4)


def validate(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int) -> None:
    """Shape/dtype/argument checks (metadata only, no sync)."""
    check_tensor(OP, "x", x, ndim=3, dtypes=FLOATS, expected="[T, n, D] streams")
    T, n, D = x.shape
    M = 2 * n + n * n
    check_tensor(OP, "fn", fn, ndim=2, dtypes=FLOATS, shape=(M, n * D), expected=f"[{M}, {n * D}] (2n + n*n, n*D)")
    check_tensor(OP, "base", base, ndim=1, dtypes=FLOATS, shape=(M,), expected=f"[{M}]")
    check_tensor(OP, "scale", scale, ndim=1, dtypes=FLOATS, shape=(3,), expected="[3] (pre, post, comb)")
    if iters < 1:
        raise ValueError(f"{OP}: iters must be >= 1 (Sinkhorn rounds), got {iters}")


def hc_pre_math(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, norm_eps: float, hc_eps: float,
                sinkhorn: Callable[[Tensor, int, float], Tensor] = sinkhorn_math) -> tuple[Tensor, Tensor, Tensor]:
    """The contract in plain torch (traceable; static shapes), float32 math (float64 for float64 x). ``sinkhorn``:
    what normalises the mixing logits (the model passes ``ops.hc_sinkhorn``, the op's kernel on the GPU)."""
    T, n, _ = x.shape
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = x.reshape(T, -1).to(wide)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.to(wide))
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.to(wide).split([n, n, n * n])
    s_pre, s_post, s_comb = scale.to(wide).unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = sinkhorn(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


@torch.library.custom_op("mla::hc_pre_ref", mutates_args=(), tags=LAYOUT_TAGS)
def hc_pre_ref(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, norm_eps: float,
               hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Reference (plain torch, any device): :func:`hc_pre_math`."""
    validate(x, fn, base, scale, iters)
    return tuple(t.contiguous() for t in hc_pre_math(x, fn, base, scale, iters, norm_eps, hc_eps))


def fake(x, fn, base, scale, iters, norm_eps, hc_eps):
    """Fake outputs shared by every implementation: validate, then ``post [T, n]``, ``comb [T, n, n]`` (float32,
    float64 for float64 x) and ``collapsed [T, D]`` of x's dtype."""
    validate(x, fn, base, scale, iters)
    T, n, D = x.shape
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(T, n, dtype=wide), x.new_empty(T, n, n, dtype=wide), x.new_empty(T, D)


hc_pre_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.hc_pre_ref, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        note="plain torch, the numerical ground truth")


def hc_pre(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, norm_eps: float, hc_eps: float, *,
           backend: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """mHC before a block: ``(post [T, n], comb [T, n, n], collapsed [T, D])`` of the streams ``x [T, n, D]``; see the
    module docstring. ``backend``: None/"auto", "reference" or "triton"."""
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    return impl.fn(x, fn, base, scale, int(iters), float(norm_eps), float(hc_eps))


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, norm_eps: float,
            hc_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    import mla_compile.ops.triton.hc_pre  # noqa: F401  (registers mla::hc_pre_triton)
    return torch.ops.mla.hc_pre_triton(x, fn, base, scale, iters, norm_eps, hc_eps)


declare(OP, "triton", _triton, rank=50, available=_triton_available,
        dtypes=(torch.bfloat16, torch.float16, torch.float32), package="triton", gpu_tested=True,
        kernels=("hc_pre_triton", "_hc_mix_kernel", "_hc_finish_kernel"),
        note=f"ours: a split-K pass over fn, then norm, weights, Sinkhorn and collapse in one kernel (<= {MAX_TOKENS} "
             "tokens; more: the reference's math with hc_sinkhorn's kernel)")
