"""HF DeepSeek V2/V3/V3.2 integration: :func:`patch` turns a ``DeepseekV{2,3,32}ForCausalLM`` into a paged-MLA model.

The patched model runs flat token batches (``input_ids [T]``, ``positions [T]``) with explicit
:class:`~mla_compile.models.metadata.MLAMetadata` and compiles whole with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from mla_compile import envs
from mla_compile.backends import new_choice_cache
from mla_compile.models.attention import MLAAttention
from mla_compile.models.cache import allocate_index_cache, allocate_latent_cache
from mla_compile.models.config import MLAConfig, check_sink_window, is_mla_model
from mla_compile.models.fp8_linear import apply_backend_spec
from mla_compile.models.metadata import MLAMetadata
from mla_compile.models.moe import MLAMoE
from mla_compile.models.region_schema import RegionalCompile, compile_region
from mla_compile.models.rope import default_inv_freq, rope_cos_sin
from mla_compile.models.v4_model import V4ForCausalLM, is_v4_model, patch_v4


class MLAForCausalLM(RegionalCompile, nn.Module):
    """A DeepSeek causal LM over a paged latent cache; parameter names match the HF model's.

    ``forward(input_ids [T], positions [T], meta) -> logits [R, vocab]`` where R is
    ``len(meta.logits_indices)`` (or T when it is None).
    """

    def __init__(self, hf_model: nn.Module, config: MLAConfig) -> None:
        super().__init__()
        self.config = config
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        rotary = getattr(self.model, "rotary_emb", None)
        if rotary is not None and hasattr(rotary, "inv_freq"):
            inv_freq, scaling = rotary.inv_freq.detach().float().clone(), float(getattr(rotary, "attention_scaling", 1.0))
        else:
            inv_freq, scaling = default_inv_freq(config.qk_rope_head_dim, config.rope_theta), 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling
        self.kv_cache_dtype: torch.dtype | str | None = None  # allocate_cache's default (None: the weights')
        self.step_schedule = True  # see forward: the decode backend's step schedule made once a step
        self.sink_window: tuple[int, int] | None = None  # (sink, window) when patched with sparse="sink_window"
        # one backend-choice cache for every layer: a choice depends only on the call's static configuration, and
        # layers that share the cache's token trace to the same graph (a nested compile region is then reused
        # for every layer instead of traced again)
        token, choices = new_choice_cache()
        for attn in self.attentions:
            attn._choice_token, attn._backend_choices = token, choices

    @property
    def attentions(self) -> list[MLAAttention]:
        """The MLA attention module of every layer."""
        return [layer.self_attn for layer in self.model.layers]

    def set_sink_window(self, sink: int | None, window: int | None = None) -> None:
        """Make every layer attend only to the first ``sink`` and the last ``window`` positions of each query's
        causal prefix (what ``patch(..., sparse="sink_window")`` does; e.g. after ``from_pretrained``), or dense
        attention again with ``sink=None``. Set it before building an engine over the model (its block manager
        reads ``sink_window`` once); a compiled graph recompiles for the new mode."""
        if sink is None:
            value = None
        elif self.config.is_sparse:
            raise NotImplementedError("sink + window attention needs a dense-attention (V2/V3) model; a V3.2 "
                                      "model already selects its tokens with its indexer")
        else:
            value = check_sink_window(sink, window)
        for attn in self.attentions:
            attn.sink_window = value
        self.sink_window = value

    def set_cuda_graph(self, enabled: bool = True) -> None:
        """Tell every layer its decode steps will be captured, so "auto" picks only decode backends that
        replay with changing lengths (a CUDA-graph runner calls this before the first step)."""
        for attn in self.attentions:
            attn.cuda_graph = bool(enabled)

    def allocate_cache(self, num_blocks: int, block_size: int, *, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None, fill: float = 0.0,
                       index_dtype: torch.dtype | str | None = None) -> list[Tensor]:
        """Allocate one paged latent cache per layer (defaults: ``self.kv_cache_dtype`` or the weights' dtype,
        the weights' device); returns them.

        Sparse (V3.2) models also get one index-key cache per layer with the same blocks, set on each
        layer's ``self_attn.indexer.k_cache``: of ``index_dtype`` (default: the latent cache's dtype), or
        with ``index_dtype="fp8"`` in the 132-byte fp8 index format (``mla_compile.ops.fp8_index``).
        """
        ref = self.lm_head.weight
        kw = dict(dtype=dtype or self.kv_cache_dtype or ref.dtype, device=device or ref.device, fill=fill)
        caches = [allocate_latent_cache(num_blocks, block_size, self.config, **kw) for _ in self.attentions]
        index_kw = dict(kw, dtype=kw["dtype"] if index_dtype is None else index_dtype)
        for attn, cache in zip(self.attentions, caches):
            attn.set_cache(cache)
            if attn.indexer is not None:
                attn.indexer.set_cache(allocate_index_cache(num_blocks, block_size, self.config, **index_kw))
        return caches

    def forward(self, input_ids: Tensor, positions: Tensor, meta: MLAMetadata) -> Tensor:
        """One step over ``T`` flat tokens (decode tokens first, then prefill); returns logits.

        With ``regional_compile`` (set by :func:`patch`), each layer but a sink + window one runs as two nested
        compile regions (``torch.compiler.nested_compile_region``): its projections (after the previous layer's MLP
        residual), then its attention over the cache and its MLP / MoE, with the cache write between them
        (Inductor takes no mutating op inside a region); a sparse (V3.2) layer's first region also makes its
        indexer's projections, its index keys are written between the regions and its second region selects the
        top-k and attends over it.
        ``torch.compile`` then compiles each region once and stamps it out for every layer of the same shape,
        so compile time hardly grows with depth; eager runs are unchanged.

        With ``step_schedule`` (on unless set False) and a decode backend that takes a step schedule (FlashMLA and
        the splits that run it: ``ops.decode_step_schedule``), the schedule is made once here from the step's
        lengths and every layer's decode takes it (``meta.decode.schedule``) instead of scheduling itself."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.attention_scaling)
        regional = self.regional_compile and any(a.sink_window is None for a in self.attentions)
        if regional:
            # a region's inputs may not alias each other (torch 2.11's invoke_subgraph refuses it), and the
            # builder's tensors are views of one arena: the regions read copies (a few small copies a step)
            meta = meta.map_tensors(torch.clone)
            # the positions, for the second regions that read them (sparse layers', a DCP layer's multi-token decode)
            region_positions = (positions.clone() if any(a.indexer is not None or not a._own_decode
                                                         for a in self.attentions) else None)
        meta = self._with_step_schedule(meta)
        if regional:
            flat = meta.flat()  # plain arguments: Dynamo traces the region once and reuses it for every layer
        token_mask = self.model.layers[0].self_attn.real_tokens(meta)  # the MoE skips the padding tokens' experts
        mlp_out = None  # a region's MLP output, added to h by the next layer's first region (one launch with its norm)
        for layer in self.model.layers:
            attn = layer.self_attn
            if self.regional_compile and attn.indexer is not None:
                # a sparse (V3.2) layer: the latent cache and the index keys written between the regions
                if mlp_out is None:
                    q_nope, q_pe, kv, q_idx, k_idx, w_idx = _sparse_layer_projections(layer, h, cos, sin)
                else:
                    h, q_nope, q_pe, kv, q_idx, k_idx, w_idx = _sparse_layer_add_projections(layer, h, mlp_out, cos,
                                                                                             sin)
                attn.write_cache_raw(kv, cos, sin, meta)
                attn.indexer.write(k_idx, meta)
                h, mlp_out = _sparse_layer_rest(layer, h, q_nope, q_pe, q_idx, w_idx, region_positions, token_mask,
                                                *flat)
                continue
            if self.regional_compile and attn.sink_window is None:
                # a decode step may write the cache and absorb q (q_pe rotated there) in one op between the regions
                fold = attn.write_absorb_serves(h, meta)
                raw = (False,) if fold else ()  # the regions' rotate_q_pe (their default where not folded)
                if mlp_out is None:
                    q_nope, q_pe, kv = _layer_projections(layer, h, cos, sin, *raw)
                else:
                    h, q_nope, q_pe, kv = _layer_add_projections(layer, h, mlp_out, cos, sin, *raw)
                if fold:  # q_nope holds the whole query rows here (q_pe raw in them)
                    q_abs = attn.write_cache_absorb_q(kv, q_nope, cos, sin, meta)
                    h, mlp_out = _layer_rest_absorbed(layer, h, q_abs, token_mask, *flat)
                    continue
                attn.write_cache_raw(kv, cos, sin, meta)
                h, mlp_out = _layer_rest(layer, h, q_nope, q_pe, kv, cos, sin, region_positions, token_mask, *flat)
                continue
            if mlp_out is not None:
                h, mlp_out = h + mlp_out, None
            h = h + attn(layer.input_layernorm(h), cos, sin, meta, positions)
            h = h + _mlp(layer, layer.post_attention_layernorm(h), token_mask)
        if mlp_out is not None:
            h = h + mlp_out
        h = self.model.norm(h)
        if meta.logits_indices is not None:
            h = h[meta.logits_indices]
        return self.lm_head(h)

    def _with_step_schedule(self, meta: MLAMetadata) -> MLAMetadata:
        """``meta`` with ``decode.schedule`` made by the first dense layer (:meth:`MLAAttention.decode_step_schedule`:
        every dense layer shares its decode backend), where ``step_schedule`` is on, the step has a decode part
        without one and that backend takes one; else ``meta`` itself."""
        d = meta.decode
        if not self.step_schedule or d is None or d.schedule is not None:
            return meta
        dense = next((a for a in self.attentions if a.indexer is None and a.sink_window is None), None)
        schedule = dense.decode_step_schedule(meta) if dense is not None else None
        return meta if schedule is None else dataclasses.replace(meta, decode=dataclasses.replace(d, schedule=schedule))


def _mlp(layer: nn.Module, x: Tensor, token_mask: Tensor | None) -> Tensor:
    """The layer's MLP of ``x [T, hidden]``; an :class:`MLAMoE` also takes the step's ``token_mask [T]``."""
    if isinstance(layer.mlp, MLAMoE):
        return layer.mlp(x, token_mask=token_mask)
    return layer.mlp(x)


@compile_region
def _layer_projections(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor, rotate_q_pe: bool = True
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """The first region of a layer: input norm and the attention projections (no cache access), the latent left
    raw (``MLAAttention.project_raw``): the cache write after the region norms and rotates it in its own launch.
    ``rotate_q_pe=False``: ``(q, None, kv)``, the query rows with q_pe raw (``MLAAttention.write_cache_absorb_q``
    rotates it)."""
    return layer.self_attn.project_raw(layer.input_layernorm(h), cos, sin, rotate_q_pe=rotate_q_pe)


@compile_region
def _layer_add_projections(layer: nn.Module, h: Tensor, mlp_out: Tensor, cos: Tensor, sin: Tensor,
                           rotate_q_pe: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_layer_projections` of ``h + mlp_out`` (the previous layer's MLP residual, added here so that the add
    and the input norm are one kernel, or with the first projections one launch: ``MLAAttention.project_raw_normed``);
    also returns that sum."""
    return layer.self_attn.project_raw_normed(h, mlp_out, layer.input_layernorm, cos, sin, rotate_q_pe)


@compile_region
def _layer_rest(layer: nn.Module, h: Tensor, q_nope: Tensor, q_pe: Tensor, kv: Tensor, cos: Tensor, sin: Tensor,
                positions: Tensor, token_mask: Tensor | None, *flat_meta) -> tuple[Tensor, Tensor]:
    """The second region: attention over the (already written) cache, ``o_proj``, the attention residual and the
    MLP: returns ``(h + attention, mlp output)``, the MLP's residual left to the next layer's first region (or the
    model's end). ``positions``: the step's (a DCP layer's multi-token decode reads them; None where no layer
    does); ``token_mask``: the
    step's real tokens, for the MoE; ``flat_meta``: the step's :meth:`MLAMetadata.flat`. The normed latent and
    rotated k_pe (of the raw ``kv``) feed only a prefill: a decode-only step does not make them (nor does Dynamo
    trace them, at every layer on torch 2.11)."""
    meta = MLAMetadata.from_flat(*flat_meta)
    if meta.prefill is None:
        latent = k_pe = None
    else:
        latent, k_pe = layer.self_attn.finish_kv(kv, cos, sin)
    attention = layer.self_attn.attend(h, q_nope, q_pe, latent, k_pe, cos, sin, meta, positions)
    return _residual_mlp(layer, h, attention, token_mask)


@compile_region
def _layer_rest_absorbed(layer: nn.Module, h: Tensor, q_abs: Tensor, token_mask: Tensor | None, *flat_meta
                         ) -> tuple[Tensor, Tensor]:
    """:func:`_layer_rest` of a decode-only step whose absorbed queries ``q_abs`` came with the cache write
    (``MLAAttention.write_cache_absorb_q``): the decode, ``o_proj``, the attention residual and the MLP."""
    meta = MLAMetadata.from_flat(*flat_meta)
    return _residual_mlp(layer, h, layer.self_attn.attend_absorbed(q_abs, meta), token_mask)


@compile_region
def _sparse_layer_projections(layer: nn.Module, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
    """A sparse (V3.2) layer's first region: the input norm, the attention's and the indexer's projections
    (``MLAAttention.project_sparse``; no cache access)."""
    return layer.self_attn.project_sparse(layer.input_layernorm(h), cos, sin)


@compile_region
def _sparse_layer_add_projections(layer: nn.Module, h: Tensor, mlp_out: Tensor, cos: Tensor, sin: Tensor
                                  ) -> tuple[Tensor, ...]:
    """:func:`_sparse_layer_projections` of ``h + mlp_out`` (the previous layer's MLP residual, added here with the
    input norm); also returns that sum first."""
    h = h + mlp_out
    return (h, *layer.self_attn.project_sparse(layer.input_layernorm(h), cos, sin))


@compile_region
def _sparse_layer_rest(layer: nn.Module, h: Tensor, q_nope: Tensor, q_pe: Tensor, q_idx: Tensor, w_idx: Tensor,
                       positions: Tensor, token_mask: Tensor | None, *flat_meta) -> tuple[Tensor, Tensor]:
    """A sparse layer's second region, after its writes: the indexer's top-k, the attention over it and ``o_proj``
    (``MLAAttention.attend_sparse``), the attention residual and the MLP: ``(h + attention, mlp output)`` as
    :func:`_layer_rest`."""
    meta = MLAMetadata.from_flat(*flat_meta)
    attention = layer.self_attn.attend_sparse(q_nope, q_pe, q_idx, w_idx, positions, meta)
    return _residual_mlp(layer, h, attention, token_mask)


def _residual_mlp(layer: nn.Module, h: Tensor, residual: Tensor, token_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(h + residual, the layer's MLP of its post-attention norm of that sum)``: an :class:`MLAMoE`'s
    :meth:`~MLAMoE.forward_residual` (the add, the norm and the router one launch where
    ``mla::moe_norm_gate_route`` serves), else the add, the norm and :func:`_mlp`."""
    if isinstance(layer.mlp, MLAMoE):
        return layer.mlp.forward_residual(h, residual, layer.post_attention_layernorm, token_mask)
    h = h + residual
    return h, _mlp(layer, layer.post_attention_layernorm(h), token_mask)


SPARSE_MODES = ("sink_window",)


def patch(hf_model: nn.Module, *, backend: str | None = None, moe_impl: str = "auto",
          parallel=None, regional_compile: bool = False, sparse: str | None = None, sink: int | None = None,
          window: int | None = None, **parallel_options) -> MLAForCausalLM | V4ForCausalLM:
    """Convert an HF ``DeepseekV2ForCausalLM``/``DeepseekV3ForCausalLM``/``DeepseekV32ForCausalLM`` in place
    to the paged MLA path (V3.2: sparse attention over the lightning indexer's top-k tokens).

    Every layer's ``self_attn`` becomes an :class:`MLAAttention` and every MoE ``mlp`` an
    :class:`MLAMoE`, both sharing the HF weights. Returns the :class:`MLAForCausalLM` to run; the HF
    model's own ``forward`` is not usable afterwards. ``backend`` picks the attention ops' backend
    (default: ``MLA_COMPILE_BACKEND`` or "auto"); its ``fp8_block_linear=NAME`` entry also sets the fp8 linears'
    (``FP8BlockLinear`` / ``FP8Experts`` without a backend of their own; e.g. ``"fp8_block_linear=autotune"``).

    ``regional_compile``: run each layer as nested compile regions, so ``torch.compile`` compiles a layer once for
    all layers of its shape (:meth:`MLAForCausalLM.forward`, V2/V3/V3.2 layers but sink + window ones, unsharded or
    sharded by ``parallel``, the collectives inside the regions;
    :meth:`~mla_compile.models.v4_model.V4ForCausalLM.forward`, every DeepSeek-V4 layer).

    ``parallel`` (a :class:`~mla_compile.parallel.ParallelConfig` set up by ``mla_compile.parallel.init``, or
    the ``ParallelState`` it returned) shards the model for this rank instead:
    :func:`mla_compile.parallel.shard_model`, which takes ``parallel_options`` (``ep_dispatch``, ``weights``); a
    DeepSeek-V4 model: :func:`mla_compile.parallel.v4.shard_v4` (data-parallel attention or split heads, with expert
    parallelism).

    ``sparse="sink_window"`` (dense-attention V2/V3 models, unsharded or sharded: under DCP each rank attends over
    the sink + window tokens it holds, :class:`~mla_compile.parallel.attention.DCPAttention`) makes every layer's
    decode and prefill attend only to the first ``sink`` (default 4) and the last ``window`` (required) positions of
    each query's causal prefix, through ``mla_compile.ops.sparse_decode``: the model's ``sink_window`` is then
    ``(sink, window)`` and an :class:`~mla_compile.serving.engine.Engine` over it releases the cache blocks outside
    both as the window moves (bounded memory per sequence; not yet under DCP, where the engine keeps every block).
    Those layers are not split into compile regions.
    """
    if sparse is None:
        if sink is not None or window is not None:
            raise TypeError("patch(sink=..., window=...) needs sparse='sink_window'")
    elif sparse not in SPARSE_MODES:
        raise ValueError(f"sparse must be None or one of {SPARSE_MODES}, got {sparse!r}")
    else:
        if window is None:
            raise TypeError("patch(sparse='sink_window') needs window=<tokens each query attends to, itself included>")
        sink_window = check_sink_window(4 if sink is None else sink, window)
        if is_v4_model(getattr(hf_model, "config", None)):
            raise NotImplementedError("patch(sparse='sink_window') serves V2/V3 models (DeepSeek-V4 has its own "
                                      "sliding window): pass sparse=None")
        hf_config = getattr(hf_model, "config", None)
        if hf_config is not None and is_mla_model(hf_config) and MLAConfig.from_hf(hf_config).is_sparse:  # first
            raise NotImplementedError("patch(sparse='sink_window') needs a dense-attention (V2/V3) model; a V3.2 "
                                      "model already selects its tokens with its indexer: pass sparse=None")
    apply_backend_spec(hf_model, backend)  # fp8 linears: "fp8_block_linear=NAME" (sharding copies it)
    if parallel is not None:
        from mla_compile.parallel import ParallelConfig, current, shard_model
        state = current(parallel) if isinstance(parallel, ParallelConfig) else parallel
        if is_v4_model(getattr(hf_model, "config", None)):  # data-parallel attention + EP (mla_compile.parallel.v4)
            from mla_compile.parallel.v4 import shard_v4
            model = shard_v4(hf_model, state, backend=backend or envs.backend(), moe_impl=moe_impl,
                             **parallel_options)
            model.regional_compile = bool(regional_compile)
            return model
        model = shard_model(hf_model, state, backend=backend, moe_impl=moe_impl, **parallel_options)
        model.regional_compile = bool(regional_compile)
        if sparse is not None:
            model.set_sink_window(*sink_window)
        return model
    if parallel_options:
        raise TypeError(f"patch() got {sorted(parallel_options)}: these options need parallel=")
    hf_config = getattr(hf_model, "config", None)
    if is_v4_model(hf_config):  # DeepSeek-V4: sliding / compressed attention with sinks, mHC (mla_compile.models.v4_model)
        model = patch_v4(hf_model, backend=backend or envs.backend(), moe_impl=moe_impl)
        model.regional_compile = bool(regional_compile)
        return model
    if hf_config is None or not is_mla_model(hf_config):
        raise ValueError(f"patch() needs an HF DeepSeek V2/V3 causal LM with an MLA config, got {type(hf_model).__name__}")
    if not (hasattr(hf_model, "model") and hasattr(hf_model, "lm_head") and hasattr(hf_model.model, "layers")):
        raise ValueError(f"patch() needs a ...ForCausalLM with .model.layers and .lm_head, got {type(hf_model).__name__}")
    config = MLAConfig.from_hf(hf_config)
    if sparse is None:
        sink_window = None
    backend = backend or envs.backend()
    for layer in hf_model.model.layers:
        if not isinstance(layer.self_attn, MLAAttention):
            layer.self_attn = MLAAttention(config, layer.self_attn, backend=backend)
        mlp = layer.mlp
        if hasattr(mlp, "gate") and hasattr(mlp, "experts") and not isinstance(mlp, MLAMoE):
            layer.mlp = MLAMoE(mlp, impl=moe_impl, backend=backend,
                               norm_eps=getattr(layer.post_attention_layernorm, "variance_epsilon", None))
    model = MLAForCausalLM(hf_model, config)
    model.regional_compile = bool(regional_compile)
    model.set_sink_window(*(sink_window or (None,)))
    return model
