"""The MLA attention module: DeepSeek projections around the paged-latent-cache ops.

Prefill tokens take the non-absorbed path (latents up-projected by ``kv_b_proj``, qk 192 / v 128);
decode tokens take the absorbed path (``q_nope @ W_UK`` against the 576-wide latent rows, then
``@ W_UV``). Both write their latents into this layer's cache first. Metadata arrives as an argument.

Sink + window layers (``sink_window = (sink, window)``, set by ``patch(..., sparse="sink_window")``) take the
same sparse path for every token: the slots of the first ``sink`` and the last ``window`` positions of its causal
prefix (``mla_compile.ops.sink_window_query_indices``), so no other cache row is ever read and the blocks outside
both may be released (:meth:`mla_compile.serving.block_manager.BlockManager.release_outside`).

Sparse (DeepSeek-V3.2) layers own an :class:`~mla_compile.models.indexer.MLAIndexer`: it picks ``index_topk``
cache slots per token, and *every* token, decode and prefill alike, takes the absorbed path over just
those slots (``mla_compile.ops.sparse_decode`` with one query row per token, as FlashMLA's sparse
prefill does). Cached context (prefix hits, earlier prefill chunks) is covered by the same indices, so
no context chunks are needed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile import envs, ops
from mla_compile.backends import (cached_backend, new_choice_cache, parse_backend_spec, requested_for, takes_plan,
                                  takes_schedule)
from mla_compile.models.cache import fp8_row_bytes
from mla_compile.models.config import MLAConfig
from mla_compile.models.consts import freeze, thaw
from mla_compile.models.indexer import MLAIndexer
from mla_compile.models.metadata import MLAMetadata, query_parts
from mla_compile.ops.context_attention import up_project
from mla_compile.models.rope import apply_rope


def plain_linears(modules: tuple[nn.Module, ...], dtype: torch.dtype) -> bool:
    """Whether every module is exactly ``nn.Linear`` (no subclass), bias-free, with weights of ``dtype``. The type
    is read as ``m.__class__``: Dynamo guards ``type(m)`` with a class guard on the module's type that torch 2.11's
    Dynamo cache cannot save (the warm start then fails the compile)."""
    return all(m.__class__ is nn.Linear and m.bias is None and m.weight.dtype == dtype for m in modules)


def cuda_half(x: Tensor, *like: Tensor | None) -> bool:
    """Whether ``x`` is a CUDA bf16 / fp16 tensor and every tensor of ``like`` has its dtype (a None never does): the
    static fact our few-row kernels need of a call."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and all(t is not None and t.dtype == x.dtype for t in like))


def half_kernel(op: str, x: Tensor, requested: str | None, *like: Tensor | None) -> str | None:
    """The backend ``op`` resolves to for ``x`` (``requested``: a name, "auto" or None) where :func:`cuda_half` holds
    of ``x`` and ``like``, else None. A static choice for a compiled graph."""
    if not cuda_half(x, *like):
        return None
    return ops.resolve(op, x.device, requested, dtype=x.dtype).name


def fp8_pair(x: Tensor, modules: tuple[nn.Module, ...]) -> bool:
    """Whether ``modules`` are two plain fp8 block linears (``FP8BlockLinear``: no backend of their own, one
    ``act_quant``) that ``mla::fp8_block_linear_pair`` runs in one launch for ``x``: CUDA half precision, where its
    "auto" resolves to the Triton backend (GPU-tested). A static choice for a compiled graph."""
    return (len(modules) == 2 and all(getattr(m, "is_fp8_linear", False) and m.backend is None for m in modules)
            and modules[0].act_quant == modules[1].act_quant
            and half_kernel("fp8_block_linear_pair", x, None) == "triton")


def linears(x: Tensor, *modules: nn.Module) -> list[Tensor]:
    """``x`` through one or two linears that share it: ``[m(x) for m in modules]``. Plain bias-free ``nn.Linear``'s
    of x's half-precision dtype on CUDA (:func:`plain_linears`) run as one ``mla::skinny_linear`` (one launch; its
    "auto" picks the GEMV kernel for few rows where that backend is GPU-tested), two plain fp8 block linears as one
    ``mla::fp8_block_linear_pair`` where :func:`fp8_pair` holds; anything else (other quantized or sharded linears,
    CPU) runs each module. A static choice for a compiled graph (device, dtype and module types)."""
    if cuda_half(x) and plain_linears(modules, x.dtype):
        return ops.skinny_linear(x, [m.weight for m in modules])
    if fp8_pair(x, modules):
        a, b = modules
        return list(ops.fp8_block_linear_pair(x, (a.weight, a.weight_scale_inv), (b.weight, b.weight_scale_inv),
                                              act_quant=a.act_quant))
    return [m(x) for m in modules]


def absorb_q(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """``[q_nope @ W_UK | q_pe]`` per head, ``[T, H, Dc + Dr]``. On CUDA with q_nope and W_UK of one half-precision
    dtype, where ``mla::skinny_absorb_q``'s "auto" picks its Triton backend (GPU-tested): that op (the per-head GEMV
    for few tokens, ``mla::absorb_q``'s bmm into place above, one graph for every batch size); elsewhere ``einsum``
    + ``cat`` (which the absorb fusion pass rewrites in compiled graphs). A static choice for a compiled graph."""
    if _skinny_absorb(q_nope, w_uk, ops.skinny_absorb.OP_Q):
        return ops.skinny_absorb_q(q_nope, w_uk, q_pe, backend="triton")
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    return torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)


def absorb_out(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """``out_lat @ W_UV^T`` per head, ``[T, H, v]``: ``mla::skinny_absorb_out`` where its "auto" picks its Triton
    backend (as :func:`absorb_q`), else ``einsum``."""
    if _skinny_absorb(out_lat, w_uv, ops.skinny_absorb.OP_OUT):
        return ops.skinny_absorb_out(out_lat, w_uv, backend="triton").unflatten(-1, (w_uv.shape[0], w_uv.shape[1]))
    return torch.einsum("thc,hvc->thv", out_lat, w_uv)


def _skinny_absorb(x: Tensor, w: Tensor, op: str) -> bool:
    return half_kernel(op, x, None, w) == "triton"


class MLAAttention(nn.Module):
    """Multi-head Latent Attention over a paged latent cache.

    Holds (shares, not copies) the projection modules of an HF DeepSeek attention layer:
    ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj`` (split into W_UK / W_UV views at run time) and ``o_proj``. The cache is the buffer
    ``kv_cache [num_blocks, block_size, kv_lora_rank + rope_dim]`` set by :meth:`set_cache`.

    ``backend``: a name, per-op names (``"decode=flashmla,prefill=sdpa-cudnn"``), "auto", or None
    (``MLA_COMPILE_BACKEND``, read here once). Decode and prefill ask :func:`mla_compile.backends.select_backend`
    once per static configuration (kept in ``_backend_choices``, a constant of compiled graphs), and so
    do the fp8 decode and the sparse decode; an explicit backend that cannot serve it raises.
    ``cuda_graph``: set True by a decode CUDA-graph runner
    so "auto" picks only decode backends that replay with changing lengths.

    A sparse config (V3.2) also wraps the HF layer's ``indexer`` as ``self.indexer`` (an
    :class:`MLAIndexer`); its attention ignores the decode/prefill backends and uses ``ops.sparse_decode``
    (``sparse_decode=<name>`` in ``backend`` picks its backend, else "auto").
    """

    def __init__(self, config: MLAConfig, hf_attn: nn.Module, backend: str | None = None) -> None:
        super().__init__()
        self.config = config
        self._scale = freeze(config.softmax_scale)  # a constant of every graph (models/consts.py says why)
        self._norm_eps = freeze(config.rms_norm_eps)  # the decoder layer's input norm's (HF builds it from the config)
        self.backend = backend
        spec = parse_backend_spec(backend if backend is not None else envs.backend())
        op_names = ("decode", "prefill", "merge", "cache_write", "gather", "decode_fp8", "sparse_decode",
                    "cache_write_fp8", "gather_fp8", "skinny_norm_linear", "decode_absorb_out",
                    "write_latent_cache_absorb_q")
        self._requested = {op: requested_for(op, spec) for op in op_names}
        # a subclass that attends its own way (the DCP attention) never takes the decode-step fold of this class
        self._own_decode = type(self).attend is MLAAttention.attend and type(self)._decode is MLAAttention._decode
        self._choice_token, self._backend_choices = new_choice_cache()
        self.cuda_graph = False
        self.q_proj = getattr(hf_attn, "q_proj", None)
        self.q_a_proj = getattr(hf_attn, "q_a_proj", None)
        self.q_a_layernorm = getattr(hf_attn, "q_a_layernorm", None)
        self.q_b_proj = getattr(hf_attn, "q_b_proj", None)
        self.kv_a_proj_with_mqa = hf_attn.kv_a_proj_with_mqa
        self.kv_a_layernorm = hf_attn.kv_a_layernorm
        self._latent_eps = freeze(self.kv_a_layernorm.variance_epsilon)  # a constant (models/consts.py)
        eps_q = getattr(self.q_a_layernorm, "variance_epsilon", None)
        self._q_a_eps = None if eps_q is None else freeze(eps_q)  # q-LoRA layers' q_a_layernorm (a constant too)
        self.kv_b_proj = hf_attn.kv_b_proj
        self.o_proj = hf_attn.o_proj
        if self.q_proj is None and self.q_b_proj is None:
            raise ValueError(f"{type(hf_attn).__name__} has neither q_proj nor q_a_proj/q_b_proj: not a DeepSeek MLA layer")
        expected = (config.num_heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank)
        if tuple(self.kv_b_proj.weight.shape) != expected:
            raise ValueError(f"kv_b_proj.weight must be {list(expected)} for this config, got {list(self.kv_b_proj.weight.shape)}")
        if self.kv_b_proj.bias is not None:
            raise ValueError("kv_b_proj must have no bias (DeepSeek's has none): the absorbed path folds its weight alone")
        self.register_buffer("kv_cache", None, persistent=False)
        self.sink_window: tuple[int, int] | None = None  # (sink, window) of sink + window attention; None: dense
        self.indexer = None
        if config.is_sparse:
            if getattr(hf_attn, "indexer", None) is None or self.q_a_proj is None:
                raise ValueError(f"a sparse (V3.2) config needs an attention layer with q_a_proj and an indexer, "
                                 f"got {type(hf_attn).__name__}")
            self.indexer = MLAIndexer(config, hf_attn.indexer)

    def set_cache(self, kv_cache: Tensor) -> None:
        """Attach this layer's paged latent cache: float ``[num_blocks, block_size, kv_lora_rank + rope_dim]``
        or the fp8 rows ``uint8 [num_blocks, block_size, fp8_row_bytes(kv_lora_rank, rope_dim)]``."""
        c = self.config
        width = fp8_row_bytes(c.kv_lora_rank, c.qk_rope_head_dim) if kv_cache.dtype == torch.uint8 else c.latent_dim
        if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
            raise ValueError(f"kv_cache must be float [num_blocks, block_size, {c.latent_dim}] or uint8 fp8 rows "
                             f"[num_blocks, block_size, {fp8_row_bytes(c.kv_lora_rank, c.qk_rope_head_dim)}], "
                             f"got {kv_cache.dtype} {list(kv_cache.shape)}")
        # a cache lives at one address for its lifetime: Inductor's CUDA graphs (mode="reduce-overhead")
        # then take its in-place writes instead of skipping the graph for "mutated inputs"
        torch._dynamo.mark_static_address(kv_cache, guard=False)
        self.kv_cache = kv_cache

    @property
    def fp8_cache(self) -> bool:
        """Whether the latent cache holds the 656-byte fp8 rows (static for a compiled graph)."""
        return self.kv_cache is not None and self.kv_cache.dtype == torch.uint8

    def _w_uk_uv(self) -> tuple[Tensor, Tensor]:
        """Views of kv_b_proj: ``W_UK [H, nope, Dc]`` and ``W_UV [H, v, Dc]``."""
        c = self.config
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: MLAMetadata, positions: Tensor | None = None) -> Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; tokens ordered decode first, then prefill.
        ``positions [T]`` is needed by sparse (V3.2) layers only. :meth:`project`, :meth:`write_cache`, then
        :meth:`attend` (the model's regional compilation calls them apart, the cache write between regions)."""
        if self.kv_cache is None:
            raise RuntimeError("MLAAttention has no cache: call MLAForCausalLM.allocate_cache(...) first")
        # the indexer of a sparse (V3.2) layer reads the normed q_a_proj output too; dense layers leave it to project
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if self.q_proj is None and self.indexer is not None else None
        q_nope, q_pe, latent, k_pe = self.project(x, cos, sin, q_resid)
        self.write_cache(latent, k_pe, meta)
        return self.attend(x, q_nope, q_pe, latent, k_pe, cos, sin, meta, positions, q_resid)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, q_resid: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The projections of ``x [T, hidden]``, no cache access: ``q_nope [T, H, nope]``, ``q_pe [T, H, rope]``
        (rotated), ``latent [T, kv_lora_rank]`` (normed), ``k_pe [T, rope]`` (rotated). ``q_resid``: the
        normed ``q_a_proj`` output of a q-LoRA layer (computed here when None)."""
        q_nope, q_pe, kv = self.project_raw(x, cos, sin, q_resid)
        return (q_nope, q_pe, *self.finish_kv(kv, cos, sin))

    def _kv_parts(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """``(latent, k_pe)``: views of the raw ``kv_a_proj_with_mqa`` output ``kv [T, kv_lora_rank + rope]``."""
        return kv.split([self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1)

    def _q_parts(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """``(q_nope, q_pe)``: views of the heads' query rows ``q [T, H, qk_head_dim]``."""
        return q.split([self.config.qk_nope_head_dim, self.config.qk_rope_head_dim], dim=-1)

    def finish_kv(self, kv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """``latent [T, kv_lora_rank]`` (normed) and ``k_pe [T, rope]`` (rotated) of the raw ``kv_a_proj_with_mqa``
        output ``kv [T, kv_lora_rank + rope]``."""
        latent, k_pe = self._kv_parts(kv)
        return self.kv_a_layernorm(latent), apply_rope(k_pe, cos, sin, self.config.rope_interleave)

    def project_raw(self, x: Tensor, cos: Tensor, sin: Tensor, q_resid: Tensor | None = None,
                    rotate_q_pe: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`project` up to the latent: ``q_nope``, ``q_pe`` (rotated) and the raw ``kv_a_proj_with_mqa`` output
        ``kv [T, kv_lora_rank + rope]`` (neither normed nor rotated: :meth:`finish_kv`). Without ``rotate_q_pe``:
        ``(q [T, H, qk_head_dim], None, kv)``, the heads' whole query rows with q_pe raw in them (for
        :meth:`write_cache_absorb_q`; a compile region may not return two views of one tensor)."""
        if self.q_proj is not None:
            q, kv = linears(x, self.q_proj, self.kv_a_proj_with_mqa)
        else:
            if q_resid is None:
                q_a, kv = linears(x, self.q_a_proj, self.kv_a_proj_with_mqa)
                q_resid = self.q_a_layernorm(q_a)
            else:
                kv, = linears(x, self.kv_a_proj_with_mqa)
            q, = linears(q_resid, self.q_b_proj)
        return self._split_q(q, kv, cos, sin, rotate_q_pe)

    def _split_q(self, q: Tensor, kv: Tensor, cos: Tensor, sin: Tensor, rotate_q_pe: bool = True
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """``q [T, H * qk_head_dim]`` as ``(q_nope, rotated q_pe)``, then ``kv`` as it is; without ``rotate_q_pe``
        ``(q [T, H, qk_head_dim], None, kv)`` (:meth:`project_raw`)."""
        c = self.config
        q = q.unflatten(-1, (c.num_heads, c.qk_head_dim))
        if not rotate_q_pe:
            return q, None, kv
        q_nope, q_pe = self._q_parts(q)
        return q_nope, apply_rope(q_pe, cos, sin, c.rope_interleave), kv

    def project_raw_normed(self, h: Tensor, residual: Tensor, norm: nn.Module, cos: Tensor, sin: Tensor,
                           rotate_q_pe: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`project_raw` of ``norm(h + residual)`` (``norm``: the decoder layer's input RMSNorm, of eps
        ``config.rms_norm_eps``), the sum first: ``(h + residual, q_nope, q_pe, kv)``. Where ``mla::skinny_norm_linear``
        serves (:meth:`_norm_linear_serves`) the add, the norm and the first projections are one launch (and a q-LoRA
        layer's ``q_a_layernorm`` and ``q_b_proj`` another); elsewhere the add, ``norm`` and :meth:`project_raw`
        (``rotate_q_pe`` as there)."""
        first = self.q_proj if self.q_proj is not None else self.q_a_proj
        if self._norm_linear_serves(h, norm, first):
            h, (q, kv) = ops.skinny_norm_linear(h, residual, norm.weight, thaw(self._norm_eps),
                                                [first.weight, self.kv_a_proj_with_mqa.weight], backend="triton")
            if self.q_proj is None:
                q = self._q_b(q)
            return (h, *self._split_q(q, kv, cos, sin, rotate_q_pe))
        h = h + residual
        return (h, *self.project_raw(norm(h), cos, sin, rotate_q_pe=rotate_q_pe))

    def project_sparse(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, ...]:
        """A sparse (V3.2) layer's projections of ``x [T, hidden]`` (after the input norm), no cache access:
        ``(q_nope, q_pe, kv, q_idx, k_idx, w_idx)``, :meth:`project_raw`'s (``kv`` raw) then the indexer's
        (:meth:`~mla_compile.models.indexer.MLAIndexer.project`), both from one ``q_a_proj`` output."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        return (*self.project_raw(x, cos, sin, q_resid), *self.indexer.project(x, q_resid, cos, sin))

    def attend_sparse(self, q_nope: Tensor, q_pe: Tensor, q_idx: Tensor, w_idx: Tensor, positions: Tensor,
                      meta: MLAMetadata) -> Tensor:
        """A sparse (V3.2) layer's attention after its cache and index-key writes: the indexer's top-k over the
        index cache (:meth:`~mla_compile.models.indexer.MLAIndexer.select`), the attention over those slots and
        ``o_proj``: ``[T, hidden]``. Reads the caches, writes nothing."""
        indices = self.indexer.select(q_idx, w_idx, positions, meta)
        return linears(self._sparse(q_nope, q_pe, indices).flatten(1), self.o_proj)[0]

    def _q_b(self, q_a: Tensor) -> Tensor:
        """``q_b_proj(q_a_layernorm(q_a))`` of a q-LoRA layer where :meth:`_norm_linear_serves`: one
        ``mla::skinny_norm_linear`` launch (no residual) when the norm and ``q_b_proj`` are plain and of q_a's dtype,
        else the norm and :func:`linears`."""
        weight = getattr(self.q_a_layernorm, "weight", None)
        if (self._q_a_eps is not None and weight is not None and weight.dtype == q_a.dtype
                and plain_linears((self.q_b_proj,), q_a.dtype)):
            _, (q,) = ops.skinny_norm_linear(q_a, None, weight, thaw(self._q_a_eps), [self.q_b_proj.weight],
                                             backend="triton")
            return q
        return linears(self.q_a_layernorm(q_a), self.q_b_proj)[0]

    def _norm_linear_serves(self, h: Tensor, norm: nn.Module, first: nn.Module) -> bool:
        """A static choice for a compiled graph: CUDA half-precision ``h``, plain linears, a norm weight of h's dtype
        and ``mla::skinny_norm_linear``'s backend resolving to "triton" (its "auto" once the kernel is GPU-tested;
        ``backend="skinny_norm_linear=triton"`` or ``MLA_COMPILE_BACKEND`` asks for it by name)."""
        if not plain_linears((first, self.kv_a_proj_with_mqa), h.dtype):
            return False
        return half_kernel("skinny_norm_linear", h, self._requested["skinny_norm_linear"],
                           getattr(norm, "weight", None)) == "triton"

    def real_tokens(self, meta: MLAMetadata) -> Tensor | None:
        """``[T]`` bool, True for the step's real tokens: padding tokens (to a captured size, a ``min_batch``, a
        data-parallel step shape) have slot -1 in every step kind. What the model hands the MoE so it skips the
        padding's expert work; None where the slots do not tell padding apart (a cache split by token)."""
        return meta.slot_mapping >= 0

    @property
    def softmax_scale(self) -> float:
        """The attention's softmax scale (``config.softmax_scale``), a compile-time constant."""
        return thaw(self._scale)

    def write_cache(self, latent: Tensor, k_pe: Tensor, meta: MLAMetadata) -> None:
        """Write this step's latent rows into the paged cache at ``meta.slot_mapping`` (the layer's only write
        besides a sparse layer's index keys)."""
        cache = self._require_cache()
        write = ops.write_latent_cache_fp8 if self.fp8_cache else ops.write_latent_cache
        write_backend = self._write_backend()
        write(latent, k_pe, meta.slot_mapping, cache, backend=None if write_backend == "auto" else write_backend)

    def _require_cache(self) -> Tensor:
        """The layer's cache; a RuntimeError when none is allocated yet."""
        if self.kv_cache is None:
            raise RuntimeError("MLAAttention has no cache: call MLAForCausalLM.allocate_cache(...) first")
        return self.kv_cache

    def _write_backend(self) -> str:
        """The cache write's backend as asked for ("auto" unless named), for the cache's format."""
        return self._requested["cache_write_fp8" if self.fp8_cache else "cache_write"]

    def write_cache_raw(self, kv: Tensor, cos: Tensor, sin: Tensor, meta: MLAMetadata) -> None:
        """:meth:`write_cache` of the raw ``kv [T, kv_lora_rank + rope]`` (as :meth:`project_raw` returns it): with the
        cache write's backend "auto", the latent norm, k_pe's RoPE and the write (quantizing into an fp8 cache) are
        one ``mla::write_latent_cache_fused`` call; a backend asked for by name gets :meth:`finish_kv`'s rows."""
        if self._write_backend() != "auto":
            self.write_cache(*self.finish_kv(kv, cos, sin), meta)
            return
        c, norm = self.config, self.kv_a_layernorm
        latent, k_pe = self._kv_parts(kv)
        torch.ops.mla.write_latent_cache_fused(latent, k_pe, norm.weight, cos, sin, meta.slot_mapping,
                                               self._require_cache(), thaw(self._latent_eps), c.rope_interleave)

    def write_absorb_serves(self, x: Tensor, meta: MLAMetadata) -> bool:
        """Whether a regional step takes :meth:`write_cache_absorb_q` between its regions (a static choice): a
        decode-only step of a dense layer of this class (not a subclass with its own ``attend`` / ``_decode``), the
        cache write's backend "auto" (the fused write), CUDA half-precision hidden states ``x`` (the queries' device
        and dtype) with W_UK of their dtype, and ``mla::write_latent_cache_absorb_q``'s backend resolving to "triton"
        (its "auto" on a GPU; ``backend="write_latent_cache_absorb_q=reference"`` keeps the write and absorb_q
        apart)."""
        if (not self._own_decode or self.indexer is not None or self.sink_window is not None
                or meta.prefill is not None or meta.decode is None or self._write_backend() != "auto"):
            return False
        return half_kernel("write_latent_cache_absorb_q", x, self._requested["write_latent_cache_absorb_q"],
                           self.kv_b_proj.weight) == "triton"

    def write_cache_absorb_q(self, kv: Tensor, q: Tensor, cos: Tensor, sin: Tensor, meta: MLAMetadata) -> Tensor:
        """:meth:`write_cache_raw` of ``kv`` and the absorbed queries ``q_abs [T, H, kv_lora_rank + rope]`` of the
        query rows ``q [T, H, qk_head_dim]`` (q_pe raw: rotated here; :meth:`project_raw` without ``rotate_q_pe``) in
        one ``mla::write_latent_cache_absorb_q`` call (where :meth:`write_absorb_serves`; the step then attends with
        :meth:`attend_absorbed`)."""
        c, norm = self.config, self.kv_a_layernorm
        latent, k_pe = self._kv_parts(kv)
        q_nope, q_pe = self._q_parts(q)
        return ops.write_latent_cache_absorb_q(latent, k_pe, norm.weight, cos, sin, meta.slot_mapping,
                                               self._require_cache(), thaw(self._latent_eps), c.rope_interleave,
                                               q_nope, self._w_uk_uv()[0], q_pe, backend="triton")

    def attend_absorbed(self, q_abs: Tensor, meta: MLAMetadata) -> Tensor:
        """:meth:`attend` of a decode-only step from its absorbed queries ``q_abs [T, H, kv_lora_rank + rope]``
        (:meth:`write_cache_absorb_q`): the decode over the cache, the up-projection and ``o_proj``: ``[T, hidden]``."""
        return linears(self._decode_absorbed(q_abs, meta).flatten(1), self.o_proj)[0]

    def attend(self, x: Tensor, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor,
               meta: MLAMetadata, positions: Tensor | None = None, q_resid: Tensor | None = None) -> Tensor:
        """Attention of this step's queries over the cache (written by :meth:`write_cache`) and ``o_proj``:
        ``[T, hidden]``. Dense layers only read the cache here; a sparse (V3.2) layer's indexer also writes its
        index keys (it needs ``x``, ``q_resid``, ``positions``)."""
        if self.indexer is not None:
            if positions is None:
                raise ValueError("a sparse (V3.2) MLAAttention needs positions [T] (MLAForCausalLM passes them)")
            indices = self.indexer(x, q_resid, cos, sin, positions, meta)
            out = self._sparse(q_nope, q_pe, indices)
        elif self.sink_window is not None:
            if positions is None:
                raise ValueError("a sink + window MLAAttention needs positions [T] (MLAForCausalLM passes them)")
            out = self._sparse(q_nope, q_pe, self._sink_window_indices(meta, positions))
        elif meta.prefill is None:  # a step of one kind takes every token: no slice at a symbolic bound
            out = self._decode(q_nope, q_pe, meta)
        elif meta.decode is None:
            out = self._prefill(q_nope, q_pe, latent, k_pe, meta)
        else:  # decode tokens first, then prefill
            n_dec = meta.decode.num_tokens
            out = torch.cat([self._decode(q_nope[:n_dec], q_pe[:n_dec], meta),
                             self._prefill(q_nope[n_dec:], q_pe[n_dec:], latent[n_dec:], k_pe[n_dec:], meta)])
        return linears(out.flatten(1), self.o_proj)[0]  # [T, H * v_head_dim]

    def _decode(self, q_nope: Tensor, q_pe: Tensor, meta: MLAMetadata) -> Tensor:
        """Absorbed path: ``[n_dec, H, v_head_dim]``."""
        return self._decode_absorbed(absorb_q(q_nope, self._w_uk_uv()[0], q_pe), meta)

    def _decode_absorbed(self, q_abs: Tensor, meta: MLAMetadata) -> Tensor:
        """:meth:`_decode` from the absorbed queries ``q_abs [n_dec, H, kv_lora_rank + rope]``."""
        c, d = self.config, meta.decode
        w_uv = self._w_uk_uv()[1]
        if d.query_len == 1:  # [B, 1, H, D]: an unsqueeze, no symbolic size for Dynamo to trace
            q_abs = q_abs.unsqueeze(1)
        else:
            q_abs = q_abs.view(d.block_table.shape[0], d.query_len, c.num_heads, c.latent_dim)
        if self.fp8_cache:
            name = self._backend("decode_fp8", q_abs.dtype, head_dims=(c.kv_lora_rank, c.qk_rope_head_dim),
                                 query_len=d.query_len, need_lse=False, capacity=self._capacity(d))
            out_lat, _ = ops.decode_fp8(q_abs, self.kv_cache, d.block_table, d.seq_lens, self.softmax_scale,
                                        kv_lora_rank=c.kv_lora_rank, backend=name)
        else:
            plan = getattr(d, "plan", None)  # a host-side plan (FlashInfer) made by the metadata builder, if any
            fused = self._decode_absorb_backend(q_abs, w_uv, d)
            if fused is not None:  # the decode, its split merge and W_UV: mla::decode_absorb_out
                out = ops.decode_absorb_out(q_abs, self.kv_cache, d.block_table, d.seq_lens, self.softmax_scale,
                                            kv_lora_rank=c.kv_lora_rank, w_uv=w_uv, backend=fused)
                return out.unflatten(-1, (c.num_heads, c.v_head_dim))
            name = self._decode_name(q_abs.dtype, d)
            schedule = getattr(d, "schedule", None)
            schedule = schedule if schedule is not None and takes_schedule("decode", name) else None
            out_lat, _ = ops.decode(q_abs, self.kv_cache, d.block_table, d.seq_lens, self.softmax_scale,
                                    kv_lora_rank=c.kv_lora_rank, backend=name,
                                    plan=plan if takes_plan("decode", name) else None, schedule=schedule)
        out_lat = out_lat.flatten(0, 1)  # [B * s_q, H, kv_lora_rank]
        return absorb_out(out_lat, w_uv)

    def _capacity(self, d) -> int:
        """The most tokens a sequence's block table holds in decode ``d`` (its width times the cache's page size)."""
        return d.block_table.shape[1] * self.kv_cache.shape[1]

    def _decode_name(self, dtype: torch.dtype, d) -> str:
        """The backend of this layer's bf16 / fp16 cache decode of ``d`` (a :class:`DecodeMetadata`)."""
        c = self.config
        return self._backend("decode", dtype, head_dims=(c.kv_lora_rank, c.qk_rope_head_dim), query_len=d.query_len,
                             need_lse=False, planned=getattr(d, "plan", None) is not None, capacity=self._capacity(d))

    def decode_step_schedule(self, meta: MLAMetadata) -> tuple[Tensor, ...] | None:
        """The step schedule this layer's decode backend takes (``ops.decode_step_schedule``: FlashMLA's split
        schedule, made from the step's lengths), to be made once before the layers and shared by all of them as
        ``meta.decode.schedule``; None when its decode takes none (no decode part, an fp8 cache, sparse attention,
        a backend without one, or ``mla::decode_absorb_out`` in its place: that op reads no schedule)."""
        d = meta.decode
        if d is None or self.kv_cache is None or self.fp8_cache or self.indexer is not None or \
                self.sink_window is not None or not self._own_decode:
            return None
        if self._decode_absorb_backend(self.kv_cache, self._w_uk_uv()[1], d) is not None:  # (the cache: q's dtype)
            return None
        name = self._decode_name(self.kv_cache.dtype, d)
        if not takes_schedule("decode", name):
            return None
        return ops.decode_step_schedule(d.seq_lens, self.config.num_heads, name, d.query_len)

    def _decode_absorb_backend(self, q_abs: Tensor, w_uv: Tensor, d) -> str | None:
        """``mla::decode_absorb_out``'s backend for decode ``d`` (a :class:`DecodeMetadata`, or None; a static
        choice), or None to run ``mla::decode`` and ``absorb_out`` apart: CUDA half-precision q and W_UV of its
        dtype, no host plan, and that op's backend resolving to "triton" or "gluon". Asked by name
        (``backend="decode_absorb_out=gluon"``) it is taken; under "auto" (the reference until the kernels are
        GPU-tested, never taken here) only where this layer's own decode choice for ``d`` is that same split
        kernel, since the op runs that kernel's decode at every size."""
        if getattr(d, "plan", None) is not None:
            return None
        requested = self._requested["decode_absorb_out"]
        name = half_kernel("decode_absorb_out", q_abs, requested, w_uv)
        if name not in ("triton", "gluon"):
            return None
        if requested in (None, "auto") and (d is None or self._decode_name(q_abs.dtype, d) != name):
            return None
        return name

    def _sink_window_indices(self, meta: MLAMetadata, positions: Tensor) -> Tensor:
        """``int32 [T, sink + window]``: each token's sink and window slots over its causal prefix (-1 padded)."""
        sink, window = self.sink_window
        i32 = torch.int32
        parts = [ops.sink_window_query_indices(table, query_seq.to(i32), query_pos.to(i32),
                                               block_size=self.kv_cache.shape[1], sink=sink, window=window)
                 for table, _, query_seq, query_pos in query_parts(meta, positions)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _sparse(self, q_nope: Tensor, q_pe: Tensor, indices: Tensor) -> Tensor:
        """Absorbed attention of every token over its selected slots ``indices [T, topk]``: ``[T, H, v_head_dim]``."""
        c = self.config
        w_uk, w_uv = self._w_uk_uv()
        q_abs = absorb_q(q_nope, w_uk, q_pe)
        name = self._backend("sparse_decode", q_abs.dtype, head_dims=(c.kv_lora_rank, c.qk_rope_head_dim),
                             need_lse=False)
        out_lat, _ = ops.sparse_decode(q_abs, self.kv_cache, indices, self.softmax_scale, kv_lora_rank=c.kv_lora_rank,
                                       backend=name)
        return absorb_out(out_lat, w_uv)

    def _prefill(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, meta: MLAMetadata) -> Tensor:
        """Non-absorbed path: ``[n_pre, H, v_head_dim]``. New tokens attend causally to each other, then
        to their cached context slice by slice (one op whatever the slice count; bounded workspace),
        merged by LSE."""
        c, p = self.config, meta.prefill
        q = torch.cat([q_nope, q_pe], dim=-1)
        k, v = up_project(latent, k_pe, self.kv_b_proj.weight, c.num_heads, c.qk_nope_head_dim, c.v_head_dim)
        plan = getattr(p, "plan", None)  # a host-side plan (FlashInfer) for the causal call, if the builder made one
        name = self._backend("prefill", q.dtype, head_dims=(c.qk_head_dim, c.v_head_dim), planned=plan is not None)
        out, lse = ops.prefill(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, self.softmax_scale, causal=True,
                               backend=name, plan=plan if takes_plan("prefill", name) else None)
        if p.context is not None:
            ctx = p.context
            out, lse = ops.context_attention(
                q, out, lse, self.kv_cache, p.block_table, p.cu_seqlens_q, ctx.cu_seqlens, ctx.starts, ctx.rows,
                self.kv_b_proj.weight, self.softmax_scale, kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim,
                prefill_backend=self._backend("prefill", q.dtype, head_dims=(c.qk_head_dim, c.v_head_dim)),
                merge_backend=self._backend("merge", out.dtype, head_dims=(c.v_head_dim,)),
                gather_backend=self._requested["gather_fp8" if self.fp8_cache else "gather"])
        return out

    def _backend(self, op: str, dtype: torch.dtype, *, head_dims: tuple[int, ...], query_len: int = 1,
                 need_lse: bool = True, planned: bool = False, capacity: int | None = None) -> str:
        """The backend of ``op`` for this layer's static configuration (selected once, then cached);
        ``capacity``: a paged decode's block-table capacity in tokens (its timing class: see
        :attr:`mla_compile.ops.select.Facts.capacity`)."""
        cache = self.kv_cache
        paged = op in ("decode", "decode_fp8", "sparse_decode")  # the ops that read the paged cache
        return cached_backend(self._choice_token, op, self._requested[op], device=cache.device, dtype=dtype,
                              cache_dtype=cache.dtype if paged else dtype,
                              block_size=cache.shape[1] if paged else None,
                              num_heads=self.config.num_heads, head_dims=head_dims, query_len=query_len,
                              need_lse=need_lse, planned=planned,
                              cuda_graph=self.cuda_graph and op in ("decode", "decode_fp8"),
                              cache_strides=tuple(cache.stride()) if paged else None,
                              row_width=cache.shape[-1] if paged else None, capacity=capacity)
