"""``mla::skinny_norm_linear``: a residual add, an RMSNorm and bias-free linears of few rows, in one launch.

Contract. ``x [M, K]``, ``residual [M, K]`` (or None), ``norm_weight [K]``, ``eps`` and ``weights`` (a list of one or
two ``[N_i, K]`` matrices, nn.Linear's layout), all of x's dtype, give ``(h, [y_i])``: ``h = x + residual`` in x's
dtype (a copy of ``x`` without a residual) and ``y_i = norm(h) @ W_i.T`` of x's dtype, where ``norm(h) = norm_weight
* (h * rsqrt(mean(h^2) + eps))`` (HF DeepSeek's RMSNorm: the mean and the scaling in float32). The products are
accumulated in float32 (float64 for float64 x). A decoder layer's first step is this: the previous MLP's residual
add, the input norm and the projections that read the normed hidden state (``q_proj`` or ``q_a_proj``, and
``kv_a_proj_with_mqa``).

Backends: "reference" (torch: the add, the norm and ``F.linear`` per weight, any device), "triton" (ours, CUDA, up
to :data:`MAX_ROWS` rows: ``mla::skinny_linear``'s pipelined GEMV whose programs also add the residual, sum the row's
squares along their K loop and scale their float32 dots once at the end, ``(g * h) . W * rsqrt(mean(h^2) + eps)``, so
the norm costs no launch of its own; more rows: one launch for the add and the norm, then ``F.linear``, inside the
op). Its CUDA tests pass (BENCHMARKS.md run 216), but it is slower than the two launches it replaces at V2-Lite's
dims (run 217; the full step +68 us, run 218) and faster at V3's, so it stays unmarked as GPU-tested: "auto" takes
the reference, and the model takes it only by name (``backend="skinny_norm_linear=triton"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops.skinny_linear import MAX_ROWS, MAX_WEIGHTS

OP = declare_op("skinny_norm_linear", "mla.skinny_norm_linear")


def validate(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weights: list[Tensor]) -> None:
    """Shape/dtype checks (metadata only, no sync)."""
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOATS, expected="[M, K]")
    validate_add_norm(OP, x, residual, norm_weight, eps)
    K = x.shape[1]
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{OP}: weights must be a list of 1 to {MAX_WEIGHTS} matrices [N_i, K], got {len(weights)}")
    for i, w in enumerate(weights):
        check_tensor(OP, f"weights[{i}]", w, ndim=2, dtypes=(x.dtype,), shape=(None, K),
                     expected=f"[N, {K}] of x's dtype {x.dtype}")
    for name, t in (("residual", residual), ("norm_weight", norm_weight), *((f"weights[{i}]", w)
                                                                          for i, w in enumerate(weights))):
        if t is not None and t.device != x.device:
            raise ValueError(f"{OP}: {name} is on {t.device}, x on {x.device}")


def validate_add_norm(op: str, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float) -> None:
    """``op``'s checks of a residual add and RMSNorm of the 2-D ``x``: ``residual`` (None, or x's shape and dtype),
    ``norm_weight [K]`` of x's dtype, a positive ``eps`` (metadata only, no sync)."""
    M, K = x.shape
    if residual is not None:
        check_tensor(op, "residual", residual, ndim=2, dtypes=(x.dtype,), shape=(M, K),
                     expected=f"[{M}, {K}] of x's dtype {x.dtype}")
    check_tensor(op, "norm_weight", norm_weight, ndim=1, dtypes=(x.dtype,), shape=(K,),
                 expected=f"[{K}] of x's dtype {x.dtype}")
    if not eps > 0:
        raise ValueError(f"{op}: eps must be positive, got {eps}")


def rms_norm(h: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """HF DeepSeek's RMSNorm of ``h [..., K]``: the mean of squares and the scaling in float32 (float64 for float64
    ``h``), the scaled row rounded to h's dtype, then times ``norm_weight [K]``."""
    hf = h.float() if h.dtype != torch.float64 else h
    return norm_weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def reference(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
              weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """The contract in plain torch (no validation): the add, HF's RMSNorm (:func:`rms_norm`), ``F.linear`` per
    weight."""
    h = x + residual if residual is not None else x.clone()
    normed = rms_norm(h, norm_weight, eps)
    return h, [F.linear(normed, w) for w in weights]


@torch.library.custom_op("mla::skinny_norm_linear_ref", mutates_args=(), tags=LAYOUT_TAGS)
def skinny_norm_linear_ref(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                           weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Reference (plain torch, any device): :func:`reference`."""
    validate(x, residual, norm_weight, eps, weights)
    return reference(x, residual, norm_weight, eps, weights)


def fake(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
         weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Fake outputs shared by every implementation: validate, then ``h [M, K]`` and ``[M, N_i]`` of x's dtype."""
    validate(x, residual, norm_weight, eps, weights)
    return torch.empty_like(x), [x.new_empty(x.shape[0], w.shape[0]) for w in weights]


skinny_norm_linear_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.skinny_norm_linear_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="the add, RMSNorm and F.linear per weight in torch")


def skinny_norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weights: list[Tensor],
                       backend: str | None = None) -> tuple[Tensor, list[Tensor]]:
    """``(x + residual, [norm(x + residual) @ W.T for W in weights])``; see the module docstring. ``backend``:
    None/"auto", "reference" or "triton"."""
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    return impl.fn(x, residual, norm_weight, float(eps), list(weights))


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
            weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    import mla_compile.ops.triton.skinny_norm_linear  # noqa: F401  (registers mla::skinny_norm_linear_triton)
    return torch.ops.mla.skinny_norm_linear_triton(x, residual, norm_weight, eps, weights)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=(torch.bfloat16, torch.float16),
        package="triton", gpu_tested=False,
        kernels=("skinny_norm_linear_triton", "_add_norm_kernel"),
        note=f"ours: skinny_linear's pipelined GEMV with the add and the norm in its K loop, up to {MAX_ROWS} rows")
