"""``mla::add_rms_linear``: a residual add, an RMSNorm and the linears that read the normed rows, as one op.

Contract. ``h [M, K]`` and ``residual [M, K]`` (one half-precision or float dtype), ``norm_weight [K]`` of that
dtype, ``eps`` a float, ``weights`` a list of one or two ``[N_i, K]`` matrices of that dtype (nn.Linear's layout)
give ``[s, y_1(, y_2)]``: the sum ``s = h + residual`` rounded to the dtype, and ``y_i = x @ W_i.T`` of the normed
rows ``x = norm_weight * (s * rsqrt(mean(s**2) + eps))``, the norm in float32 (float64 for float64 inputs) with
the rounding of DeepSeek's ``RMSNorm`` (the normed rows rounded to the dtype before the weight's product, that
product rounded again), each ``y_i`` accumulated in float32 and stored in the dtype. It is a decoder layer's
start (the previous layer's MLP residual, the input norm, the attention's first projections) in one launch
where Inductor and ``mla::skinny_linear`` take two.

Backends: "reference" (plain torch, any device), "triton" (ours, CUDA, half precision: up to
:data:`~mla_compile.ops.skinny_linear.MAX_ROWS` rows one GEMV kernel that norms the rows itself (every program
reads the rows, the weight's first tile in flight before its PDL wait); more rows an add + norm kernel and
``F.linear``, so one compiled graph serves every batch size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops.skinny_linear import MAX_ROWS, MAX_WEIGHTS

OP = declare_op("add_rms_linear", "mla.add_rms_linear")


def validate(h: Tensor, residual: Tensor, norm_weight: Tensor, weights: list[Tensor]) -> None:
    """Shape/dtype checks (metadata only, no sync)."""
    check_tensor(OP, "h", h, ndim=2, dtypes=FLOATS, expected="[M, K]")
    M, K = h.shape
    check_tensor(OP, "residual", residual, ndim=2, dtypes=(h.dtype,), shape=(M, K), expected=f"[{M}, {K}] of h's dtype")
    check_tensor(OP, "norm_weight", norm_weight, ndim=1, dtypes=(h.dtype,), shape=(K,), expected=f"[{K}] of h's dtype")
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{OP}: weights must be a list of 1 to {MAX_WEIGHTS} matrices [N_i, K], got {len(weights)}")
    for i, w in enumerate(weights):
        check_tensor(OP, f"weights[{i}]", w, ndim=2, dtypes=(h.dtype,), shape=(None, K),
                     expected=f"[N, {K}] of h's dtype {h.dtype}")
    for name, t in (("residual", residual), ("norm_weight", norm_weight), *((f"weights[{i}]", w)
                                                                            for i, w in enumerate(weights))):
        if t.device != h.device:
            raise ValueError(f"{OP}: {name} is on {t.device}, h on {h.device}")


def add_rms_norm(h: Tensor, residual: Tensor, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(s, x)`` of the contract in plain torch: the rounded sum and the normed rows."""
    s = h + residual
    acc = torch.float64 if s.dtype == torch.float64 else torch.float32
    sf = s.to(acc)
    x = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return s, norm_weight * x


@torch.library.custom_op("mla::add_rms_linear_ref", mutates_args=(), tags=LAYOUT_TAGS)
def add_rms_linear_ref(h: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                       weights: list[Tensor]) -> list[Tensor]:
    """Reference (plain torch, any device)."""
    validate(h, residual, norm_weight, weights)
    s, x = add_rms_norm(h, residual, norm_weight, eps)
    return [s] + [F.linear(x, w) for w in weights]


def fake(h: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weights: list[Tensor]) -> list[Tensor]:
    """Fake outputs shared by every implementation: validate, then ``[M, K]`` and ``[M, N_i]`` of h's dtype."""
    validate(h, residual, norm_weight, weights)
    return [h.new_empty(h.shape)] + [h.new_empty(h.shape[0], w.shape[0]) for w in weights]


add_rms_linear_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.add_rms_linear_ref, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        note="plain torch: add, RMSNorm, F.linear per weight")


def add_rms_linear(h: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weights: list[Tensor],
                   backend: str | None = None) -> list[Tensor]:
    """``[h + residual, x @ W.T for W in weights]`` with ``x`` the sum's RMSNorm; see the module docstring.
    ``backend``: None/"auto", "reference" or "triton"."""
    impl = resolve(OP, h.device, backend, dtype=h.dtype)
    return impl.fn(h, residual, norm_weight, float(eps), list(weights))


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(h: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weights: list[Tensor]) -> list[Tensor]:
    import mla_compile.ops.triton.add_rms_linear  # noqa: F401  (registers mla::add_rms_linear_triton)
    return torch.ops.mla.add_rms_linear_triton(h, residual, norm_weight, eps, weights)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=(torch.bfloat16, torch.float16),
        package="triton", gpu_tested=False, kernels=("add_rms_linear_triton", "_add_rms_linear_kernel"),
        note=f"ours: the GEMV of mla::skinny_linear norming its rows itself, up to {MAX_ROWS} rows (an add + norm "
             f"kernel and F.linear above)")
