"""DeepSeek-V4's lightning indexer over compressed keys: which compressed entries each CSA query attends to.

V4 scores compressed entry s for query t as (paper §2.3.1, eqs. 13-17)

    score(t, s) = sum_h w[t, h] * relu(q[t, h] . k_s) * index_head_dim**-0.5,   w = weights_proj(x) * n_heads**-0.5

over the entries whose window has ended at or before the query (``s < (query_pos + 1) // rate``), and
keeps the top ``topk``. That is DeepSeek-V3.2's lightning indexer (:func:`mla_compile.ops.lightning_index`)
over the entry cache instead of the token cache: entry s plays position s, a query at position p plays
position ``(p + 1) // rate - 1`` (queries that see no entry become padding), the sequence length is
the number of entries, and the two scales fold into the weights. So this module adds no kernel: it maps
the arguments, and every backend of ``lightning_index`` (reference, Triton) serves V4.

The index-key cache and the compressed-KV cache of a CSA layer share one entry block table, so the
returned slots index both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops.sparse_index import lightning_index


def v4_index_topk(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                  query_seq: Tensor, query_pos: Tensor, *, rate: int, topk: int,
                  backend: str | None = None) -> Tensor:
    """``int32 [T, topk]`` entry-cache slots (-1 padded) of each query's top-``topk`` compressed entries.

    ``q_idx [T, n_heads, d]`` (RoPE applied), ``weights [T, n_heads]`` (``weights_proj(x)``, unscaled),
    ``k_idx_cache [NB, BS, d]`` compressed index keys through ``block_table [B, max_blocks]``,
    ``seq_lens [B]`` token context lengths (incl. this step), ``query_seq [T]`` (-1 = padding) and
    ``query_pos [T]``. Equal scores: lower entry first. Fewer visible entries than ``topk``: -1 after them.
    """
    if rate <= 0:
        raise ValueError(f"v4_index_topk: rate must be positive, got {rate}")
    n_heads, d = q_idx.shape[1], q_idx.shape[2]
    w = weights.float() * (n_heads ** -0.5 * d ** -0.5) if weights.dtype != torch.float64 else \
        weights * (n_heads ** -0.5 * d ** -0.5)
    last = (query_pos.long() + 1) // rate - 1  # the last entry the query may see
    seq = torch.where(last >= 0, query_seq.long(), -1).to(query_seq.dtype)
    entries = (seq_lens.long() // rate).to(seq_lens.dtype)
    return lightning_index(q_idx, w, k_idx_cache, block_table, entries, seq, last.clamp(min=0).to(query_pos.dtype),
                           topk=topk, backend=backend)
