"""A compile-friendly replacement for HF DeepSeek MoE blocks, with the same numerics.

HF's eager experts loop over the experts that were hit (``nonzero`` and a Python loop: a data-dependent
graph). Here routing is the same math on static shapes, and the experts run densely (every expert on
every token, weighted by a ``[T, E]`` routing matrix; any device), grouped (tokens sorted by expert,
``torch._grouped_mm``; CUDA bf16) or fused (the ``mla::moe_route`` / ``mla::moe_experts`` ops, or
``mla::moe_gate_route`` for router and routing in one kernel: for few tokens kernels that read only the routed
experts, with the shared experts folded in; fp8 block-quantized experts through ``mla::moe_experts_fp8``), all
without host syncs. The HF router/expert/shared modules are shared, not copied, under their HF names, so state
dicts stay HF-compatible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mla_compile.backends import requested_for
from mla_compile.models.attention import cuda_half, half_kernel
from mla_compile.models.consts import freeze, thaw
from mla_compile.ops.moe_experts import auto_backend, moe_experts
from mla_compile.ops.moe_experts import combine_sorted, sort_by_expert  # noqa: F401  (their home is ops)
from mla_compile.ops.moe_experts_fp8 import auto_backend as auto_backend_fp8
from mla_compile.ops.moe_experts_fp8 import moe_experts_fp8
from mla_compile.ops.moe_gate_route import OP as GATE_ROUTE_OP
from mla_compile.ops.moe_gate_route import moe_gate_route
from mla_compile.ops.moe_norm_gate_route import OP as NORM_ROUTE_OP
from mla_compile.ops.moe_norm_gate_route import moe_norm_gate_route
from mla_compile.ops.moe_route import moe_route, route_math
from mla_compile.ops.registry import SPLIT_PREFIX

IMPLS = ("auto", "dense", "grouped", "fused")


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """The router's ``x [T, hidden] @ weight [E, hidden].T`` in float32, as HF's DeepSeek routers compute it
    (``F.linear(x.float(), weight.float())``). On CUDA with x and the weight both bf16 (or both fp16): one
    half-precision GEMM with float32 accumulation and output (``torch.mm(..., out_dtype=torch.float32)``). The
    products of half-precision values are exact in float32, so only the summation order differs, and there is no
    per-step float32 copy of the weight and no SIMT float32 GEMM."""
    if cuda_half(x, weight):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


def route(gate: nn.Module, x: Tensor, scaling: float | None = None) -> tuple[Tensor, Tensor]:
    """DeepSeek routing for ``x [T, hidden]`` -> ``(weights [T, k] float32, expert ids [T, k])``.

    V3 (the gate has ``e_score_correction_bias``): sigmoid scores, group-limited choice on biased
    scores (top-2 sum per group), weights from unbiased scores, optional normalisation. V2: softmax
    scores with "greedy" or "group_limited_greedy" (max per group) choice. The math is
    :func:`mla_compile.ops.moe_route.route_math` (traced inline: Inductor fuses it). ``scaling``: as
    :func:`route_args`.
    """
    return route_math(router_logits(x, gate.weight), *route_args(gate, scaling))


def route_args(gate: nn.Module, scaling: float | None = None) -> tuple:
    """The routing constants of an HF DeepSeek gate, as :func:`~mla_compile.ops.moe_route.route_math` and
    ``mla::moe_route`` take them: ``(bias, top_k, num_group, topk_group, scoring, renormalize, scaling)``.
    ``scaling`` (None: the gate's ``routed_scaling_factor``) lets a module pass the factor it keeps as a constant
    (:mod:`mla_compile.models.consts`)."""
    if scaling is None:
        scaling = float(gate.routed_scaling_factor)
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is not None:
        return (bias, gate.top_k, gate.num_group, gate.topk_group, "sigmoid",
                bool(getattr(gate, "norm_topk_prob", False)), scaling)
    limited = getattr(gate, "topk_method", "greedy") == "group_limited_greedy"
    num_group, topk_group = (gate.num_group, gate.topk_group) if limited else (1, 1)
    return None, gate.top_k, num_group, topk_group, "softmax", False, scaling


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


def swiglu(act: nn.Module, gate: Tensor, up: Tensor, limit: float | None = None) -> Tensor:
    """``act(gate) * up``; ``limit`` (DeepSeek-V4's ``swiglu_limit``, None: none) first clamps the gate to
    ``<= limit`` and up to ``[-limit, limit]``. (The experts ops' own form, which also rounds: ``ops.moe_experts``.)"""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return act(gate) * up


def _is_silu(act) -> bool:
    return act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _foldable_shared(shared: nn.Module | None, width: int) -> bool:
    """Whether the shared MLP can run as always-routed experts of width ``width`` inside ``mla::moe_experts``:
    plain bias-free SiLU ``gate_proj``/``up_proj``/``down_proj`` linears whose width is a multiple of ``width``."""
    linears = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(m) is nn.Linear and m.bias is None for m in linears):
        return False
    return _is_silu(getattr(shared, "act_fn", None)) and linears[0].out_features % width == 0


def _foldable_shared_fp8(shared: nn.Module | None, width: int, limit: float | None) -> bool:
    """:func:`_foldable_shared` for fp8 shared experts (``mla::moe_experts_fp8``): weight-only
    ``FP8BlockLinear`` ``gate_proj``/``up_proj``/``down_proj`` with no backend of their own, SiLU, width a multiple
    of ``width``, and the routed experts' swiglu clamp ``limit`` (the op clamps both alike: V4's shared MLP holds
    it as ``limit``, V2/V3's has none)."""
    linears = [getattr(shared, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(getattr(m, "is_fp8_linear", False) and not m.act_quant and m.backend is None for m in linears):
        return False
    if getattr(shared, "limit", None) != limit:
        return False
    return _is_silu(getattr(shared, "act_fn", None)) and linears[0].out_features % width == 0


def fp8_fused_refusal(experts: nn.Module) -> str | None:
    """Why block-quantized ``experts`` cannot run in ``mla::moe_experts_fp8`` (None: they can): it serves
    weight-only fp8 (``FP8Experts``) SiLU experts that ask for no ``fp8_block_linear`` backend of their own."""
    if getattr(experts, "is_fp4_block", False):
        return "fp4 experts have no fused kernel (mla::moe_experts_fp8 serves fp8 ones)"
    if getattr(experts, "act_quant", False):
        return "the experts quantize their activations (act_quant=True); mla::moe_experts_fp8 is weight-only"
    if getattr(experts, "backend", None) is not None:
        return f"the experts ask for fp8_block_linear backend {experts.backend!r}; they run it themselves"
    if not _is_silu(getattr(experts, "act_fn", None)):
        return "the experts' activation is not SiLU"
    return None


class MLAMoE(nn.Module):
    """Drop-in for ``DeepseekV2Moe``/``DeepseekV3MoE`` sharing their ``gate``, ``experts``, ``shared_experts``.

    ``impl``: "dense" (every expert on every token, any device), "grouped" (``torch._grouped_mm``, CUDA bf16),
    "fused" (the ``mla::moe_route`` and ``mla::moe_experts`` ops: our Triton kernels on CUDA, their torch
    references elsewhere; the shared experts run inside the experts op when they are plain SiLU linears), or
    "auto": "fused" on CUDA where ``mla::moe_experts``'s "auto" serves x's dtype with its fused kernels (fused
    for few tokens, grouped GEMMs above, in one op), else "grouped" on CUDA bf16, else "dense".
    fp8 experts (``FP8Experts``) take ``mla::moe_experts_fp8`` the same way ("fused", or "auto" where that op's
    "auto" is its fused kernel; fp8 shared experts fold in when they are weight-only ``FP8BlockLinear`` modules), else
    run themselves (grouped on CUDA under "auto"/"grouped", else dense). ``fused_refusal`` says why the fused ops
    cannot serve these experts (None when they can): fp4 experts, activation-quantized fp8 experts, experts
    with an ``fp8_block_linear`` backend of their own, a non-SiLU activation. It, ``fusable`` and ``fold_shared``
    are decided at construction.

    ``backend``: a backend spec as ``patch`` takes it (None: ``MLA_COMPILE_BACKEND``); its
    ``moe_norm_gate_route=NAME`` entry picks that op's backend for :meth:`forward_residual`. ``norm_eps``: the
    epsilon of the decoder layer's ``post_attention_layernorm`` (None: :meth:`forward_residual` never folds the norm).
    """

    def __init__(self, hf_moe: nn.Module, impl: str = "auto", backend: str | None = None,
                 norm_eps: float | None = None) -> None:
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
        # decided once, from the modules as they are now (patch() sets fp8 backends before it builds MLAMoE)
        if self.fp8_experts:
            self.fused_refusal = fp8_fused_refusal(self.experts)
        else:
            self.fused_refusal = None if _is_silu(self.experts.act_fn) else "the experts' activation is not SiLU"
        self.fusable = self.fused_refusal is None
        if impl == "fused" and not self.fusable:
            raise ValueError(f"impl='fused' cannot run these experts: {self.fused_refusal}; use impl='auto'")
        width = self.experts.down_proj.shape[-1] if self.fusable else 0
        if not self.fusable:
            self.fold_shared = False
        elif self.fp8_experts:
            limit = getattr(self.experts, "swiglu_limit", None)
            self.fold_shared = _foldable_shared_fp8(self.shared_experts, width, limit)
        else:
            self.fold_shared = _foldable_shared(self.shared_experts, width)
        self.impl = impl
        self._scaling = freeze(self.gate.routed_scaling_factor)  # a constant of every graph (models/consts.py)
        self._norm_eps = None if norm_eps is None else freeze(norm_eps)
        self._norm_route = requested_for("moe_norm_gate_route", backend)

    def _use_fused(self, x: Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "fused"
        return x.is_cuda and self.auto_fused(str(x.device), str(x.dtype).replace("torch.", ""), x.shape[-1])

    def auto_fused(self, device: str, dtype: str, hidden: int) -> bool:
        """Whether "auto" runs the ops (``mla::moe_route`` + ``mla::moe_experts``) on ``device`` with x of ``dtype``
        and ``hidden`` columns (names): the experts can run in them and the experts op's own "auto" there is one
        of our kernels (fused, our grouped one, or a split of the two by tokens). A constant of the graph, as the
        ops' choices are."""
        if not self.fusable:
            return False
        if self.fp8_experts:
            choice = auto_backend_fp8(device, dtype)
        else:
            choice = auto_backend(device, dtype, hidden)
        return choice in ("triton", "triton-grouped") or choice.startswith(SPLIT_PREFIX)

    def _gate_route(self, x: Tensor) -> bool:
        """Whether the router GEMV and the routing run as one ``mla::moe_gate_route`` (its Triton kernel for few
        tokens, the unfused pair inside the op above): CUDA, x and the gate weight of one half-precision dtype,
        and that op's "auto" picking "triton". A constant of the graph."""
        return half_kernel(GATE_ROUTE_OP, x, None, self.gate.weight) == "triton"

    def _use_grouped(self, x: Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")

    def _route_kw(self) -> tuple[int, dict]:
        """The gate's ``top_k`` and the other routing arguments of the routing ops, by name."""
        bias, top_k, num_group, topk_group, scoring, renorm, scaling = route_args(self.gate, thaw(self._scaling))
        return top_k, dict(bias=bias, num_group=num_group, topk_group=topk_group, scoring=scoring,
                           renormalize=renorm, scaling=scaling)

    def _fused(self, x: Tensor, token_mask: Tensor | None) -> Tensor:
        """Routing and experts through the ``mla::moe_gate_route`` (where :meth:`_gate_route`) or router GEMM +
        ``mla::moe_route``, then the ``mla::moe_experts`` ops."""
        top_k, route_kw = self._route_kw()
        if self._gate_route(x):
            weights, ids = moe_gate_route(x, self.gate.weight, top_k, backend="triton", **route_kw)
        else:
            logits = router_logits(x, self.gate.weight)
            weights, ids = moe_route(logits, top_k, backend=("triton" if x.is_cuda else "reference")
                                     if self.impl == "fused" else None, **route_kw)
        return self._fused_experts(x, weights, ids, token_mask)

    def _fused_experts(self, x: Tensor, weights: Tensor, ids: Tensor, token_mask: Tensor | None) -> Tensor:
        """The routed experts of ``x`` (``weights``, ``ids`` from the routing) and the shared experts through the
        ``mla::moe_experts`` ops (the shared ones inside them where they fold)."""
        explicit = self.impl == "fused"
        se = self.shared_experts
        backend = ("triton" if x.is_cuda else "reference") if explicit else None
        if self.fp8_experts:
            out = self._fused_fp8(x, weights, ids, backend, token_mask)
        else:
            shared = (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight) if self.fold_shared else (None,) * 3
            out = moe_experts(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj,
                              shared_gate=shared[0], shared_up=shared[1], shared_down=shared[2], backend=backend,
                              token_mask=token_mask)
        return out if self.fold_shared else out + se(x)

    def norm_route_serves(self, h: Tensor, norm: nn.Module) -> bool:
        """Whether :meth:`forward_residual` folds the add and ``norm`` into ``mla::moe_norm_gate_route`` (a constant
        of the graph): the fused ops run this MoE, ``h`` is CUDA half precision as the gate's and the norm's weights,
        ``norm_eps`` was given, and that op's backend resolves to "triton" (its "auto" on a GPU;
        ``backend="moe_norm_gate_route=reference"`` keeps the add, the norm and the router apart)."""
        if self._norm_eps is None or not (self.fusable and self._use_fused(h)):
            return False
        return half_kernel(NORM_ROUTE_OP, h, self._norm_route, getattr(norm, "weight", None),
                           self.gate.weight) == "triton"

    def forward_residual(self, h: Tensor, residual: Tensor, norm: nn.Module,
                         token_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A decoder layer's step after its attention: ``(h + residual, self(norm(h + residual), token_mask))``
        (``norm``: its ``post_attention_layernorm``, of epsilon ``norm_eps``). Where :meth:`norm_route_serves`, the
        add, the norm and the router are ``mla::moe_norm_gate_route`` (one launch for few tokens), then the fused
        experts."""
        if self.norm_route_serves(h, norm):
            top_k, route_kw = self._route_kw()
            h, x, weights, ids = moe_norm_gate_route(h, residual, norm.weight, thaw(self._norm_eps), self.gate.weight,
                                                     top_k, backend="triton", **route_kw)
            return h, self._fused_experts(x, weights, ids, token_mask)
        h = h + residual
        return h, self(norm(h), token_mask=token_mask)

    def _fused_fp8(self, x: Tensor, weights: Tensor, ids: Tensor, backend: str | None,
                   token_mask: Tensor | None) -> Tensor:
        """The fp8 experts (``FP8Experts``) and, when they fold, the fp8 shared experts in ``mla::moe_experts_fp8``."""
        ex, se = self.experts, self.shared_experts
        shared = {}
        if self.fold_shared:
            for name in ("gate", "up", "down"):
                linear = getattr(se, f"{name}_proj")
                shared[f"shared_{name}"], shared[f"shared_{name}_scale"] = linear.weight, linear.weight_scale_inv
        return moe_experts_fp8(x, weights, ids, ex.gate_proj, ex.gate_proj_scale_inv, ex.up_proj,
                               ex.up_proj_scale_inv, ex.down_proj, ex.down_proj_scale_inv, **shared,
                               swiglu_limit=getattr(ex, "swiglu_limit", None), backend=backend,
                               token_mask=token_mask)

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``: routed experts plus shared experts. ``token_mask [T]`` bool
        (None: every token is real) marks the real tokens; the rows of the others (padding) are not meaningful:
        the fused ops skip their expert work (their routed and folded shared part is 0), the other paths
        compute them as any token."""
        if self.fusable and self._use_fused(x):
            return self._fused(x, token_mask)
        weights, ids = route(self.gate, x, thaw(self._scaling))
        if self.fp8_experts:  # grouped by default on CUDA, as for bf16 experts
            grouped = self.impl == "grouped" or (self.impl == "auto" and x.is_cuda)
            return self.experts(x, weights, ids, grouped=grouped).to(x.dtype) + self.shared_experts(x)
        run = experts_grouped if self._use_grouped(x) else experts_dense
        routed = run(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj, self.experts.act_fn)
        return routed.to(x.dtype) + self.shared_experts(x)
