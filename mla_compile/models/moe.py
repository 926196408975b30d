"""A compile-friendly replacement for HF DeepSeek MoE blocks, with the same numerics.

HF's eager experts loop over the experts that were hit (``nonzero`` and a Python loop: a data-dependent
graph). Here routing is the same math on static shapes, and the experts run densely (every expert on
every token, weighted by a ``[T, E]`` routing matrix; any device), grouped (tokens sorted by expert,
``torch._grouped_mm``; CUDA bf16) or fused (the ``mla::moe_route`` / ``mla::moe_experts`` ops: for few
tokens kernels that read only the routed experts, with the shared experts folded in), all without host
syncs. The HF router/expert/shared
modules are shared, not copied, under their HF names, so state dicts stay HF-compatible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mla_compile.ops.moe_experts import auto_backend, moe_experts
from mla_compile.ops.moe_experts import combine_sorted, sort_by_expert  # noqa: F401  (their home is ops)
from mla_compile.ops.moe_route import moe_route, route_math
from mla_compile.ops.registry import SPLIT_PREFIX

IMPLS = ("auto", "dense", "grouped", "fused")


def route(gate: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """DeepSeek routing for ``x [T, hidden]`` -> ``(weights [T, k] float32, expert ids [T, k])``.

    V3 (the gate has ``e_score_correction_bias``): sigmoid scores, group-limited choice on biased
    scores (top-2 sum per group), weights from unbiased scores, optional normalisation. V2: softmax
    scores with "greedy" or "group_limited_greedy" (max per group) choice. The math is
    :func:`mla_compile.ops.moe_route.route_math` (traced inline: Inductor fuses it).
    """
    logits = F.linear(x.float(), gate.weight.float())
    return route_math(logits, *route_args(gate))


def route_args(gate: nn.Module) -> tuple:
    """The routing constants of an HF DeepSeek gate, as :func:`~mla_compile.ops.moe_route.route_math` and
    ``mla::moe_route`` take them: ``(bias, top_k, num_group, topk_group, scoring, renormalize, scaling)``."""
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is not None:
        return (bias, gate.top_k, gate.num_group, gate.topk_group, "sigmoid",
                bool(getattr(gate, "norm_topk_prob", False)), float(gate.routed_scaling_factor))
    limited = getattr(gate, "topk_method", "greedy") == "group_limited_greedy"
    num_group, topk_group = (gate.num_group, gate.topk_group) if limited else (1, 1)
    return None, gate.top_k, num_group, topk_group, "softmax", False, float(gate.routed_scaling_factor)


def experts_dense(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, act) -> Tensor:
    """Every expert on every token, combined by a ``[T, E]`` routing matrix (exact, static shapes)."""
    num_experts = gate_up.shape[0]
    combine = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device).scatter_add_(1, ids, weights)
    h = torch.einsum("th,eih->eti", x, gate_up)
    g, u = h.chunk(2, dim=-1)
    y = torch.einsum("eti,ehi->eth", act(g) * u, down)
    return torch.einsum("eth,te->th", y, combine.to(y.dtype))


def experts_grouped(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, act) -> Tensor:
    """Tokens sorted by expert through ``torch._grouped_mm`` (CUDA, bf16): reads each hit expert once."""
    order, offs = sort_by_expert(ids, gate_up.shape[0])
    h = torch._grouped_mm(x[order // ids.shape[1]], gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm((act(g) * u).contiguous(), down.transpose(1, 2), offs=offs)
    return combine_sorted(y, order, weights)


def _is_silu(act) -> bool:
    return act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _foldable_shared(shared: nn.Module | None, width: int) -> bool:
    """Whether the shared MLP can run as always-routed experts of width ``width`` inside ``mla::moe_experts``:
    plain bias-free SiLU ``gate_proj``/``up_proj``/``down_proj`` linears whose width is a multiple of ``width``."""
    linears = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return False
    return _is_silu(getattr(shared, "act_fn", None)) and linears[0].out_features % width == 0


class MLAMoE(nn.Module):
    """Drop-in for ``DeepseekV2Moe``/``DeepseekV3MoE`` sharing their ``gate``, ``experts``, ``shared_experts``.

    ``impl``: "dense" (every expert on every token, any device), "grouped" (``torch._grouped_mm``, CUDA bf16),
    "fused" (the ``mla::moe_route`` and ``mla::moe_experts`` ops: our Triton kernels on CUDA, their torch
    references elsewhere; the shared experts run inside the experts op when they are plain SiLU linears), or
    "auto": "fused" on CUDA where ``mla::moe_experts``'s "auto" serves x's dtype with its fused kernels (fused
    for few tokens, grouped GEMMs above, in one op), else "grouped" on CUDA bf16, else "dense".
    """

    def __init__(self, hf_moe: nn.Module, impl: str = "auto") -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.gate = hf_moe.gate
        self.experts = hf_moe.experts
        self.shared_experts = hf_moe.shared_experts
        # quantized experts (mla_compile.models.fp8_linear.FP8Experts, fp4_linear.FP4Experts, from a DeepSeek fp8 /
        # V4 fp4 checkpoint) run themselves
        self.fp8_experts = bool(getattr(self.experts, "is_fp8_block", False)
                                or getattr(self.experts, "is_fp4_block", False))
        for name in () if self.fp8_experts else ("gate_up_proj", "down_proj", "act_fn"):
            if not hasattr(self.experts, name):
                raise ValueError(f"MoE experts module {type(self.experts).__name__} has no {name}: expected the "
                                 "transformers>=5 fused-experts layout (gate_up_proj [E, 2I, H], down_proj [E, H, I])")
        self.fusable = not self.fp8_experts and _is_silu(self.experts.act_fn)
        if impl == "fused" and not self.fusable:
            raise ValueError("impl='fused' runs bf16/fp16/fp32 experts with SiLU (DeepSeek's); these experts are "
                             f"{'fp8/fp4 block-quantized' if self.fp8_experts else 'not SiLU'}: use impl='auto'")
        width = self.experts.down_proj.shape[-1] if self.fusable else 0
        self.fold_shared = self.fusable and _foldable_shared(self.shared_experts, width)
        self.impl = impl

    def _use_fused(self, x: Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "fused"
        if not (self.fusable and x.is_cuda):
            return False
        choice = auto_backend(str(x.device), str(x.dtype).replace("torch.", ""))
        return choice == "triton" or choice.startswith(SPLIT_PREFIX)

    def _use_grouped(self, x: Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")

    def _fused(self, x: Tensor) -> Tensor:
        """Routing and experts through the ``mla::moe_route`` / ``mla::moe_experts`` ops."""
        explicit = self.impl == "fused"
        logits = F.linear(x.float(), self.gate.weight.float())
        bias, top_k, num_group, topk_group, scoring, renorm, scaling = route_args(self.gate)
        weights, ids = moe_route(logits, top_k, bias=bias, num_group=num_group, topk_group=topk_group,
                                 scoring=scoring, renormalize=renorm, scaling=scaling,
                                 backend=("triton" if x.is_cuda else "reference") if explicit else None)
        se = self.shared_experts
        shared = (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight) if self.fold_shared else (None,) * 3
        out = moe_experts(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj,
                          shared_gate=shared[0], shared_up=shared[1], shared_down=shared[2],
                          backend=("triton" if x.is_cuda else "reference") if explicit else None)
        return out if self.fold_shared else out + se(x)

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``: routed experts plus shared experts."""
        if self.fusable and self._use_fused(x):
            return self._fused(x)
        weights, ids = route(self.gate, x)
        if self.fp8_experts:  # grouped by default on CUDA, as for bf16 experts
            grouped = self.impl == "grouped" or (self.impl == "auto" and x.is_cuda)
            return self.experts(x, weights, ids, grouped=grouped).to(x.dtype) + self.shared_experts(x)
        run = experts_grouped if self._use_grouped(x) else experts_dense
        routed = run(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj, self.experts.act_fn)
        return routed.to(x.dtype) + self.shared_experts(x)
