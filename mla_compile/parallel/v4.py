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

``from_pretrained(v4_dir, parallel=...)`` reads only the rank's experts from the checkpoint (straight onto its device);
``patch(meta_model, parallel=..., weights=state_dict)`` reads the rank's part of a state dict. Not yet: tensor-parallel
attention, decode context parallelism.
"""

from __future__ import annotations

from torch import Tensor, nn

from mla_compile.models.fp4_linear import FP4Experts
from mla_compile.models.fp8_linear import FP8Experts
from mla_compile.models.v4_loader import rebuild_nonpersistent
from mla_compile.models.v4_model import V4ForCausalLM, V4MoE, shared_mlp
from mla_compile.parallel.groups import ParallelState
from mla_compile.parallel.layers import all_reduce, gathered, shard_range
from mla_compile.parallel.moe import local_routing
from mla_compile.parallel.shard import _materialise_rest, _shard_block_experts, _Source


class ParallelV4MoE(V4MoE):
    """A V4 MoE block on one rank of :func:`shard_v4`'s layout: ``forward(x [T, hidden], input_ids [T])`` as
    :class:`~mla_compile.models.v4_model.V4MoE`'s, over every rank's tokens gathered (see the module docstring). The
    HF block's ``experts`` hold this rank's experts only (float, or a quantized checkpoint's ``FP8Experts`` /
    ``FP4Experts``), global experts ``first`` on."""

    def __init__(self, hf_moe: nn.Module, first: int, state: ParallelState, impl: str = "auto",
                 scoring: str | None = None):
        super().__init__(hf_moe, impl, scoring)
        self.first = first
        self.ep, self.dp = state.ep, state.dp

    def forward(self, x: Tensor, input_ids: Tensor) -> Tensor:
        return gathered(self._moe, x, self.dp, input_ids)

    def _moe(self, x: Tensor, input_ids: Tensor) -> Tensor:
        weights, ids = self.route(x, input_ids)  # global expert ids: the router is replicated
        weights, local = local_routing(weights, ids, self.first, self.hf.experts.num_experts)
        routed = all_reduce(self.routed(x, weights, local).float(), self.ep)  # every rank's experts' share
        return routed.to(x.dtype) + shared_mlp(self.hf.shared_experts, x)


def local_experts(state: ParallelState, num_experts: int) -> tuple[int, int]:
    """The routed experts ``[e0, e1)`` this rank of ``state`` holds in :func:`shard_v4`'s layout. Raises
    ``NotImplementedError`` for another layout and ``ValueError`` when ``num_experts`` does not split over ``ep``."""
    p = state.config
    if p.world_size > 1 and not (p.dp_attention == p.tp and p.ep == p.tp and p.dcp == 1):
        raise NotImplementedError(
            f"DeepSeek-V4 shards as data-parallel attention with expert parallelism: ParallelConfig(tp={p.tp}, "
            f"dp_attention={p.tp}, ep={p.tp}); got dp_attention={p.dp_attention}, ep={p.ep}, dcp={p.dcp} "
            "(tensor-parallel attention and DCP are not built for V4 yet)")
    if num_experts % p.ep:
        raise ValueError(f"ep={p.ep} does not divide n_routed_experts={num_experts}; pick a degree that divides "
                         f"{num_experts}")
    return shard_range(num_experts, state.ep)


def shard_v4(hf_model: nn.Module, state: ParallelState, *, backend: str | None = None, moe_impl: str = "auto",
             weights=None) -> V4ForCausalLM:
    """Shard an HF ``DeepseekV4ForCausalLM`` (holding its weights) in place for this rank of ``state`` (the layout of
    the module docstring) and return the :class:`~mla_compile.models.v4_model.V4ForCausalLM` to run on
    ``state.device``. Experts modules that already hold only this rank's experts (what
    :func:`~mla_compile.models.v4_loader.load_v4` reads under ``parallel=``) are kept as they are. A model on the
    meta device reads its part from ``weights`` (a state dict, or a function from an HF parameter name to its
    tensor): this rank's experts and the replicated weights only. Raises ``NotImplementedError`` for another layout,
    and ``ValueError`` when the routed experts do not split evenly over ``ep`` or a meta model comes without
    ``weights``."""
    E = hf_model.config.n_routed_experts
    e0, e1 = local_experts(state, E)
    if weights is None and any(t.is_meta for t in hf_model.parameters()):
        raise ValueError("shard_v4: the HF model is on the meta device: pass weights= (a state dict, or a function "
                         "from an HF parameter name to its tensor) to read this rank's part from")
    rebuild_nonpersistent(hf_model, hf_model.config, state.device)  # a meta model's rotary tables, built for real
    src = _Source(hf_model, weights, state.device)
    for i, layer in enumerate(hf_model.model.layers):
        pre = f"model.layers.{i}.mlp.experts."
        experts = layer.mlp.experts
        if e1 - e0 < E and getattr(experts, "num_experts", None) == e1 - e0:
            continue  # this rank's experts already (a per-rank load)
        if isinstance(experts, (FP8Experts, FP4Experts)):  # only this rank's experts stay referenced
            layer.mlp.experts = _shard_block_experts(experts, pre, state, src).local
        elif hasattr(experts, "gate_up_proj"):
            experts.gate_up_proj = src.take(pre + "gate_up_proj", lambda f: f[e0:e1])
            experts.down_proj = src.take(pre + "down_proj", lambda f: f[e0:e1])
            experts.num_experts = e1 - e0
        else:
            raise NotImplementedError(f"{type(experts).__name__}: only the fused float experts (gate_up_proj "
                                      "[E, 2I, H], down_proj [E, H, I]), FP8Experts and FP4Experts are sharded")
    del src  # its references to the full expert tensors
    _materialise_rest(hf_model, _Source(hf_model, weights, state.device), state.device)
    model = V4ForCausalLM(hf_model, backend=backend, moe_impl=moe_impl)
    model.moe = nn.ModuleList(ParallelV4MoE(layer.mlp, e0, state, moe_impl, hf_model.config.scoring_func)
                              for layer in hf_model.model.layers)
    model.parallel_state = state
    return model
