"""``mla::moe_gate_route``: DeepSeek's MoE router GEMV and routing, from hidden states to ``(weights, ids)``.

Contract. ``x [T, H]`` and the gate's ``weight [E, H]`` (the same float dtype) give the router logits
``x @ weight.T`` with float32 accumulation of the products (float64 for float64 x; the products of half-precision
values are exact in float32, as in ``mla_compile.models.moe.router_logits``), then the routing of
``mla::moe_route`` (:mod:`mla_compile.ops.moe_route`: the same arguments after ``weight``, the same
``(weights [T, top_k] float32, ids [T, top_k] int32)``). Ties between equal choices, and choices that differ only
by the summation order of the logits, may resolve differently per backend.

Backends: "reference" (plain torch, any device: ``F.linear`` in float32, then
:func:`~mla_compile.ops.moe_route.route_math`), "triton" (ours, CUDA half precision: for up to :data:`MAX_ROWS`
tokens one launch, its programs each reading a slice of the gate's experts once for every token and the last
of them to finish routing each token; more tokens or more experts than the routing holds run
``torch.mm(..., out_dtype=float32)`` and ``mla::moe_route``'s kernel inside the op, so one compiled graph serves
every batch size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.moe_route import route_math
from mla_compile.ops.moe_route import validate as validate_route
from mla_compile.ops.registry import FLOATS, HALF, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("moe_gate_route", "mla.moe_gate_route")
MAX_ROWS = 2  # tokens the fused kernel serves (a decode step of one sequence, padded to the graph's size 2)


def validate(x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int,
             scoring: str) -> None:
    """Shape/dtype/argument checks (metadata only, no sync)."""
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOATS, expected="[T, hidden] float hidden states")
    H = x.shape[1]
    check_tensor(OP, "weight", weight, ndim=2, dtypes=(x.dtype,), shape=(None, H),
                 expected=f"[E, {H}] of x's dtype {x.dtype} (the gate's weight)")
    if weight.device != x.device:
        raise ValueError(f"{OP}: weight is on {weight.device}, x on {x.device}")
    logits = torch.empty(0, weight.shape[0], device="meta")
    validate_route(logits, bias, top_k, num_group, topk_group, scoring)


def gate_logits(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` in float32 (float64 for float64 x), products of the given values."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return F.linear(x.to(wide), weight.to(wide))


@torch.library.custom_op("mla::moe_gate_route_ref", mutates_args=(), tags=LAYOUT_TAGS)
def moe_gate_route_ref(x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, num_group: int,
                       topk_group: int, scoring: str, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device): :func:`gate_logits`, then :func:`route_math`; ids as int32."""
    validate(x, weight, bias, top_k, num_group, topk_group, scoring)
    weights, ids = route_math(gate_logits(x, weight), bias, top_k, num_group, topk_group, scoring, renormalize,
                              scaling)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def fake(x, weight, bias, top_k, num_group, topk_group, scoring, renormalize, scaling):
    """Fake outputs shared by every implementation: ``[T, k]`` weights (float32, float64 for float64 x) and int32
    ids."""
    validate(x, weight, bias, top_k, num_group, topk_group, scoring)
    T = x.shape[0]
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(T, top_k, dtype=wide), x.new_empty(T, top_k, dtype=torch.int32)


moe_gate_route_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.moe_gate_route_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="F.linear in float32, then the routing in plain torch")


def moe_gate_route(x: Tensor, weight: Tensor, top_k: int, *, bias: Tensor | None = None, num_group: int = 1,
                   topk_group: int = 1, scoring: str = "softmax", renormalize: bool = False, scaling: float = 1.0,
                   backend: str | None = None) -> tuple[Tensor, Tensor]:
    """DeepSeek router and routing of ``x [T, H]`` with the gate ``weight [E, H]`` -> ``(weights [T, top_k]
    float32, ids [T, top_k] int32)``; see the module docstring. ``backend``: None/"auto", "reference" or
    "triton"."""
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    return impl.fn(x, weight, bias, int(top_k), int(num_group), int(topk_group), scoring, bool(renormalize),
                   float(scaling))


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int,
            scoring: str, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.moe_gate_route  # noqa: F401  (registers mla::moe_gate_route_triton)
    return torch.ops.mla.moe_gate_route_triton(x, weight, bias, top_k, num_group, topk_group, scoring, renormalize,
                                               scaling)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=HALF, package="triton",
        gpu_tested=True, kernels=("moe_gate_route_triton", "_moe_gate_route_kernel"),
        note=f"ours: router GEMV over the gate's expert slices and routing by the last program, one launch, up to "
             f"{MAX_ROWS} tokens (torch.mm + the route kernel above)")
