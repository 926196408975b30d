"""``mla::moe_norm_gate_route``: a residual add, the MoE's input RMSNorm, the router GEMV and the routing, in one op.

Contract. ``x [T, H]``, ``residual [T, H]``, ``norm_weight [H]`` (all of one float dtype), ``eps`` and the gate's
``weight [E, H]`` of that dtype give ``(h, normed, weights, ids)``: ``h = x + residual`` in x's dtype, ``normed =
norm_weight * (h * rsqrt(mean(h^2) + eps))`` with HF DeepSeek's RMSNorm's rounding steps (the mean and the scaling in
float32, the scaled row rounded to x's dtype before the weight; a backend sums the squares in its own order, so an
element may round the other way), and ``mla::moe_gate_route``'s routing of the logits
``normed @ weight.T`` (:mod:`mla_compile.ops.moe_gate_route`: the same arguments after ``weight``, the same
``(weights [T, top_k] float32, ids [T, top_k] int32)``). A decoder layer's step after its attention is this: the
attention's residual add, ``post_attention_layernorm`` and the MoE's router. A backend may form the logits from the
normed row before its rounding to x's dtype (``(g * h) . W * rsqrt(mean(h^2) + eps)`` in float32); the picks may then
differ where two choices are within that rounding of each other (as between backends of ``mla::moe_gate_route``).

Backends: "reference" (torch: the add, the norm, then ``mla::moe_gate_route``'s reference, any device), "triton" (ours,
CUDA half precision: up to :data:`~mla_compile.ops.moe_gate_route.MAX_ROWS` tokens, ``mla::moe_gate_route``'s
kernel whose programs also add the residual and sum the row's squares in their loop over the hidden columns, scale
their logits by the row's ``rsqrt`` at the end and each store its slice of ``h`` and ``normed``: no launch for the
add and the norm; more tokens: one add + norm launch, then ``mla::moe_gate_route``'s path for them, inside the op).
GPU-tested and faster than the launches it replaces (BENCHMARKS.md runs 216-218): "auto" takes "triton" on CUDA half
precision.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.moe_gate_route import gate_logits
from mla_compile.ops.moe_gate_route import validate as validate_gate_route
from mla_compile.ops.moe_route import route_math
from mla_compile.ops.registry import FLOATS, HALF, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops.skinny_norm_linear import rms_norm, validate_add_norm

OP = declare_op("moe_norm_gate_route", "mla.moe_norm_gate_route")


def validate(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
             top_k: int, num_group: int, topk_group: int, scoring: str) -> None:
    """Shape/dtype/argument checks (metadata only, no sync)."""
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOATS, expected="[T, hidden] float hidden states")
    if residual is None:
        raise TypeError(f"{OP}: residual must be a [T, hidden] tensor of x's dtype, got None")
    validate_add_norm(OP, x, residual, norm_weight, eps)
    for name, t in (("residual", residual), ("norm_weight", norm_weight)):
        if t.device != x.device:
            raise ValueError(f"{OP}: {name} is on {t.device}, x on {x.device}")
    validate_gate_route(x, weight, bias, top_k, num_group, topk_group, scoring)


@torch.library.custom_op("mla::moe_norm_gate_route_ref", mutates_args=(), tags=LAYOUT_TAGS)
def moe_norm_gate_route_ref(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                            bias: Tensor | None, top_k: int, num_group: int, topk_group: int, scoring: str,
                            renormalize: bool, scaling: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference (plain torch, any device): the add, :func:`rms_norm`, ``mla::moe_gate_route``'s reference math."""
    validate(x, residual, norm_weight, eps, weight, bias, top_k, num_group, topk_group, scoring)
    h = x + residual
    normed = rms_norm(h, norm_weight, eps)
    weights, ids = route_math(gate_logits(normed, weight), bias, top_k, num_group, topk_group, scoring, renormalize,
                              scaling)
    return h, normed, weights.contiguous(), ids.to(torch.int32).contiguous()


def fake(x, residual, norm_weight, eps, weight, bias, top_k, num_group, topk_group, scoring, renormalize, scaling):
    """Fake outputs shared by every implementation: ``h``, ``normed`` like x, ``[T, k]`` weights (float32, float64
    for float64 x) and int32 ids."""
    validate(x, residual, norm_weight, eps, weight, bias, top_k, num_group, topk_group, scoring)
    T = x.shape[0]
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(T, top_k, dtype=wide), x.new_empty(T, top_k, dtype=torch.int32))


moe_norm_gate_route_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.moe_norm_gate_route_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="the add, RMSNorm, F.linear in float32 and the routing in plain torch")


def moe_norm_gate_route(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, top_k: int, *,
                        bias: Tensor | None = None, num_group: int = 1, topk_group: int = 1, scoring: str = "softmax",
                        renormalize: bool = False, scaling: float = 1.0,
                        backend: str | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x [T, H] + residual`` -> ``(h, normed [T, H] of x's dtype, weights [T, top_k] float32, ids [T, top_k]
    int32)``: the add, the RMSNorm of ``norm_weight [H]`` and ``eps``, DeepSeek's router over the gate ``weight
    [E, H]`` and its routing; see the module docstring. ``backend``: None/"auto", "reference" or "triton"."""
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    return impl.fn(x, residual, norm_weight, float(eps), weight, bias, int(top_k), int(num_group), int(topk_group),
                   scoring, bool(renormalize), float(scaling))


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
            top_k: int, num_group: int, topk_group: int, scoring: str, renormalize: bool,
            scaling: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    import mla_compile.ops.triton.moe_gate_route  # noqa: F401  (registers mla::moe_norm_gate_route_triton)
    return torch.ops.mla.moe_norm_gate_route_triton(x, residual, norm_weight, eps, weight, bias, top_k, num_group,
                                                    topk_group, scoring, renormalize, scaling)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=HALF, package="triton", gpu_tested=True,
        kernels=("moe_norm_gate_route_triton", "_moe_gate_route_kernel"),
        note="ours: mla::moe_gate_route's kernel with the add and the norm in its loop, one launch for few tokens")
