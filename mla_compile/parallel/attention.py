"""MLA attention with decode context parallelism inside the model (as vLLM's DCP).

:class:`DCPAttention` is :class:`~mla_compile.attention.MLAAttention` over this rank's part of every sequence's
latent cache (block-interleaved by :mod:`mla_compile.parallel.dcp`; the step's metadata is this rank's, from
:func:`mla_compile.parallel.dcp.plan_dcp_step`). Every token's latent row is written only by the rank that holds
it (the others get slot -1). Decode: the absorbed queries of the DCP group's heads are all-gathered, each rank
attends over its tokens (``(out, lse)``), the parts are all-gathered and merged by LSE, and each rank keeps its
own heads for ``W_UV`` and ``o_proj``. Prefill of new tokens attends to the step's own latents (no cache read), as
without DCP; prefill over cached context (prefix hits, chunked prefill) is not split yet.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.attention import MLAAttention
from mla_compile.backends import cached_backend
from mla_compile.config import MLAConfig
from mla_compile.metadata import MLAMetadata
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
        if self.fp8_cache:
            raise NotImplementedError("DCPAttention: the fp8 latent cache is not split by token yet")
        if d.query_len != 1:
            raise NotImplementedError(f"DCPAttention: query_len={d.query_len}; split-cache decode takes one query "
                                      "per sequence (the causal mask of s_q > 1 spans the ranks' parts)")
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        q_abs = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)
        q_all = all_gather(q_abs, 1, self.dcp)  # the DCP group's heads, in head order
        heads = c.num_heads * self.dcp.size
        name = cached_backend(self._choice_token, "decode", self._requested["decode"], device=self.kv_cache.device,
                              dtype=q_all.dtype, cache_dtype=self.kv_cache.dtype, block_size=self.kv_cache.shape[1],
                              num_heads=heads, head_dims=(c.kv_lora_rank, c.qk_rope_head_dim), need_lse=True,
                              cuda_graph=self.cuda_graph, cache_strides=tuple(self.kv_cache.stride()),
                              row_width=self.kv_cache.shape[-1])
        out, lse = ops.decode(q_all, self.kv_cache, d.block_table, d.seq_lens, c.softmax_scale,
                              kv_lora_rank=c.kv_lora_rank, backend=name)
        out, _ = merge_parts(all_gather(out.unsqueeze(0), 0, self.dcp), all_gather(lse.unsqueeze(0), 0, self.dcp))
        out = out.narrow(1, self.dcp.rank * c.num_heads, c.num_heads)
        return torch.einsum("thc,hvc->thv", out, w_uv)

    def _prefill(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, meta: MLAMetadata) -> Tensor:
        """New tokens over themselves (as :class:`MLAAttention`); cached context is not split yet."""
        if meta.prefill.context is not None:
            raise NotImplementedError("DCPAttention: prefill over cached context (prefix hits, chunked prefill) "
                                      "is not split by token yet; plan_dcp_step refuses such steps")
        return super()._prefill(q_nope, q_pe, latent, k_pe, meta)
