"""A compile-friendly replacement for HF DeepSeek MoE blocks, with the same numerics.

HF's eager experts loop over the experts that were hit (``nonzero`` and a Python loop: a data-dependent
graph). Here routing is the same math on static shapes, and the experts run either densely (every
expert on every token, weighted by a ``[T, E]`` routing matrix; any device) or grouped (tokens sorted
by expert, ``torch._grouped_mm``; CUDA bf16), both without host syncs. The HF router/expert/shared
modules are shared, not copied, under their HF names, so state dicts stay HF-compatible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def route(gate: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """DeepSeek routing for ``x [T, hidden]`` -> ``(weights [T, k] float32, expert ids [T, k])``.

    V3 (the gate has ``e_score_correction_bias``): sigmoid scores, group-limited choice on biased
    scores (top-2 sum per group), weights from unbiased scores, optional normalisation. V2: softmax
    scores with "greedy" or "group_limited_greedy" (max per group) choice.
    """
    num_experts, top_k = gate.weight.shape[0], gate.top_k
    logits = F.linear(x.float(), gate.weight.float())
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is not None:
        scores = logits.sigmoid()
        choice = scores + bias
        group_scores = choice.view(-1, gate.num_group, num_experts // gate.num_group).topk(2, dim=-1)[0].sum(-1)
        choice = _mask_groups(choice, group_scores, gate.num_group, gate.topk_group, float("-inf"))
        ids = choice.topk(top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if getattr(gate, "norm_topk_prob", False):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if getattr(gate, "topk_method", "greedy") == "group_limited_greedy":
            group_scores = scores.view(-1, gate.num_group, num_experts // gate.num_group).max(dim=-1).values
            scores = _mask_groups(scores, group_scores, gate.num_group, gate.topk_group, 0.0)
        weights, ids = scores.topk(top_k, dim=-1, sorted=False)
    return weights * gate.routed_scaling_factor, ids


def _mask_groups(scores: Tensor, group_scores: Tensor, n_group: int, topk_group: int, fill: float) -> Tensor:
    """Keep the experts of the ``topk_group`` best groups; others get ``fill``."""
    keep_groups = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False)[1], 1.0)
    keep = keep_groups.unsqueeze(-1).expand(-1, n_group, scores.shape[-1] // n_group).reshape(scores.shape)
    return scores.masked_fill(keep == 0, fill)


def experts_dense(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, act) -> Tensor:
    """Every expert on every token, combined by a ``[T, E]`` routing matrix (exact, static shapes)."""
    num_experts = gate_up.shape[0]
    combine = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device).scatter_add_(1, ids, weights)
    h = torch.einsum("th,eih->eti", x, gate_up)
    g, u = h.chunk(2, dim=-1)
    y = torch.einsum("eti,ehi->eth", act(g) * u, down)
    return torch.einsum("eth,te->th", y, combine.to(y.dtype))


def sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """``ids [T, k]`` -> ``(order [T*k], offs [E] int32)``: the (token, slot) copies sorted by expert (stable)
    and each expert's cumulative row end, as ``torch._grouped_mm`` takes them. Token of row r: ``order[r] // k``."""
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    return torch.argsort(flat, stable=True), torch.cumsum(counts, 0, dtype=torch.int32)


def combine_sorted(y: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """Sorted expert outputs ``y [T*k, H]`` back to tokens, weighted: ``[T, H]`` float32."""
    T, k = weights.shape
    # back to (token, slot) order by a permutation, then a float32 sum over the k slots: deterministic
    # (an index_add_ would add in atomic order, so bf16 rounding and greedy tokens could vary run to run)
    y = torch.empty_like(y).index_copy_(0, order, y).view(T, k, -1)
    return torch.einsum("tkh,tk->th", y.float(), weights.float())


def experts_grouped(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, down: Tensor, act) -> Tensor:
    """Tokens sorted by expert through ``torch._grouped_mm`` (CUDA, bf16): reads each hit expert once."""
    order, offs = sort_by_expert(ids, gate_up.shape[0])
    h = torch._grouped_mm(x[order // ids.shape[1]], gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm((act(g) * u).contiguous(), down.transpose(1, 2), offs=offs)
    return combine_sorted(y, order, weights)


class MLAMoE(nn.Module):
    """Drop-in for ``DeepseekV2Moe``/``DeepseekV3MoE`` sharing their ``gate``, ``experts``, ``shared_experts``."""

    def __init__(self, hf_moe: nn.Module, impl: str = "auto") -> None:
        super().__init__()
        if impl not in ("auto", "dense", "grouped"):
            raise ValueError(f"impl must be 'auto', 'dense' or 'grouped', got {impl!r}")
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
        self.impl = impl

    def _use_grouped(self, x: Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")

    def forward(self, x: Tensor) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``: routed experts plus shared experts."""
        weights, ids = route(self.gate, x)
        if self.fp8_experts:  # grouped by default on CUDA, as for bf16 experts
            grouped = self.impl == "grouped" or (self.impl == "auto" and x.is_cuda)
            return self.experts(x, weights, ids, grouped=grouped).to(x.dtype) + self.shared_experts(x)
        run = experts_grouped if self._use_grouped(x) else experts_dense
        routed = run(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj, self.experts.act_fn)
        return routed.to(x.dtype) + self.shared_experts(x)
