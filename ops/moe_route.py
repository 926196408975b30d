"""``mla::moe_route``: DeepSeek's MoE routing, from router logits to ``(weights, expert ids)``.

Contract. ``logits [T, E]`` float32 (float64 allowed: the reference then runs in float64) are the router's
``x @ gate.weight.T``. Scores are ``sigmoid(logits)`` (``scoring="sigmoid"``, V3), ``sqrt(softplus(logits))``
(``scoring="sqrtsoftplus"``, V4; softplus as torch's, linear above 20) or ``softmax(logits)`` over E
(``scoring="softmax"``, V2). The choice runs on ``scores + bias`` (``bias [E]``, V3's and V4's
``e_score_correction_bias``; absent: ``scores``). With ``num_group > 1`` the E experts form ``num_group`` equal
groups, each group scored by the sum of its two best choices (sigmoid, sqrtsoftplus) or its best choice (softmax,
"group_limited_greedy"); only the experts of the ``topk_group`` best groups stay (the others get -inf (sigmoid,
sqrtsoftplus) or 0 (softmax), as HF does). The ``top_k`` best remaining experts are picked;
their weights are the *unbiased* scores, divided by their sum (plus 1e-20) when ``renormalize``, then
multiplied by ``scaling``. Returns ``(weights [T, top_k] float32 (float64 for float64 logits), ids
[T, top_k] int32)``; the order of the k picks within a row is unspecified (the Triton kernel gives them
best first). Ties between equal choices may resolve differently per backend.

Backends: "reference" (plain torch, any device; the same math as ``mla_compile.models.moe.route``, which
calls :func:`route_math`), "triton" (CUDA: one program per token row does all of it, E <= 1024).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("moe_route", "mla.moe_route")
SCORINGS = ("sigmoid", "softmax", "sqrtsoftplus")
MAX_EXPERTS = 1024


def validate(logits: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int,
             scoring: str) -> None:
    """Shape/dtype/argument checks (metadata only, no sync)."""
    check_tensor(OP, "logits", logits, ndim=2, dtypes=(torch.float32, torch.float64),
                 expected="[T, E] float32 router logits")
    E = logits.shape[1]
    if bias is not None:
        check_tensor(OP, "bias", bias, ndim=1, dtypes=FLOATS, shape=(E,),
                     expected=f"[{E}] float (e_score_correction_bias)")
    if scoring not in SCORINGS:
        raise ValueError(f"{OP}: scoring must be one of {SCORINGS}, got {scoring!r}")
    if num_group < 1 or E % num_group:
        raise ValueError(f"{OP}: num_group must be >= 1 and divide the {E} experts, got {num_group}")
    if not 1 <= topk_group <= num_group:
        raise ValueError(f"{OP}: topk_group must be in [1, num_group={num_group}], got {topk_group}")
    kept = topk_group * (E // num_group)
    if not 1 <= top_k <= kept:
        raise ValueError(f"{OP}: top_k must be in [1, {kept}] (the experts of the topk_group={topk_group} kept "
                         f"groups), got {top_k}")
    if scoring != "softmax" and num_group > 1 and E // num_group < 2:
        raise ValueError(f"{OP}: {scoring} group scores sum each group's two best experts: groups need >= 2 "
                         f"experts, got {E // num_group}")


def _mask_groups(choice: Tensor, group_scores: Tensor, num_group: int, topk_group: int, fill: float) -> Tensor:
    """Keep the experts of the ``topk_group`` best groups; the others get ``fill``."""
    best = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    keep_groups = torch.zeros_like(group_scores).scatter_(1, best, 1.0)
    keep = keep_groups.unsqueeze(-1).expand(-1, num_group, choice.shape[-1] // num_group).reshape(choice.shape)
    return choice.masked_fill(keep == 0, fill)


def route_math(logits: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int, scoring: str,
               renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """The contract in plain torch (traceable; static shapes): ``(weights [T, k], ids [T, k] int64)``."""
    T, E = logits.shape
    if scoring != "softmax":
        scores = logits.sigmoid() if scoring == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        if num_group > 1:
            grouped = choice.view(T, num_group, E // num_group)
            choice = _mask_groups(choice, grouped.topk(2, dim=-1)[0].sum(-1), num_group, topk_group, float("-inf"))
        ids = choice.topk(top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        scores = logits.softmax(dim=-1)
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        if num_group > 1:
            group_best = choice.view(T, num_group, E // num_group).max(dim=-1).values
            choice = _mask_groups(choice, group_best, num_group, topk_group, 0.0)
        ids = choice.topk(top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@torch.library.custom_op("mla::moe_route_ref", mutates_args=(), tags=LAYOUT_TAGS)
def moe_route_ref(logits: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int, scoring: str,
                  renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device): :func:`route_math`, ids as int32."""
    validate(logits, bias, top_k, num_group, topk_group, scoring)
    weights, ids = route_math(logits, bias, top_k, num_group, topk_group, scoring, renormalize, scaling)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def fake(logits, bias, top_k, num_group, topk_group, scoring, renormalize, scaling):
    """Fake outputs shared by every implementation: validate, then ``[T, k]`` weights and int32 ids."""
    validate(logits, bias, top_k, num_group, topk_group, scoring)
    T = logits.shape[0]
    return logits.new_empty(T, top_k), logits.new_empty(T, top_k, dtype=torch.int32)


moe_route_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.moe_route_ref, rank=100, devices=("any",),
        dtypes=(torch.float32, torch.float64), gpu_tested=True, note="plain torch, the numerical ground truth")


def moe_route(logits: Tensor, top_k: int, *, bias: Tensor | None = None, num_group: int = 1, topk_group: int = 1,
              scoring: str = "softmax", renormalize: bool = False, scaling: float = 1.0,
              backend: str | None = None) -> tuple[Tensor, Tensor]:
    """DeepSeek routing of ``logits [T, E]`` float32 -> ``(weights [T, top_k] float32, ids [T, top_k] int32)``;
    see the module docstring. ``backend``: None/"auto", "reference" or "triton"."""
    impl = resolve(OP, logits.device, backend, dtype=logits.dtype)
    return impl.fn(logits, bias, int(top_k), int(num_group), int(topk_group), scoring, bool(renormalize),
                   float(scaling))


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(logits: Tensor, bias: Tensor | None, top_k: int, num_group: int, topk_group: int, scoring: str,
            renormalize: bool, scaling: float) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.moe_route  # noqa: F401  (registers mla::moe_route_triton)
    return torch.ops.mla.moe_route_triton(logits, bias, top_k, num_group, topk_group, scoring, renormalize, scaling)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=(torch.float32,), package="triton",
        gpu_tested=True, kernels=("moe_route_triton", "_moe_route_kernel"),
        note="ours: one program per token (scores, group choice, top-k, weights)")
