"""MLA attention with decode context parallelism inside the model (as vLLM's DCP).

:class:`DCPAttention` is :class:`~mla_compile.models.attention.MLAAttention` over this rank's part of every sequence's
latent cache (block-interleaved by :mod:`mla_compile.parallel.dcp`; the step's metadata is this rank's, from
:func:`mla_compile.parallel.dcp.plan_dcp_step`), bf16 or fp8 (the 656-byte rows). Every token's latent row is
written only by the rank that holds it (the others get slot -1). Decode: the absorbed queries of the DCP group's
heads are all-gathered, each rank attends over its tokens (``(out, lse)``), the parts are all-gathered and merged by LSE, and each rank keeps its
own heads for ``W_UV`` and ``o_proj``. Prefill of new tokens attends to the step's own latents (no cache read), as
without DCP; over cached context (prefix hits, chunked prefill) the group's queries and ``kv_b_proj`` rows are
all-gathered, each rank attends over its context tokens and the parts are merged by LSE.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.models.attention import MLAAttention
from mla_compile.backends import cached_backend
from mla_compile.models.config import MLAConfig
from mla_compile.models.metadata import MLAMetadata
from mla_compile.ops.context_attention import up_project
from mla_compile.parallel.dcp import merge_parts
from mla_compile.parallel.groups import Group
from mla_compile.parallel.layers import all_gather


class DCPAttention(MLAAttention):
    """:class:`MLAAttention` (this rank's heads) over this rank's part of the cache, merged over ``dcp``."""

    def __init__(self, config: MLAConfig, hf_attn: nn.Module, dcp: Group, backend: str | None = None) -> None:
        super().__init__(config, hf_attn, backend=backend)
        self.dcp = dcp

    def _decode(self, q_nope: Tensor, q_pe: Tensor, meta: MLAMetadata) -> Tensor:
        """Absorbed decode over the split cache: ``[n_dec, H_local, v_head_dim]``."""
        c, d = self.config, meta.decode
        if d.query_len != 1:
            raise NotImplementedError(f"DCPAttention: query_len={d.query_len}; split-cache decode takes one query "
                                      "per sequence (the causal mask of s_q > 1 spans the ranks' parts)")
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        q_abs = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)
        q_all = all_gather(q_abs, 1, self.dcp)  # the DCP group's heads, in head order
        heads = c.num_heads * self.dcp.size
        op = "decode_fp8" if self.fp8_cache else "decode"
        name = cached_backend(self._choice_token, op, self._requested[op], device=self.kv_cache.device,
                              dtype=q_all.dtype, cache_dtype=self.kv_cache.dtype, block_size=self.kv_cache.shape[1],
                              num_heads=heads, head_dims=(c.kv_lora_rank, c.qk_rope_head_dim), need_lse=True,
                              cuda_graph=self.cuda_graph, cache_strides=tuple(self.kv_cache.stride()),
                              row_width=self.kv_cache.shape[-1])
        decode = ops.decode_fp8 if self.fp8_cache else ops.decode
        out, lse = decode(q_all, self.kv_cache, d.block_table, d.seq_lens, c.softmax_scale,
                          kv_lora_rank=c.kv_lora_rank, backend=name)
        out, _ = merge_parts(all_gather(out.unsqueeze(0), 0, self.dcp), all_gather(lse.unsqueeze(0), 0, self.dcp))
        out = out.narrow(1, self.dcp.rank * c.num_heads, c.num_heads)
        return torch.einsum("thc,hvc->thv", out, w_uv)

    def _heads_backend(self, op: str, dtype: torch.dtype, heads: int, head_dims: tuple[int, ...]) -> str:
        """The backend of ``op`` for ``heads`` heads (the DCP group's), selected once like ``_backend``."""
        return cached_backend(self._choice_token, op, self._requested[op], device=self.kv_cache.device, dtype=dtype,
                              cache_dtype=dtype, block_size=None, num_heads=heads, head_dims=head_dims)

    def _prefill(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, meta: MLAMetadata) -> Tensor:
        """New tokens over themselves (this rank's heads, as :class:`MLAAttention`), then over the cached
        context split across the DCP group: the group's queries and ``kv_b_proj`` rows are all-gathered, each
        rank attends over its context tokens, the parts are all-gathered and merged by LSE, and this rank's
        heads are merged into the causal part."""
        p = meta.prefill
        if p.context is None:
            return super()._prefill(q_nope, q_pe, latent, k_pe, meta)
        c, P = self.config, self.dcp.size
        q = torch.cat([q_nope, q_pe], dim=-1)
        k, v = up_project(latent, k_pe, self.kv_b_proj.weight, c.num_heads, c.qk_nope_head_dim, c.v_head_dim)
        out, lse = ops.prefill(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, c.softmax_scale, causal=True,
                               backend=self._backend("prefill", q.dtype, head_dims=(c.qk_head_dim, c.v_head_dim)))
        q_all = all_gather(q, 1, self.dcp)
        w_all = all_gather(self.kv_b_proj.weight, 0, self.dcp)  # the group's heads' W_UK / W_UV, in head order
        n, heads = q.shape[0], c.num_heads * P
        empty_out = q.new_zeros(n, heads, c.v_head_dim)
        empty_lse = torch.full((n, heads), float("-inf"), dtype=torch.float32, device=q.device)
        ctx = p.context
        ctx_out, ctx_lse = ops.context_attention(
            q_all, empty_out, empty_lse, self.kv_cache, p.block_table, p.cu_seqlens_q, ctx.cu_seqlens, ctx.starts,
            ctx.rows, w_all, c.softmax_scale, kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim,
            prefill_backend=self._heads_backend("prefill", q.dtype, heads, (c.qk_head_dim, c.v_head_dim)),
            merge_backend=self._heads_backend("merge", q.dtype, heads, (c.v_head_dim,)),
            gather_backend=self._requested["gather_fp8" if self.fp8_cache else "gather"])
        ctx_out, ctx_lse = merge_parts(all_gather(ctx_out.unsqueeze(0), 0, self.dcp),
                                       all_gather(ctx_lse.unsqueeze(0), 0, self.dcp))
        h0 = self.dcp.rank * c.num_heads
        out, _ = ops.merge_attn_states(out, lse, ctx_out.narrow(1, h0, c.num_heads).contiguous(),
                                       ctx_lse.narrow(1, h0, c.num_heads).contiguous())
        return out
