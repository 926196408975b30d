"""DeepSeek-V3.2's lightning indexer over a paged index-key cache (the "DSA" top-k selection).

Per token: index queries ``wq_b(q_resid)`` ``[T, n_idx_heads, d_idx]`` and one index key
``LayerNorm(wk(x))`` ``[T, d_idx]``, both rotated (rotate-half, not interleaved) on their first
``qk_rope_head_dim`` dims; head weights ``weights_proj(x) * n_idx_heads^-0.5``. The score of key j for
query t is ``sum_h w[t, h] * relu(q[t, h] . k[j] * d_idx^-0.5)`` (HF's and DeepSeek's formula; the
positive ``d_idx^-0.5`` is folded into the weights). Keys go into this layer's paged index cache at the
latent cache's slots; :func:`mla_compile.ops.lightning_index` then picks the top ``index_topk`` visible
slots per token (causal). Everything per step is derived from the explicit metadata and ``positions``
with tensor ops (no host sync, static shapes), so it compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mla_compile import ops
from mla_compile.models.config import MLAConfig
from mla_compile.models.metadata import MLAMetadata, query_parts
from mla_compile.ops._fp8_format import fp8_index_row_bytes
from mla_compile.models.rope import apply_rope_leading


class MLAIndexer(nn.Module):
    """The top-k indexer of one V3.2 layer; shares ``wq_b``, ``wk``, ``k_norm`` and ``weights_proj`` with
    the HF ``DeepseekV32Indexer`` (same parameter names). The key cache ``k_cache [num_blocks,
    block_size, index_head_dim]`` (or fp8 index rows ``uint8 [..., index_head_dim + 4]``) is set by
    :meth:`set_cache` next to the layer's latent cache."""

    def __init__(self, config: MLAConfig, hf_indexer: nn.Module) -> None:
        super().__init__()
        if not config.is_sparse:
            raise ValueError("MLAIndexer needs a sparse (V3.2) MLAConfig with index_n_heads/index_head_dim/index_topk")
        if config.index_head_dim < config.qk_rope_head_dim:
            raise ValueError(f"index_head_dim ({config.index_head_dim}) must be >= qk_rope_head_dim "
                             f"({config.qk_rope_head_dim}): the index rope covers the first qk_rope_head_dim dims")
        self.config = config
        for name in ("wq_b", "wk", "k_norm", "weights_proj"):
            if getattr(hf_indexer, name, None) is None:
                raise ValueError(f"{type(hf_indexer).__name__} has no {name}: not a DeepSeek-V3.2 indexer")
        self.wq_b, self.wk, self.k_norm = hf_indexer.wq_b, hf_indexer.wk, hf_indexer.k_norm
        self.weights_proj = hf_indexer.weights_proj
        expected = (config.index_n_heads * config.index_head_dim,)
        if tuple(self.wq_b.weight.shape[:1]) != expected:
            raise ValueError(f"indexer wq_b.weight must have {expected[0]} rows (index_n_heads * index_head_dim), "
                             f"got {list(self.wq_b.weight.shape)}")
        self.register_buffer("k_cache", None, persistent=False)

    def set_cache(self, k_cache: Tensor) -> None:
        """Attach this layer's paged index-key cache: float ``[num_blocks, block_size, index_head_dim]`` or
        fp8 index rows ``uint8 [num_blocks, block_size, index_head_dim + 4]`` (quantized on write)."""
        d = self.config.index_head_dim
        fp8 = k_cache.dtype == torch.uint8
        width = fp8_index_row_bytes(d) if fp8 else d
        if k_cache.dim() != 3 or k_cache.shape[-1] != width or not (fp8 or k_cache.dtype.is_floating_point):
            raise ValueError(f"index k_cache must be float [num_blocks, block_size, {d}] or uint8 fp8 rows "
                             f"[num_blocks, block_size, {d + 4}], got {k_cache.dtype} {list(k_cache.shape)}")
        torch._dynamo.mark_static_address(k_cache, guard=False)  # as MLAAttention.set_cache: one address
        self.k_cache = k_cache

    def forward(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                meta: MLAMetadata) -> Tensor:
        """Write this step's index keys; return ``indices int32 [T, index_topk]`` (physical slots of the
        selected tokens, -1 padded) for ``x [T, hidden]``, ``q_resid [T, q_lora_rank]``, ``positions [T]``:
        :meth:`project`, :meth:`write`, then :meth:`select` (the model's regional compilation calls them apart,
        the write between regions)."""
        q, k, w = self.project(x, q_resid, cos, sin)
        self.write(k, meta)
        return self.select(q, w, positions, meta)

    def project(self, x: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The indexer's projections, no cache access: ``(q [T, index_heads, index_head_dim], k [T, index_head_dim]``
        (both rotated on their first ``qk_rope_head_dim`` dims), ``w [T, index_heads]`` (scaled head weights, float32;
        float64 for float64 x))."""
        c = self.config
        T, Hi, d = x.shape[0], c.index_n_heads, c.index_head_dim
        q = self.wq_b(q_resid).view(T, Hi, d)
        q = apply_rope_leading(q, cos, sin)
        k = self.k_norm(self.wk(x))
        k = apply_rope_leading(k, cos, sin)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # HF scores in float32
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).to(acc) * (Hi ** -0.5 * d ** -0.5)
        return q, k, w

    def write(self, k: Tensor, meta: MLAMetadata) -> None:
        """Write this step's index keys ``k [T, index_head_dim]`` at ``meta.slot_mapping`` (quantized into fp8 rows)."""
        if self.k_cache is None:
            raise RuntimeError("MLAIndexer has no index cache: call MLAForCausalLM.allocate_cache(...) first")
        ops.write_index_cache(k, meta.slot_mapping, self.k_cache)

    def select(self, q: Tensor, w: Tensor, positions: Tensor, meta: MLAMetadata) -> Tensor:
        """The top ``index_topk`` slots of every query over the written index cache: ``indices int32 [T, index_topk]``
        (-1 padded). Reads the cache, writes nothing."""
        parts, at = [], 0
        for block_table, seq_lens, query_seq, query_pos in self._query_parts(meta, positions):
            n = query_seq.shape[0]
            parts.append(self._select(q[at:at + n], w[at:at + n], block_table, seq_lens, query_seq, query_pos))
            at += n
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _query_parts(self, meta: MLAMetadata, positions: Tensor) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """Each part's ``(block_table, seq_lens, query_seq, query_pos)`` (:func:`query_parts`)."""
        return query_parts(meta, positions)

    def _select(self, q: Tensor, w: Tensor, block_table: Tensor, seq_lens: Tensor, query_seq: Tensor,
                query_pos: Tensor) -> Tensor:
        return ops.lightning_index(q, w, self.k_cache, block_table, seq_lens, query_seq.to(torch.int32),
                                   query_pos.to(torch.int32), topk=self.config.index_topk)
