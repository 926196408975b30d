"""DeepSeek-V4 over ranks (:func:`shard_v4`, what ``patch(hf_v4_model, parallel=...)`` calls):
``ParallelConfig(tp=P, dp_attention=D, ep=P)``, attention in ``D`` data-parallel groups of ``A = P / D`` ranks that
split its heads, the routed experts split whole over all ``P`` ranks.

- Attention (:class:`ParallelV4Attention`): each rank of an attention group holds ``num_attention_heads / A`` query
  heads: its rows of ``q_b_proj`` and its ``sinks``, its ``o_groups / A`` groups of the grouped ``o_a_proj`` and the
  matching columns of ``o_b_proj``, whose partial outputs are summed over the group (one float32 all-reduce a layer,
  as vLLM's tensor-parallel MLA). Everything else of the attention is replicated in the group and computed on every
  rank of it: ``q_a_proj``, ``kv_proj``, the compressors and the indexer, and so the caches (window rows,
  compressed entries, the compressors' state), which every rank of a group holds whole (a single KV head). ``A = 1``
  (``dp_attention == tp``) is SGLang's data-parallel attention for DeepSeek at scale: every rank runs the whole
  attention of its own requests. The mHC, the norms, the embedding and ``lm_head`` are replicated.
- MoE (:class:`ParallelV4MoE`): every rank holds ``n_routed_experts / P`` whole routed experts, nearly all of V4's
  weights. Around each MoE block the tokens of the data-parallel groups (and their ids, which hash routing reads) are
  all-gathered; each rank routes all of them (the router replicated), applies its own experts (the picks of other
  ranks' experts weigh 0), and one all-reduce sums the ranks' partial outputs; the shared expert then runs
  replicated and each rank keeps its group's rows. Every group's step must therefore have the same token count (the
  scheduler pads); the ranks of one attention group run the same requests. bf16 / float experts (``gate_up_proj [E,
  2I, H]``, ``down_proj [E, H, I]``) and the fp8 / fp4 experts of a quantized checkpoint are split alike (whole
  experts; ``mla_compile.parallel.shard``'s block split).

fp8 attention weights keep their 128 x 128 block scales: a head split must cut ``q_b_proj``'s rows and ``o_b_proj``'s
columns at block boundaries or inside one block (``mla_compile.parallel.shard.block_split``; V4's 512-wide heads and
1024-row groups always do). ``from_pretrained(v4_dir, parallel=...)`` reads only the rank's experts from the
checkpoint (straight onto its device); ``patch(meta_model, parallel=..., weights=state_dict)`` reads the rank's part of
a state dict. Not yet: decode context parallelism.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile.models.fp4_linear import FP4Experts
from mla_compile.models.fp8_linear import FP8Experts, FP8GroupedLinear
from mla_compile.models.v4_loader import rebuild_nonpersistent
from mla_compile.models.v4_model import V4Attention, V4ForCausalLM, V4MoE, shared_mlp
from mla_compile.ops.fp8_block_linear import BLOCK as FP8_BLOCK
from mla_compile.parallel.groups import Group, ParallelState
from mla_compile.parallel.layers import all_reduce, gathered, shard_range
from mla_compile.parallel.moe import local_routing
from mla_compile.parallel.shard import (_materialise_rest, _rows, _shard_block_experts, _Source, _split_linear,
                                        block_split)


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


class ParallelV4Attention(V4Attention):
    """A V4 attention layer on one rank of an attention group (:func:`shard_v4`): the HF module holds this rank's
    heads (``q_b_proj`` rows, ``sinks``, ``o_a_proj`` groups, ``o_b_proj`` columns; see the module docstring), and
    :meth:`attend`'s output is summed over ``group`` in float32."""

    def __init__(self, hf_attn: nn.Module, config, group: Group, backend: str | None = None) -> None:
        super().__init__(hf_attn, config, backend)
        self.group = group

    def attend(self, q: Tensor, q_idx: Tensor | None, w_idx: Tensor | None, positions: Tensor, inv_freq: Tensor,
               meta) -> Tensor:
        out = super().attend(q, q_idx, w_idx, positions, inv_freq, meta)
        return all_reduce(out.float(), self.group).to(out.dtype)


def _split_heads(hf_model: nn.Module, state: ParallelState, src: _Source) -> None:
    """Give every layer's HF attention module this rank's heads of an even split over ``state.attn`` (the module
    docstring): ``q_b_proj`` rows, ``sinks``, ``o_a_proj`` groups, ``o_b_proj`` columns, ``num_heads``; fp8 weights
    keep their block scales (:func:`local_experts` checked that the heads and groups split). Raises ``ValueError`` (on
    every rank alike) where an fp8 split would cut a scale block."""
    cfg, group = hf_model.config, state.attn
    h0, h1 = shard_range(cfg.num_attention_heads, group)
    for i, layer in enumerate(hf_model.model.layers):
        a, pre = layer.self_attn, f"model.layers.{i}.self_attn."
        a.q_b_proj = _split_linear(src, a.q_b_proj, pre + "q_b_proj.", 0, group, "attention TP")
        a.o_b_proj = _split_linear(src, a.o_b_proj, pre + "o_b_proj.", 1, group, "attention TP")
        a.o_a_proj = _split_groups(src, a.o_a_proj, pre + "o_a_proj.", group)
        a.sinks = src.take(pre + "sinks", _rows(h0, h1))
        a.num_heads = h1 - h0


def _split_groups(src: _Source, module: nn.Module, pre: str, group: Group) -> nn.Module:
    """The grouped ``o_a_proj`` (HF ``DeepseekV4GroupedLinear`` or :class:`FP8GroupedLinear`, ``n_groups`` blocks of
    rows) with this rank's groups of an even split over ``group``, fp8 with their rows of the block-scale grid."""
    G, A = module.n_groups, group.size
    total = module.weight.shape[0]
    if isinstance(module, FP8GroupedLinear):
        part, blocks = block_split(pre + "weight", 0, total, group, FP8_BLOCK, "attention TP")
        out = FP8GroupedLinear(module.in_features, total // A, G // A, act_quant=module.act_quant,
                               backend=module.backend, device="meta")
        out.weight = src.take(pre + "weight", lambda f: f[part])
        out.weight_scale_inv = src.take(pre + "weight_scale_inv", lambda f: f[blocks])
        return out
    with torch.device("meta"):  # HF's grouped linear, its weight assigned below
        out = type(module)(module.in_features, total // A, G // A)
    out.weight = src.take(pre + "weight", _rows(*shard_range(total, group)))
    return out


def local_experts(state: ParallelState, config) -> tuple[int, int]:
    """The routed experts ``[e0, e1)`` this rank of ``state`` holds in :func:`shard_v4`'s layout for the V4
    ``config``, after checking that layout (before anything is read). Raises ``NotImplementedError`` for another
    layout and ``ValueError`` when the routed experts do not split over ``ep`` or, with attention groups of several
    ranks, the heads or the output groups do not split over them."""
    p = state.config
    if p.world_size > 1 and not (p.ep == p.tp and p.dcp == 1):
        raise NotImplementedError(
            f"DeepSeek-V4 shards its routed experts whole over every rank (expert parallelism) and its attention by "
            f"heads or data-parallel groups: ParallelConfig(tp={p.tp}, dp_attention=<a divisor of {p.tp}>, "
            f"ep={p.tp}); got ep={p.ep}, dcp={p.dcp} (DCP is not built for V4 yet)")
    num_experts = config.n_routed_experts
    if num_experts % p.ep:
        raise ValueError(f"ep={p.ep} does not divide n_routed_experts={num_experts}; pick a degree that divides "
                         f"{num_experts}")
    for name, total in (("num_attention_heads", config.num_attention_heads), ("o_groups", config.o_groups)):
        if total % p.attn_tp:
            raise ValueError(f"DeepSeek-V4 attention TP: {name}={total} does not split over the attention group's "
                             f"{p.attn_tp} ranks (tp / dp_attention = {p.tp} / {p.dp_attention}); pick dp_attention "
                             f"so that tp / dp_attention divides {config.num_attention_heads} heads and "
                             f"{config.o_groups} output groups")
    return shard_range(num_experts, state.ep)


def shard_v4(hf_model: nn.Module, state: ParallelState, *, backend: str | None = None, moe_impl: str = "auto",
             weights=None) -> V4ForCausalLM:
    """Shard an HF ``DeepseekV4ForCausalLM`` (holding its weights) in place for this rank of ``state`` (the layout of
    the module docstring) and return the :class:`~mla_compile.models.v4_model.V4ForCausalLM` to run on
    ``state.device``. Experts modules that already hold only this rank's experts (what
    :func:`~mla_compile.models.v4_loader.load_v4` reads under ``parallel=``) are kept as they are. A model on the
    meta device reads its part from ``weights`` (a state dict, or a function from an HF parameter name to its
    tensor): this rank's experts and heads and the replicated weights only. Raises ``NotImplementedError`` for another
    layout, and ``ValueError`` when the routed experts do not split evenly over ``ep``, the heads over the attention
    group (:func:`local_experts`), or a meta model comes without ``weights``."""
    E = hf_model.config.n_routed_experts
    e0, e1 = local_experts(state, hf_model.config)
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
    if state.attn.size > 1:  # this rank's heads, read as parts like the experts
        _split_heads(hf_model, state, src)
    del src  # its references to the full expert (and head-split) tensors
    _materialise_rest(hf_model, _Source(hf_model, weights, state.device), state.device)
    model = V4ForCausalLM(hf_model, backend=backend, moe_impl=moe_impl)
    if state.attn.size > 1:
        model.attn = nn.ModuleList(ParallelV4Attention(layer.self_attn, hf_model.config, state.attn, backend)
                                   for layer in hf_model.model.layers)
    model.moe = nn.ModuleList(ParallelV4MoE(layer.mlp, e0, state, moe_impl, hf_model.config.scoring_func)
                              for layer in hf_model.model.layers)
    model.parallel_state = state
    return model
