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

fp8 linears (:class:`~mla_compile.models.fp8_linear.FP8BlockLinear`) and fp8 / fp4 experts
(:class:`~mla_compile.models.fp8_linear.FP8Experts`, :class:`~mla_compile.models.fp4_linear.FP4Experts`) are split the
same way and stay quantized, their block scales split with them (:func:`block_split`); ``kv_b_proj`` must come
float (``from_pretrained``'s source dequantizes this rank's heads).

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
from mla_compile.models.fp4_linear import FP4Experts
from mla_compile.models.fp8_linear import FP8BlockLinear, FP8Experts
from mla_compile.ops.fp4_block_linear import BLOCK as FP4_BLOCK, as_bytes
from mla_compile.ops.fp8_block_linear import BLOCK as FP8_BLOCK
from mla_compile.parallel.attention import DCPAttention
from mla_compile.parallel.groups import ParallelState
from mla_compile.parallel.layers import (ParallelLMHead, ParallelMLP, RowParallelLinear, VocabParallelEmbedding,
                                         shard_range, take_rows)
from mla_compile.parallel.moe import ParallelBlockExperts, ParallelExperts, ParallelMoE

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
    does not split evenly (``ParallelConfig.validate_for``) or a split cuts an fp8 / fp4 quantization block. A
    sparse model's lightning indexer is replicated (every rank picks the same top-k slots; under DCP from the
    candidates of every rank's part, :class:`~mla_compile.parallel.attention.DCPIndexer`); its attention heads are
    split as usual.

    ``dcp > 1``: every layer is a :class:`~mla_compile.parallel.attention.DCPAttention` over this rank's part of
    the cache (sparse V3.2 layers too); plan each rank's steps with :func:`mla_compile.parallel.dcp.plan_dcp_step`
    (or :func:`~mla_compile.parallel.dcp.localize` a step planned without DCP).

    Data-parallel attention (``dp_attention > 1``): each attention group runs its own requests (own cache, heads
    split over its ``attn_tp`` ranks); MLPs, MoE and ``lm_head`` gather every group's tokens and keep their own
    rows after, so every group's step must have the same token count and logits rows (the scheduler pads).
    """
    from mla_compile.models.model import MLAForCausalLM  # model imports this module lazily: no cycle

    config = MLAConfig.from_hf(hf_model.config)
    p = state.config
    p.validate_for(config)
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
        q = "q_proj" if getattr(attn, "q_proj", None) is not None else "q_b_proj"
        setattr(attn, q, _split_linear(src, getattr(attn, q), a + q + ".", 0, attn_g, "attention TP"))
        attn.kv_b_proj = _linear(src.take(a + "kv_b_proj.weight", _rows(h0 * kvw, (h0 + H_l) * kvw)))
        if attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{a}kv_b_proj.weight is float8_e4m3fn: the absorbed path reads it as W_UK / W_UV, so "
                             "weights= must give it dequantized (from_pretrained's source does)")
        attn.o_proj = _row_parallel(src, attn.o_proj, a + "o_proj.", attn_g)
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


def block_split(name: str, dim: int, total: int, group, block: int, degree: str = "TP") -> tuple[slice, slice]:
    """This rank's slice of dim ``dim`` (``total`` long) of a block-quantized tensor ``name`` split evenly over
    ``group``, and the matching slice of its scale grid (one scale per ``block`` along that dim).

    A shard must start on a block boundary, or lie inside one block (then it keeps that block's scale: exact,
    the local block grid is the global one shifted by whole blocks). Every rank's shard is checked here, so all
    ranks raise the same ``ValueError`` (naming the tensor, the dim, its size and the degree) instead of one
    rank going on alone into a collective."""
    size = group.size
    if total % size:
        raise ValueError(f"{name}: dim {dim} of size {total} does not split over {degree} degree {size}")
    n = total // size
    for r in range(size):
        a = r * n
        if a % block and a % block + n > block:
            raise ValueError(
                f"{name}: dim {dim} of size {total} split over {degree} degree {size} gives rank {r} [{a}, {a + n}), "
                f"which starts inside a {block}-wide quantization block and runs past it: the block scales cannot "
                f"be split there; use a {degree} degree that cuts {total} at multiples of {block}, or load it "
                "unsharded / dequantized")
    a = group.rank * n
    return slice(a, a + n), slice(a // block, -(-(a + n) // block))


def _split_linear(src: _Source, module: nn.Module, pre: str, dim: int, group, degree: str = "TP") -> nn.Module:
    """``module`` (an ``nn.Linear`` without bias or an :class:`FP8BlockLinear`) with this rank's rows (``dim``
    0) or columns (1) of an even split over ``group``; an fp8 one keeps the matching rows / columns of its
    block-scale grid (:func:`block_split`)."""
    total = module.weight.shape[dim]
    if not isinstance(module, FP8BlockLinear):
        s, e = shard_range(total, group)
        return _linear(src.take(pre + "weight", _rows(s, e) if dim == 0 else _cols(s, e)))
    part, blocks = block_split(pre + "weight", dim, total, group, FP8_BLOCK, degree)
    cut = (lambda f, i: f[i]) if dim == 0 else (lambda f, i: f[:, i])
    weight = src.take(pre + "weight", lambda f: cut(f, part))
    scale = src.take(pre + "weight_scale_inv", lambda f: cut(f, blocks))
    out = FP8BlockLinear(weight.shape[1], weight.shape[0], act_quant=module.act_quant, backend=module.backend,
                         device="meta")
    out.weight, out.weight_scale_inv = weight, scale
    return out


def _row_parallel(src: _Source, module: nn.Module, pre: str, group) -> RowParallelLinear:
    """``o_proj`` with this rank's columns (its heads), all-reduced over ``group``; fp8 kept fp8."""
    bias = src.take(pre + "bias") if getattr(module, "bias", None) is not None else None
    local = _split_linear(src, module, pre, 1, group, "attention TP")
    if isinstance(local, FP8BlockLinear):
        return RowParallelLinear(local.weight, bias, group, weight_scale_inv=local.weight_scale_inv,
                                 act_quant=local.act_quant, backend=local.backend)
    return RowParallelLinear(local.weight, bias, group)


def _shard_mlp(mlp: nn.Module, pre: str, group, src: _Source, *, reduce: bool, dp=None) -> ParallelMLP:
    """A gated MLP with its intermediate width split over ``group`` (tokens gathered over ``dp`` first); fp8
    projections stay fp8 with their block scales split alike."""
    gate = _split_linear(src, mlp.gate_proj, pre + "gate_proj.", 0, group)
    up = _split_linear(src, mlp.up_proj, pre + "up_proj.", 0, group)
    down = _split_linear(src, mlp.down_proj, pre + "down_proj.", 1, group)
    return ParallelMLP(gate, up, down, mlp.act_fn, group, reduce=reduce, dp=dp)


def _shard_moe(moe: nn.Module, pre: str, config: MLAConfig, state: ParallelState, src: _Source, impl: str,
               dispatch: str) -> ParallelMoE:
    """Experts ``[e0, e0 + E_l)`` of this EP rank with their intermediate columns of this MoE-TP rank."""
    experts = moe.experts
    block = isinstance(experts, (FP8Experts, FP4Experts))
    if not block and not hasattr(experts, "gate_up_proj"):  # refused before anything is sharded
        raise NotImplementedError(f"{type(experts).__name__}: only the transformers-5 fused float experts "
                                  "(gate_up_proj [E, 2I, H], down_proj [E, H, I]), FP8Experts and FP4Experts are "
                                  "sharded")
    shared = getattr(moe, "shared_experts", None)
    if shared is not None:
        shared = _shard_mlp(shared, pre + "shared_experts.", state.tp, src, reduce=False)
    if block:
        local = _shard_block_experts(experts, pre + "experts.", state, src)
        return ParallelMoE(moe.gate, local, shared, state, dispatch=dispatch, impl=impl)
    E, two_i = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[1]
    inter = two_i // 2
    e0, e1 = shard_range(E, state.ep)
    s, t = shard_range(inter, state.moe_tp)

    def gate_up_rows(full) -> Tensor:  # this rank's rows of the gate half and of the up half
        gate, up = full[e0:e1, s:t], full[e0:e1, inter + s:inter + t]
        return torch.cat([torch.as_tensor(gate), torch.as_tensor(up)], 1)

    gate_up = src.take(pre + "experts.gate_up_proj", gate_up_rows)
    down = src.take(pre + "experts.down_proj", lambda f: f[e0:e1, :, s:t])
    return ParallelMoE(moe.gate, ParallelExperts(gate_up, down, experts.act_fn, e0), shared, state,
                       dispatch=dispatch, impl=impl)


def _shard_block_experts(experts: nn.Module, pre: str, state: ParallelState, src: _Source) -> ParallelBlockExperts:
    """The experts ``[e0, e1)`` of this EP rank, each with this MoE-TP rank's intermediate rows (gate / up) and
    columns (down), as a local :class:`FP8Experts` / :class:`FP4Experts`: only those experts' weights and
    scales are read. fp8: the 128 x 128 scale grid is split with the weights (:func:`block_split`); fp4: the
    per-row scales follow the rows, and a column split must fall on the 32-weight scale groups."""
    e0, e1 = shard_range(experts.num_experts, state.ep)
    fp4 = isinstance(experts, FP4Experts)
    hidden, inter = (experts.hidden, experts.intermediate) if fp4 else tuple(experts.down_proj.shape[1:])
    if fp4:  # the checkpoint's names: one tensor per expert j
        part, _ = block_split(f"{pre}<j>.down_proj.weight", 1, inter, state.moe_tp, FP4_BLOCK, "MoE TP")
        if part.start % FP4_BLOCK or (part.stop - part.start) % FP4_BLOCK:
            raise ValueError(f"{pre}<j>.down_proj.weight: intermediate size {inter} split over MoE TP degree "
                             f"{state.moe_tp.size} gives {part.stop - part.start} columns per rank, not a multiple "
                             f"of {FP4_BLOCK} (one ue8m0 scale per {FP4_BLOCK}): use a MoE TP degree that cuts "
                             f"{inter} at multiples of {FP4_BLOCK}")
        row_blocks, col_part = part, slice(part.start // 2, part.stop // 2)  # scales per row; 2 codes per byte
        col_blocks = slice(part.start // FP4_BLOCK, part.stop // FP4_BLOCK)
    else:
        part, row_blocks = block_split(f"{pre}<j>.gate_proj.weight (up_proj, down_proj alike)", 0, inter,
                                       state.moe_tp, FP8_BLOCK, "MoE TP")
        col_part, col_blocks = part, row_blocks
    I_l = part.stop - part.start
    if fp4:
        local = FP4Experts(e1 - e0, hidden, I_l, experts.act_fn, swiglu_limit=experts.swiglu_limit,
                           backend=experts.backend, device="meta")
    else:
        local = FP8Experts(e1 - e0, hidden, I_l, experts.act_fn, act_quant=experts.act_quant,
                           backend=experts.backend, swiglu_limit=getattr(experts, "swiglu_limit", None),
                           device="meta")
    to = as_bytes if fp4 else (lambda t: t)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if proj == "down_proj":  # [E, H, I]: the intermediate columns
            w = src.take(pre + proj, lambda f: to(torch.as_tensor(f[e0:e1, :, col_part])))
            sc = src.take(pre + proj + "_scale_inv", lambda f: to(torch.as_tensor(f[e0:e1, :, col_blocks])))
        else:  # [E, I, H]: the intermediate rows
            w = src.take(pre + proj, lambda f: to(torch.as_tensor(f[e0:e1, part])))
            sc = src.take(pre + proj + "_scale_inv", lambda f: to(torch.as_tensor(f[e0:e1, row_blocks])))
        setattr(local, proj, w)
        setattr(local, proj + "_scale_inv", sc)
    return ParallelBlockExperts(local, e0)


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
