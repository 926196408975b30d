"""DeepSeek-V4 over ranks: data-parallel attention with expert parallelism (:func:`shard_v4`, what
``patch(hf_v4_model, parallel=...)`` calls).

The layout is SGLang's for DeepSeek at scale, ``ParallelConfig(tp=P, dp_attention=P, ep=P)``: every rank runs the
whole attention (all heads, the mHC, its own requests and its own caches: window rows, compressed entries, the
compressors' state) and holds ``n_routed_experts / P`` whole routed experts, which are nearly all of V4's weights.
Around each MoE block every rank's tokens (and their ids, which hash routing reads) are all-gathered; each rank
routes all of them (the router replicated), applies its own experts (the picks of other ranks' experts weigh 0),
and one all-reduce sums the ranks' partial outputs; the shared expert then runs replicated and each rank keeps its
own rows. Every rank's step must therefore have the same token count (the scheduler pads). The embedding,
``lm_head`` and every attention weight are replicated. bf16 / float experts (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) and the fp8 / fp4 experts of a quantized checkpoint are split alike (whole experts;
``mla_compile.parallel.shard``'s block split).

Not yet: tensor-parallel attention, decode context parallelism, a model on the meta device (``weights=``): the
HF model must hold its weights, and each rank keeps only its experts after.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile.models.fp4_linear import FP4Experts
from mla_compile.models.fp8_linear import FP8Experts
from mla_compile.models.v4_model import V4ForCausalLM, V4MoE, experts_dense, experts_grouped, shared_mlp
from mla_compile.parallel.groups import ParallelState
from mla_compile.parallel.layers import all_gather, all_reduce, shard_range
from mla_compile.parallel.moe import ParallelBlockExperts, local_routing
from mla_compile.parallel.shard import _materialise_rest, _shard_block_experts, _Source


class ParallelV4MoE(V4MoE):
    """A V4 MoE block on one rank of :func:`shard_v4`'s layout: ``forward(x [T, hidden], input_ids [T])`` as
    :class:`~mla_compile.models.v4_model.V4MoE`'s, over every rank's tokens gathered (see the module docstring).
    ``local``: this rank's experts, the sliced HF experts module (``num_experts`` of them from global expert
    ``first``) or a :class:`~mla_compile.parallel.moe.ParallelBlockExperts` of a quantized checkpoint's."""

    def __init__(self, hf_moe: nn.Module, local: nn.Module, first: int, state: ParallelState, impl: str = "auto"):
        super().__init__(hf_moe, impl)
        self.local = local
        self.first = first
        self.ep, self.dp = state.ep, state.dp

    def forward(self, x: Tensor, input_ids: Tensor) -> Tensor:
        dp = self.dp
        if dp is None or dp.group is None:
            return self._moe(x, input_ids)
        T = x.shape[0]
        return self._moe(all_gather(x, 0, dp), all_gather(input_ids, 0, dp)).narrow(0, dp.rank * T, T)

    def _moe(self, x: Tensor, input_ids: Tensor) -> Tensor:
        weights, ids = self.route(x, input_ids)  # global expert ids: the router is replicated
        grouped = self.impl == "grouped" or (self.impl == "auto" and x.is_cuda and hasattr(torch, "_grouped_mm")
                                             and (isinstance(self.local, ParallelBlockExperts)
                                                  or x.dtype == torch.bfloat16))
        if isinstance(self.local, ParallelBlockExperts):  # quantized: it takes the global ids itself
            routed = self.local(x, weights, ids, grouped)
        else:
            w, local = local_routing(weights, ids, self.first, self.local.num_experts)
            routed = (experts_grouped if grouped else experts_dense)(x, w, local, self.local)
        routed = all_reduce(routed.float(), self.ep)  # every rank's experts' share of every token
        return routed.to(x.dtype) + shared_mlp(self.hf.shared_experts, x)


def shard_v4(hf_model: nn.Module, state: ParallelState, *, backend: str | None = None, moe_impl: str = "auto",
             weights=None) -> V4ForCausalLM:
    """Shard an HF ``DeepseekV4ForCausalLM`` (holding its weights) in place for this rank of ``state`` (the layout of
    the module docstring) and return the :class:`~mla_compile.models.v4_model.V4ForCausalLM` to run on
    ``state.device``. Raises ``NotImplementedError`` for another layout or a model on the meta device, and
    ``ValueError`` when the routed experts do not split evenly over ``ep``."""
    p = state.config
    if p.world_size > 1 and not (p.dp_attention == p.tp and p.ep == p.tp and p.dcp == 1):
        raise NotImplementedError(
            f"DeepSeek-V4 shards as data-parallel attention with expert parallelism: ParallelConfig(tp={p.tp}, "
            f"dp_attention={p.tp}, ep={p.tp}); got dp_attention={p.dp_attention}, ep={p.ep}, dcp={p.dcp} "
            "(tensor-parallel attention and DCP are not built for V4 yet)")
    if weights is not None or any(t.is_meta for t in hf_model.parameters()):
        raise NotImplementedError("shard_v4 takes an HF V4 model that holds its weights (weights= and meta-device "
                                  "models are not built for V4 yet)")
    E = hf_model.config.n_routed_experts
    if E % p.ep:
        raise ValueError(f"ep={p.ep} does not divide n_routed_experts={E}; pick a degree that divides {E}")
    src = _Source(hf_model, None, state.device)
    locals_ = []
    for i, layer in enumerate(hf_model.model.layers):
        pre = f"model.layers.{i}.mlp."
        experts = layer.mlp.experts
        e0, e1 = shard_range(E, state.ep)
        if isinstance(experts, (FP8Experts, FP4Experts)):
            local = _shard_block_experts(experts, pre + "experts.", state, src)
            layer.mlp.experts = local.local  # only this rank's experts stay referenced
        else:
            if not hasattr(experts, "gate_up_proj"):
                raise NotImplementedError(f"{type(experts).__name__}: only the fused float experts (gate_up_proj "
                                          "[E, 2I, H], down_proj [E, H, I]), FP8Experts and FP4Experts are sharded")
            experts.gate_up_proj = src.take(pre + "experts.gate_up_proj", lambda f: f[e0:e1])
            experts.down_proj = src.take(pre + "experts.down_proj", lambda f: f[e0:e1])
            experts.num_experts = e1 - e0
            local = experts
        locals_.append((local, e0))
    del src  # its references to the full expert tensors
    _materialise_rest(hf_model, _Source(hf_model, None, state.device), state.device)
    model = V4ForCausalLM(hf_model, backend=backend, moe_impl=moe_impl)
    model.moe = nn.ModuleList(ParallelV4MoE(layer.mlp, local, e0, state, moe_impl)
                              for layer, (local, e0) in zip(hf_model.model.layers, locals_))
    model.parallel_state = state
    return model
