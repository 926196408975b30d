"""MLA attention with decode context parallelism inside the model (as vLLM's DCP).

:class:`DCPAttention` is :class:`~mla_compile.models.attention.MLAAttention` over this rank's part of every sequence's
latent cache (block-interleaved by :mod:`mla_compile.parallel.dcp`; the step's metadata is this rank's, from
:func:`mla_compile.parallel.dcp.plan_dcp_step`), bf16 or fp8 (the 656-byte rows). Every token's latent row is
written only by the rank that holds it (the others get slot -1). Decode: the absorbed queries of the DCP group's
heads are all-gathered, each rank attends over its tokens (``(out, lse)``), the parts are all-gathered and merged by LSE, and each rank keeps its
own heads for ``W_UV`` and ``o_proj``. Prefill of new tokens attends to the step's own latents (no cache read), as
without DCP; over cached context (prefix hits, chunked prefill) the group's queries and ``kv_b_proj`` rows are
all-gathered, each rank attends over its context tokens and the parts are merged by LSE.

Multi-token decode (``query_len = s_q > 1``, causal within the new tokens): each query is a row of its own over
this rank's part, seeing the ``local_seq_lens(position + 1)`` first local tokens (its causal limit in this part,
from the step's ``positions``), so the parts merge exactly as for one query.

Sparse (V3.2) layers: the indexer (:class:`DCPIndexer`, replicated weights) scores this rank's index keys, keeps
its top ``index_topk`` local candidates (score, sequence position), all-gathers them and picks the top-k of the
union (:func:`mla_compile.parallel.dcp.merge_topk`: the same slots as one process); each rank attends over the
picked slots it holds, and the parts are merged by LSE.

Sink + window layers (``patch(..., sparse="sink_window")``): every token, decode and prefill alike, attends over
the slots of the sink and window positions of its causal prefix that this rank holds
(:func:`mla_compile.parallel.dcp.sink_window_slots`, each position on its owner), through the same sparse path and
LSE merge; a rank holding none of them contributes ``lse = -inf``.

``interleave`` (tokens per rank in a row; None: the cache's block size) must be the planner's
(:func:`~mla_compile.parallel.dcp.plan_dcp_step`, :func:`~mla_compile.parallel.dcp.localize`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.models.attention import MLAAttention
from mla_compile.backends import cached_backend
from mla_compile.models.config import MLAConfig
from mla_compile.models.indexer import MLAIndexer
from mla_compile.models.metadata import MLAMetadata, query_parts
from mla_compile.ops.context_attention import up_project
from mla_compile.ops.sparse_index import lightning_scores, select_topk
from mla_compile.parallel.dcp import (gather_merge, global_position, local_position, local_seq_lens, merge_topk,
                                      owner, query_rows, sink_window_slots)
from mla_compile.parallel.groups import Group
from mla_compile.parallel.layers import all_gather


def split_query_parts(meta: MLAMetadata, positions: Tensor) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """:func:`query_parts` of a DCP rank's step, with every token of a real sequence live (another rank's tokens
    have slot -1 here): decode tokens of sequences holding tokens in this part (padding sequences hold none; a
    real one holding none here has nothing to read here either), and every prefill token (those past the last
    sequence stay padding)."""
    live = torch.ones_like(meta.slot_mapping, dtype=torch.bool)
    if meta.decode is not None:
        d = meta.decode
        held = (d.seq_lens > 0).repeat_interleave(d.query_len, 0)
        live = torch.cat([held, live[d.num_tokens:]])
    return query_parts(meta, positions, live)


class DCPAttention(MLAAttention):
    """:class:`MLAAttention` (this rank's heads) over this rank's part of the cache, merged over ``dcp``."""

    def __init__(self, config: MLAConfig, hf_attn: nn.Module, dcp: Group, backend: str | None = None, *,
                 interleave: int | None = None) -> None:
        super().__init__(config, hf_attn, backend=backend)
        self.dcp = dcp
        if self.indexer is not None:
            self.indexer = DCPIndexer(config, hf_attn.indexer, dcp)
        self.interleave = interleave

    @property
    def interleave(self) -> int | None:
        """Tokens per rank in a row of the split (None: the cache's block size); the indexer's too."""
        return self._interleave

    @interleave.setter
    def interleave(self, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"interleave must be positive or None, got {value}")
        self._interleave = value
        if self.indexer is not None:
            self.indexer.interleave = value

    def real_tokens(self, meta: MLAMetadata) -> None:
        """None: another rank's tokens have slot -1 here too, so the slots do not tell padding apart."""
        return None

    def attend(self, x: Tensor, q_nope: Tensor, q_pe: Tensor, latent: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor,
               meta: MLAMetadata, positions: Tensor | None = None, q_resid: Tensor | None = None) -> Tensor:
        """:meth:`MLAAttention.attend` over the split cache; ``positions`` is needed by sparse layers and by
        decode steps of ``query_len > 1`` (each query's causal limit in this rank's part)."""
        if self.indexer is not None or self.sink_window is not None:  # the sparse path, over this rank's slots
            return super().attend(x, q_nope, q_pe, latent, k_pe, cos, sin, meta, positions, q_resid)
        c, T = self.config, x.shape[0]
        parts, n_dec = [], 0
        if meta.decode is not None:
            n_dec = meta.decode.num_tokens
            if meta.decode.query_len > 1 and positions is None:
                raise ValueError("DCPAttention: a decode step of query_len > 1 needs positions [T] "
                                 "(MLAForCausalLM passes them)")
            parts.append(self._decode(q_nope[:n_dec], q_pe[:n_dec], meta,
                                      None if positions is None else positions[:n_dec]))
        if meta.prefill is not None:
            parts.append(self._prefill(q_nope[n_dec:], q_pe[n_dec:], latent[n_dec:], k_pe[n_dec:], meta))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.o_proj(out.reshape(T, c.num_heads * c.v_head_dim))

    def _paged_backend(self, op: str, dtype: torch.dtype, heads: int) -> str:
        """The backend of the paged-cache ``op`` for ``heads`` heads (the DCP group's), one query row, with LSE."""
        c = self.config
        return cached_backend(self._choice_token, op, self._requested[op], device=self.kv_cache.device, dtype=dtype,
                              cache_dtype=self.kv_cache.dtype, block_size=self.kv_cache.shape[1], num_heads=heads,
                              head_dims=(c.kv_lora_rank, c.qk_rope_head_dim), need_lse=True,
                              cuda_graph=self.cuda_graph and op in ("decode", "decode_fp8"),
                              cache_strides=tuple(self.kv_cache.stride()), row_width=self.kv_cache.shape[-1])

    def _group_queries(self, q_nope: Tensor, q_pe: Tensor) -> Tensor:
        """The absorbed queries ``[T, H_group, latent_dim]`` of the DCP group's heads, in head order."""
        w_uk, _ = self._w_uk_uv()
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        return all_gather(torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1), 1, self.dcp)

    def _merged_own_heads(self, out: Tensor, lse: Tensor) -> Tensor:
        """Merge every rank's ``(out [T, H_group, Dc], lse)`` by LSE; this rank's heads through ``W_UV``:
        ``[T, H_local, v_head_dim]``."""
        c = self.config
        out, _ = gather_merge(out, lse, self.dcp)
        out = out.narrow(1, self.dcp.rank * c.num_heads, c.num_heads)
        return torch.einsum("thc,hvc->thv", out, self._w_uk_uv()[1])

    def _decode(self, q_nope: Tensor, q_pe: Tensor, meta: MLAMetadata, positions: Tensor | None = None) -> Tensor:
        """Absorbed decode over the split cache: ``[n_dec, H_local, v_head_dim]``. With ``query_len > 1``, each
        query is its own row over this rank's part, up to its causal limit there (from ``positions [n_dec]``)."""
        c, d = self.config, meta.decode
        q_all = self._group_queries(q_nope, q_pe)
        table, lens = d.block_table, d.seq_lens
        if d.query_len > 1:
            table, lens = query_rows(table, lens, positions, d.query_len, self.dcp.size, self.dcp.rank,
                                     self._interleave_of(self.kv_cache))
        op = "decode_fp8" if self.fp8_cache else "decode"
        decode = ops.decode_fp8 if self.fp8_cache else ops.decode
        out, lse = decode(q_all, self.kv_cache, table, lens, self.softmax_scale, kv_lora_rank=c.kv_lora_rank,
                          backend=self._paged_backend(op, q_all.dtype, q_all.shape[1]))
        return self._merged_own_heads(out, lse)

    def _interleave_of(self, cache: Tensor) -> int:
        """Tokens per rank in a row of the split: :attr:`interleave`, or ``cache``'s block size."""
        return cache.shape[1] if self.interleave is None else self.interleave

    def _sink_window_indices(self, meta: MLAMetadata, positions: Tensor) -> Tensor:
        """``int32 [T, sink + window]``: each token's sink and window slots over its causal prefix that this rank
        holds (:func:`~mla_compile.parallel.dcp.sink_window_slots`; -1 for the others' and padding)."""
        sink, window = self.sink_window
        bs, P, rank = self.kv_cache.shape[1], self.dcp.size, self.dcp.rank
        parts = [sink_window_slots(table, query_seq, query_pos, bs, sink, window, P, rank,
                                   self._interleave_of(self.kv_cache))
                 for table, _, query_seq, query_pos in split_query_parts(meta, positions)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _sparse(self, q_nope: Tensor, q_pe: Tensor, indices: Tensor) -> Tensor:
        """Absorbed attention of every token over the selected slots this rank holds (``indices [T, topk]``,
        -1 elsewhere, from :class:`DCPIndexer` or the sink + window rule), merged over the group:
        ``[T, H_local, v_head_dim]``."""
        c = self.config
        q_all = self._group_queries(q_nope, q_pe)
        out, lse = ops.sparse_decode(q_all, self.kv_cache, indices, self.softmax_scale, kv_lora_rank=c.kv_lora_rank,
                                     backend=self._paged_backend("sparse_decode", q_all.dtype, q_all.shape[1]))
        return self._merged_own_heads(out, lse)

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
        out, lse = ops.prefill(q, k, v, p.cu_seqlens_q, p.cu_seqlens_k, self.softmax_scale, causal=True,
                               backend=self._backend("prefill", q.dtype, head_dims=(c.qk_head_dim, c.v_head_dim)))
        q_all = all_gather(q, 1, self.dcp)
        w_all = all_gather(self.kv_b_proj.weight, 0, self.dcp)  # the group's heads' W_UK / W_UV, in head order
        n, heads = q.shape[0], c.num_heads * P
        empty_out = q.new_zeros(n, heads, c.v_head_dim)
        empty_lse = torch.full((n, heads), float("-inf"), dtype=torch.float32, device=q.device)
        ctx = p.context
        ctx_out, ctx_lse = ops.context_attention(
            q_all, empty_out, empty_lse, self.kv_cache, p.block_table, p.cu_seqlens_q, ctx.cu_seqlens, ctx.starts,
            ctx.rows, w_all, self.softmax_scale, kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim,
            prefill_backend=self._heads_backend("prefill", q.dtype, heads, (c.qk_head_dim, c.v_head_dim)),
            merge_backend=self._heads_backend("merge", q.dtype, heads, (c.v_head_dim,)),
            gather_backend=self._requested["gather_fp8" if self.fp8_cache else "gather"])
        ctx_out, ctx_lse = gather_merge(ctx_out, ctx_lse, self.dcp)
        h0 = self.dcp.rank * c.num_heads
        out, _ = ops.merge_attn_states(out, lse, ctx_out.narrow(1, h0, c.num_heads).contiguous(),
                                       ctx_lse.narrow(1, h0, c.num_heads).contiguous())
        return out


class DCPIndexer(MLAIndexer):
    """:class:`MLAIndexer` over this rank's part of the index-key cache: the same top-k slots as one process.

    Each query scores this rank's keys up to its causal limit in the part (``local_seq_lens(position + 1)``),
    keeps its best ``index_topk`` (score, sequence position), and :func:`~mla_compile.parallel.dcp.merge_topk`
    picks the top ``index_topk`` of the group's candidates (exact: a rank's share of the global top-k is among
    its own top-k, in the same order). Returns the picked slots this rank holds, -1 for the others'."""

    def __init__(self, config: MLAConfig, hf_indexer: nn.Module, dcp: Group, interleave: int | None = None) -> None:
        super().__init__(config, hf_indexer)
        self.dcp = dcp
        self.interleave = interleave  # tokens per rank in a row (None: the cache's block size); DCPAttention's

    def _query_parts(self, meta: MLAMetadata, positions: Tensor) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        return split_query_parts(meta, positions)

    def _select(self, q: Tensor, w: Tensor, block_table: Tensor, seq_lens: Tensor, query_seq: Tensor,
                query_pos: Tensor) -> Tensor:
        topk, P, rank = self.config.index_topk, self.dcp.size, self.dcp.rank
        bs = self.k_cache.shape[1]
        interleave = bs if self.interleave is None else self.interleave
        T, B = q.shape[0], block_table.shape[0]
        live = query_seq >= 0
        seq = torch.where(live, query_seq.long(), 0)
        limit = torch.where(live, local_seq_lens(query_pos.long() + 1, P, rank, interleave), 0)
        # each sequence's tokens in this part: the largest limit of its queries (decode: its whole length)
        held = torch.zeros(B, dtype=limit.dtype, device=limit.device).scatter_reduce(0, seq, limit, "amax")
        scores = lightning_scores(q, w, self.k_cache, block_table, held, query_seq, limit)
        local = select_topk(scores, topk)  # [T, min(topk, L)] local positions, best first
        best = scores.gather(1, local)
        pos = global_position(local, P, rank, interleave)
        if local.shape[1] < topk:  # the same candidate count on every rank, whatever its table width
            best = torch.cat([best, best.new_full((T, topk - local.shape[1]), float("-inf"))], 1)
            pos = torch.cat([pos, pos.new_zeros(T, topk - local.shape[1])], 1)
        _, picked = merge_topk(best, pos, topk, self.dcp)
        mine = (picked >= 0) & (owner(picked, P, interleave) == rank)
        lp = local_position(picked.clamp(min=0), P, interleave)
        col = (lp // bs).clamp(max=max(block_table.shape[1] - 1, 0))
        slots = block_table.long()[seq[:, None], col] * bs + lp % bs
        slots = torch.where(mine, slots, -1).to(torch.int32)
        if slots.shape[1] < topk:
            slots = torch.cat([slots, slots.new_full((T, topk - slots.shape[1]), -1)], 1)
        return slots
