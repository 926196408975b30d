"""``mla::hc_sinkhorn``: the doubly stochastic mixing matrices of DeepSeek-V4's manifold-constrained hyper-connections.

Contract. ``logits [T, n, n]`` float32 (float64 allowed: the reference then runs in float64) are each token's
``n x n`` mixing logits (mHC's ``comb`` part of the hyper-connection's projection, scaled and biased). Each token's
matrix is ``softmax(logits, dim=-1) + eps``, its columns divided by their sums (``+ eps``), then ``iters - 1`` more
Sinkhorn rounds, each dividing the rows by their sums and then the columns by theirs (``+ eps`` every time): HF
``DeepseekV4HyperConnection``'s normalisation. Returns ``[T, n, n]`` contiguous, logits' dtype. ``iters >= 1``,
``eps >= 0``.

Backends: "reference" (plain torch, any device: :func:`sinkhorn_math`, the numerical ground truth), "triton" (CUDA:
every round of a block of tokens in one kernel, the matrices in registers; where torch.compile would launch two
small kernels a round).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.registry import LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("hc_sinkhorn", "mla.hc_sinkhorn")
MAX_N = 8  # the widest matrix the Triton kernel holds in one thread's registers (V4 has 4 streams)


def validate(logits: Tensor, iters: int, eps: float) -> None:
    """Shape/dtype/argument checks (metadata only, no sync)."""
    check_tensor(OP, "logits", logits, ndim=3, dtypes=(torch.float32, torch.float64),
                 expected="[T, n, n] float32 mixing logits")
    if logits.shape[1] != logits.shape[2] or logits.shape[1] < 1:
        raise ValueError(f"{OP}: logits must be [T, n, n] (square matrices, n >= 1), got {list(logits.shape)}")
    if iters < 1:
        raise ValueError(f"{OP}: iters must be >= 1 (Sinkhorn rounds), got {iters}")
    if not eps >= 0.0:
        raise ValueError(f"{OP}: eps must be >= 0, got {eps}")


def sinkhorn_math(logits: Tensor, iters: int, eps: float) -> Tensor:
    """The contract in plain torch (traceable; static shapes)."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


@torch.library.custom_op("mla::hc_sinkhorn_ref", mutates_args=(), tags=LAYOUT_TAGS)
def hc_sinkhorn_ref(logits: Tensor, iters: int, eps: float) -> Tensor:
    """Reference (plain torch, any device): :func:`sinkhorn_math`."""
    validate(logits, iters, eps)
    return sinkhorn_math(logits, iters, eps).contiguous()


def fake(logits, iters, eps):
    """Fake output shared by every implementation: validate, then ``[T, n, n]`` of logits' dtype."""
    validate(logits, iters, eps)
    return logits.new_empty(logits.shape)


hc_sinkhorn_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.hc_sinkhorn_ref, rank=100, devices=("any",),
        dtypes=(torch.float32, torch.float64), gpu_tested=True, note="plain torch, the numerical ground truth")


def hc_sinkhorn(logits: Tensor, iters: int, eps: float, *, backend: str | None = None) -> Tensor:
    """mHC's Sinkhorn-normalised mixing matrices of ``logits [T, n, n]`` float32 -> ``[T, n, n]``; see the module
    docstring. ``backend``: None/"auto", "reference" or "triton"."""
    impl = resolve(OP, logits.device, backend, dtype=logits.dtype)
    return impl.fn(logits, int(iters), float(eps))


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(logits: Tensor, iters: int, eps: float) -> Tensor:
    import mla_compile.ops.triton.hc_sinkhorn  # noqa: F401  (registers mla::hc_sinkhorn_triton)
    return torch.ops.mla.hc_sinkhorn_triton(logits, iters, eps)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=(torch.float32,), package="triton",
        gpu_tested=True, kernels=("hc_sinkhorn_triton", "_hc_sinkhorn_kernel"),
        note="ours: every Sinkhorn round of a block of tokens in one kernel")
