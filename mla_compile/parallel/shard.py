"""Shard an HF DeepSeek model for one rank: :func:`shard_model` (what ``patch(hf_model, parallel=...)`` calls).

Per rank (``H_l = num_heads / attn_tp`` heads from head ``attn_rank * H_l``):

- attention: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` keep their heads' rows, so the absorbed path folds only
  those heads' ``W_UK`` / ``W_UV``; ``o_proj`` keeps the matching columns and all-reduces over the attention group
  (:class:`~mla_compile.parallel.layers.RowParallelLinear`); ``q_a_proj``, ``kv_a_proj_with_mqa`` and the norms are
  whole, so every rank writes the whole latent row of every token (the cache is duplicated ``attn_tp`` times;
  ``CacheLayout(..., parallel=...)`` reports it).
- decode context parallelism: each rank of a DCP group caches its tokens of every sequence (no copies).
- data-parallel attention: tokens of all attention groups gathered around each MLP / MoE and ``lm_head``.
- dense MLPs and shared experts: intermediate width split over all ranks; routed experts over ``ep`` x ``moe_tp``
  (:class:`~mla_compile.parallel.moe.ParallelMoE`).
- ``embed_tokens`` and ``lm_head`` split by vocabulary rows (zero-padded to a multiple of the ranks); logits
  all-gathered.

Weights come from the HF model itself (its tensors are sliced and the full ones dropped) or, for a model
built on the meta device, from ``weights`` (a state dict, or a function from an HF parameter name to a tensor
or a lazily sliceable object such as safetensors' ``get_slice``), so a rank never holds a full weight it does
not keep.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn

from mla_compile.models.attention import MLAAttention
from mla_compile.models.config import MLAConfig
from mla_compile.parallel.attention import DCPAttention
from mla_compile.parallel.groups import ParallelState
from mla_compile.parallel.layers import (ParallelLMHead, ParallelMLP, RowParallelLinear, VocabParallelEmbedding,
                                         shard_range, take_rows)
from mla_compile.parallel.moe import ParallelExperts, ParallelMoE

WeightSource = Mapping[str, Any] | Callable[[str], Any]


class _Source:
    """Where full weights are read from: the HF model's own tensors, or ``weights``; shards land on ``device``."""

    def __init__(self, hf_model: nn.Module, weights: WeightSource | None, device: torch.device) -> None:
        self.own = dict(hf_model.named_parameters())
        self.own.update(dict(hf_model.named_buffers()))
        self.weights = weights
        self.device = device

    def full(self, name: str) -> Any:
        """The full tensor (or sliceable) called ``name``."""
        if self.weights is not None:
            try:
                return self.weights(name) if callable(self.weights) else self.weights[name]
            except KeyError:
                raise KeyError(f"weights has no tensor {name!r} (HF parameter names expected)") from None
        t = self.own.get(name)
        if t is None:
            raise KeyError(f"the model has no tensor {name!r}")
        if t.is_meta:
            raise ValueError(f"{name} is on the meta device: pass weights= (a state dict or a name -> tensor "
                             "function) to materialise this rank's shards")
        return t.detach()

    def take(self, name: str, fn: Callable[[Any], Tensor] = lambda full: full[:]) -> nn.Parameter:
        """``fn(full tensor of name)`` as a fresh parameter on the device (the full tensor is not kept)."""
        part = torch.as_tensor(fn(self.full(name)))
        return nn.Parameter(part.to(self.device, copy=True).contiguous(), requires_grad=False)


def _linear(weight: nn.Parameter, bias: nn.Parameter | None = None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    lin.weight = weight
    if bias is not None:
        lin.bias = bias
    return lin


def _rows(start: int, stop: int) -> Callable[[Any], Tensor]:
    return lambda full: full[start:stop]


def _cols(start: int, stop: int) -> Callable[[Any], Tensor]:
    return lambda full: full[:, start:stop]


def shard_model(hf_model: nn.Module, state: ParallelState, *, backend: str | None = None, moe_impl: str = "auto",
                ep_dispatch: str = "all_to_all", weights: WeightSource | None = None) -> nn.Module:
    """Shard ``hf_model`` (an HF DeepSeek V2/V3 causal LM, in memory or on the meta device) in place for this
    rank of ``state`` and return the :class:`~mla_compile.models.model.MLAForCausalLM` to run on ``state.device``.

    ``weights`` (see the module docstring) is required when the model is on the meta device. ``ep_dispatch``:
    "all_to_all" or "all_reduce" (see :mod:`mla_compile.parallel.moe`). Raises ``ValueError`` when the model
    does not split evenly (``ParallelConfig.validate_for``) and ``NotImplementedError`` for fp8-expert models and
    sparse (V3.2) models under DCP, which are not sharded yet. A sparse model's lightning indexer is replicated
    (every rank picks the same top-k slots of its whole cache); its attention heads are split as usual.

    ``dcp > 1``: every layer is a :class:`~mla_compile.parallel.attention.DCPAttention` over this rank's part of
    the cache; plan each rank's steps with :func:`mla_compile.parallel.dcp.plan_dcp_step`.

    Data-parallel attention (``dp_attention > 1``): each attention group runs its own requests (own cache, heads
    split over its ``attn_tp`` ranks); MLPs, MoE and ``lm_head`` gather every group's tokens and keep their own
    rows after, so every group's step must have the same token count and logits rows (the scheduler pads).
    """
    from mla_compile.models.model import MLAForCausalLM  # model imports this module lazily: no cycle

    config = MLAConfig.from_hf(hf_model.config)
    p = state.config
    p.validate_for(config)
    if config.is_sparse and p.dcp > 1:
        raise NotImplementedError("sparse (V3.2) attention reads the slots its indexer picks from the whole cache; "
                                  "it is not split by token (dcp) yet")
    src = _Source(hf_model, weights, state.device)
    attn_g, tp_g = state.attn, state.tp
    H_l = config.num_heads // attn_g.size
    h0 = attn_g.rank * H_l
    local_config = config.replace(num_heads=H_l)
    qk, kvw, v = config.qk_head_dim, config.qk_nope_head_dim + config.v_head_dim, config.v_head_dim
    for i, layer in enumerate(hf_model.model.layers):
        pre = f"model.layers.{i}."
        attn = layer.self_attn
        if isinstance(attn, MLAAttention):
            raise ValueError("shard_model needs an unpatched HF model (layer self_attn is already an MLAAttention)")
        a = pre + "self_attn."
        if getattr(attn, "q_proj", None) is not None:
            attn.q_proj = _linear(src.take(a + "q_proj.weight", _rows(h0 * qk, (h0 + H_l) * qk)))
        else:
            attn.q_b_proj = _linear(src.take(a + "q_b_proj.weight", _rows(h0 * qk, (h0 + H_l) * qk)))
        attn.kv_b_proj = _linear(src.take(a + "kv_b_proj.weight", _rows(h0 * kvw, (h0 + H_l) * kvw)))
        bias = src.take(a + "o_proj.bias") if attn.o_proj.bias is not None else None
        attn.o_proj = RowParallelLinear(src.take(a + "o_proj.weight", _cols(h0 * v, (h0 + H_l) * v)), bias, attn_g)
        if p.dcp > 1:
            layer.self_attn = DCPAttention(local_config, attn, state.dcp, backend=backend)
        else:
            layer.self_attn = MLAAttention(local_config, attn, backend=backend)
        mlp = layer.mlp
        if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            layer.mlp = _shard_moe(mlp, pre + "mlp.", config, state, src, moe_impl, ep_dispatch)
        else:
            layer.mlp = _shard_mlp(mlp, pre + "mlp.", tp_g, src, reduce=True, dp=state.dp)
    m = hf_model.model
    vocab = config.vocab_size or m.embed_tokens.weight.shape[0]
    start, stop = shard_range(vocab, attn_g, pad=True)
    m.embed_tokens = VocabParallelEmbedding(src.take("model.embed_tokens.weight", lambda f: take_rows(f, start, stop)),
                                            vocab, attn_g)
    start, stop = shard_range(vocab, tp_g, pad=True)
    hf_model.lm_head = ParallelLMHead(src.take("lm_head.weight", lambda f: take_rows(f, start, stop)), vocab, tp_g,
                                      dp=state.dp)
    _materialise_rest(hf_model, src, state.device)
    model = MLAForCausalLM(hf_model, config)
    model.parallel_state = state  # CacheLayout(config, parallel=model.parallel_state.config) gives the copies
    return model


def _shard_mlp(mlp: nn.Module, pre: str, group, src: _Source, *, reduce: bool, dp=None) -> ParallelMLP:
    """A gated MLP with its intermediate width split over ``group`` (tokens gathered over ``dp`` first)."""
    inter = mlp.gate_proj.weight.shape[0]
    s, e = shard_range(inter, group)
    gate = _linear(src.take(pre + "gate_proj.weight", _rows(s, e)))
    up = _linear(src.take(pre + "up_proj.weight", _rows(s, e)))
    down = _linear(src.take(pre + "down_proj.weight", _cols(s, e)))
    return ParallelMLP(gate, up, down, mlp.act_fn, group, reduce=reduce, dp=dp)


def _shard_moe(moe: nn.Module, pre: str, config: MLAConfig, state: ParallelState, src: _Source, impl: str,
               dispatch: str) -> ParallelMoE:
    """Experts ``[e0, e0 + E_l)`` of this EP rank with their intermediate columns of this MoE-TP rank."""
    experts = moe.experts
    if getattr(experts, "is_fp8_block", False) or not hasattr(experts, "gate_up_proj"):
        raise NotImplementedError(f"{type(experts).__name__}: only the transformers-5 fused bf16/fp32 experts "
                                  "(gate_up_proj [E, 2I, H], down_proj [E, H, I]) are sharded so far")
    E, two_i = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[1]
    inter = two_i // 2
    e0, e1 = shard_range(E, state.ep)
    s, t = shard_range(inter, state.moe_tp)

    def gate_up_rows(full) -> Tensor:  # this rank's rows of the gate half and of the up half
        gate, up = full[e0:e1, s:t], full[e0:e1, inter + s:inter + t]
        return torch.cat([torch.as_tensor(gate), torch.as_tensor(up)], 1)

    gate_up = src.take(pre + "experts.gate_up_proj", gate_up_rows)
    down = src.take(pre + "experts.down_proj", lambda f: f[e0:e1, :, s:t])
    shared = getattr(moe, "shared_experts", None)
    if shared is not None:
        shared = _shard_mlp(shared, pre + "shared_experts.", state.tp, src, reduce=False)
    return ParallelMoE(moe.gate, ParallelExperts(gate_up, down, experts.act_fn, e0), shared, state,
                       dispatch=dispatch, impl=impl)


def _materialise_rest(hf_model: nn.Module, src: _Source, device: torch.device) -> None:
    """Whole (replicated) weights: read from the source when on meta, moved to ``device``; the rotary
    buffers rebuilt from the config when on meta."""
    rotary = getattr(hf_model.model, "rotary_emb", None)
    if rotary is not None and getattr(rotary, "inv_freq", None) is not None and rotary.inv_freq.is_meta:
        with torch.device("cpu"):
            hf_model.model.rotary_emb = type(rotary)(rotary.config)
    for module in hf_model.modules():
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for key, t in list(table.items()):
                if t is None or (not t.is_meta and t.device == device):
                    continue
                if t.is_meta:
                    name = _name_of(hf_model, module, key)
                    new = torch.as_tensor(src.full(name)[:]).to(device, copy=True)
                else:
                    new = t.detach().to(device)
                table[key] = nn.Parameter(new, requires_grad=False) if kind == "parameter" else new


def _name_of(root: nn.Module, module: nn.Module, key: str) -> str:
    for prefix, m in root.named_modules():
        if m is module:
            return f"{prefix}.{key}" if prefix else key
    raise KeyError(key)
