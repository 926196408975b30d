"""Sparse-MLA indexers: which physical cache slots each query attends to.

- ``mla::sink_window_indices``: per sequence, the slots of its first ``sink`` and last ``window``
  tokens (positions ``[0, min(sink, L))`` and ``[max(L - window, 0), L)``, L = seq_len, each position
  once when the two overlap), ordered by position, in a fixed-capacity ``[B, max_kv]`` int32 layout
  padded with -1, plus ``counts [B]`` int32. ``max_kv >= sink + window`` so nothing is cut.
  :func:`to_csr` turns that into CSR form.
- ``mla::sink_window_query_indices``: the same rule per query token, over its causal prefix
  ``[0, query_pos[t]]`` (``L = query_pos[t] + 1``), ``[T, max_kv]``: what a sink + window model's prefill
  and multi-token decode need (:class:`mla_compile.models.attention.MLAAttention` with ``sparse="sink_window"``).
- ``mla::lightning_index``: DeepSeek-V3.2's lightning indexer, ``score(t, j) = sum_h weights[t, h] *
  relu(q_idx[t, h] . k_idx[j])`` over the positions ``j <= query_pos[t]`` (and ``< seq_len``) of query
  t's sequence, top ``topk`` slots per query token.
- ``mla::write_index_cache``: the indexer's key cache write (``mla::write_latent_cache``'s slot rules).

The index-key cache is either a float cache ``[num_blocks, block_size, d]`` or the fp8 index format
``uint8 [num_blocks, block_size, d + 4]`` of :mod:`mla_compile.ops.fp8_index` (132 bytes per token for
d = 128): the write quantizes, ``lightning_index`` gathers the rows and dequantizes them to float32,
then scores exactly as it scores a float32 cache holding the dequantized keys (so the selection over an
fp8 cache equals the selection over ``dequantize_fp8_index(cache)``). Against keys kept in bf16, the
fp8 keys move the scores by a few percent (the format's 2**-4 relative rounding), so near-ties can swap:
``tests/ops/test_fp8_index.py`` measures the top-k overlap (V3.2 dims: 64 heads x 128, N(0, 1) keys).

Backend "triton" (CUDA; ``mla_compile.ops.triton.index_cache_write`` and ``.lightning_index``) writes the
same bytes as the reference and computes the scores in one kernel; both implementations select through
:func:`select_topk` and :func:`positions_to_slots`, so equal scores resolve alike.

All are sync-free tensor programs (sizes come from shapes and static ints), so they run under
``torch.compile(fullgraph=True)`` and inside CUDA-graph capture. The slots feed
``mla_compile.ops.sparse_decode``: a decode step (s_q = 1) passes ``indices[:, None]``. With s_q > 1
every query of a sequence would get the same set, so multi-token steps use ``lightning_index`` or
``sink_window_query_indices``, which are per query token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_range, check_same_device, check_tensor,
                                     data_checks_enabled)
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops._fp8_format import FP8_INDEX_SCALE_BYTES
from mla_compile.ops.fp8_index import dequantize_fp8_index, quantize_fp8_index
from mla_compile.ops._paged import check_paged_data, scatter_rows, sequence_slots

OP_WINDOW = declare_op("sink_window_indices", "mla.sink_window_indices")
OP_QUERY_WINDOW = declare_op("sink_window_query_indices", "mla.sink_window_query_indices")
OP_LIGHTNING = declare_op("lightning_index", "mla.lightning_index")
OP_WRITE = declare_op("index_cache_write", "mla.write_index_cache")


# ------------------------------------------------------------------------------------------- sink + window

def validate_window(block_table: Tensor, seq_lens: Tensor, block_size: int, sink: int, window: int,
                    max_kv: int) -> None:
    """Shape/dtype/int checks (no sync); data checks on CPU or in checked mode."""
    check_tensor(OP_WINDOW, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, expected="[B, max_blocks] int32")
    B = block_table.shape[0]
    check_tensor(OP_WINDOW, "seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, shape=(B,), expected="[B] int32")
    if block_size <= 0:
        raise ValueError(f"{OP_WINDOW}: block_size must be positive (the cache's tokens per block), got {block_size}")
    if sink < 0 or window < 0:
        raise ValueError(f"{OP_WINDOW}: sink and window must be >= 0, got sink={sink}, window={window}")
    if max_kv < sink + window:
        raise ValueError(f"{OP_WINDOW}: max_kv must be >= sink + window = {sink + window} so no slot is cut, "
                         f"got {max_kv}")
    check_same_device(OP_WINDOW, block_table=block_table, seq_lens=seq_lens)
    if data_checks_enabled(seq_lens):
        check_paged_data(OP_WINDOW, block_table, seq_lens, block_size, None)


def sink_window_positions(L: Tensor, sink: int, window: int, max_kv: int) -> tuple[Tensor, Tensor, Tensor]:
    """For lengths ``L [N, 1]`` (int64): ``(pos [N, max_kv], valid [N, max_kv], count [N, 1])``, column j the
    j-th selected position of ``[0, min(sink, L)) U [max(L - window, 0), L)`` (each once, ascending). The
    positions of the sink + window rule, before any block table (a cache split by token maps them to its own
    slots: :func:`mla_compile.parallel.dcp.sink_window_slots`)."""
    head = L.clamp(max=sink)  # positions [0, head) are the sink
    tail_start = (L - window).clamp(min=0).maximum(head)  # window positions not already in the sink
    count = head + (L - tail_start)
    j = torch.arange(max_kv, device=L.device)[None, :]
    valid = j < count
    pos = torch.where(valid, torch.where(j < head, j, tail_start + (j - head)), 0)
    return pos, valid, count


def _slots_of(block_table: Tensor, rows: Tensor, pos: Tensor, valid: Tensor, block_size: int) -> Tensor:
    """int32 physical slots of positions ``pos [N, K]`` of the sequences ``rows [N, 1]`` of ``block_table``; -1
    where not ``valid``."""
    max_blocks = block_table.shape[1]
    if max_blocks == 0 or block_table.shape[0] == 0:  # no block can be used: every row is empty
        blocks = torch.zeros_like(pos)
    else:
        blocks = block_table.long()[rows, (pos // block_size).clamp(max=max_blocks - 1)]
    return torch.where(valid, blocks * block_size + pos % block_size, -1).to(torch.int32)


@torch.library.custom_op("mla::sink_window_indices_ref", mutates_args=(), tags=LAYOUT_TAGS)
def sink_window_indices_ref(block_table: Tensor, seq_lens: Tensor, block_size: int, sink: int, window: int,
                            max_kv: int) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device, no host sync): column j holds the j-th selected position."""
    validate_window(block_table, seq_lens, block_size, sink, window, max_kv)
    pos, valid, count = sink_window_positions(seq_lens.long()[:, None], sink, window, max_kv)
    rows = torch.arange(block_table.shape[0], device=block_table.device)[:, None]
    return _slots_of(block_table, rows, pos, valid, block_size), count[:, 0].to(torch.int32)


@sink_window_indices_ref.register_fake
def _(block_table, seq_lens, block_size, sink, window, max_kv):
    validate_window(block_table, seq_lens, block_size, sink, window, max_kv)
    B = block_table.shape[0]
    return block_table.new_empty(B, max_kv, dtype=torch.int32), block_table.new_empty(B, dtype=torch.int32)


declare(OP_WINDOW, "reference", torch.ops.mla.sink_window_indices_ref, rank=100, devices=("any",),
        dtypes=(torch.int32,), gpu_tested=True, note="plain torch (index arithmetic only)")


def sink_window_indices(block_table: Tensor, seq_lens: Tensor, *, block_size: int, sink: int, window: int,
                        max_kv: int, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Slots of each sequence's sink and window tokens: ``(indices int32 [B, max_kv] (-1 padded), counts
    int32 [B])`` from ``block_table [B, max_blocks]`` and ``seq_lens [B]``; see the module docstring."""
    impl = resolve(OP_WINDOW, block_table.device, backend, dtype=torch.int32)
    return impl.fn(block_table, seq_lens, block_size, sink, window, max_kv)


def validate_query_window(block_table: Tensor, query_seq: Tensor, query_pos: Tensor, block_size: int, sink: int,
                          window: int, max_kv: int) -> None:
    """Shape/dtype/int checks (no sync); data checks on CPU or in checked mode."""
    op = OP_QUERY_WINDOW
    check_tensor(op, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, expected="[B, max_blocks] int32")
    check_tensor(op, "query_seq", query_seq, ndim=1, dtypes=INDEX_DTYPES,
                 expected="[T] int32 sequence of each query token, -1 for padding")
    T = query_seq.shape[0]
    check_tensor(op, "query_pos", query_pos, ndim=1, dtypes=INDEX_DTYPES, shape=(T,),
                 expected=f"[T] = [{T}] int32 position of each query token")
    if block_size <= 0:
        raise ValueError(f"{op}: block_size must be positive (the cache's tokens per block), got {block_size}")
    if sink < 0 or window < 0:
        raise ValueError(f"{op}: sink and window must be >= 0, got sink={sink}, window={window}")
    if max_kv < sink + window:
        raise ValueError(f"{op}: max_kv must be >= sink + window = {sink + window} so no slot is cut, got {max_kv}")
    check_same_device(op, block_table=block_table, query_seq=query_seq, query_pos=query_pos)
    if data_checks_enabled(query_seq):
        B, cap = block_table.shape[0], block_table.shape[1] * block_size
        check_range(op, "query_seq", query_seq, -1, B, what=f"sequence ids < B = {B}, or -1 for padding")
        live = query_seq >= 0
        check_range(op, "query_pos", query_pos[live], 0, cap,
                    what=f"positions < max_blocks * block_size = {cap} (padding tokens excepted)")
        # the used blocks of each live query: its table row's first query_pos // block_size + 1 entries
        used = (torch.arange(block_table.shape[1], device=block_table.device)[None, :]
                <= (query_pos[live].long() // block_size)[:, None])
        check_range(op, "block_table", block_table[query_seq[live].long()][used], 0, 2 ** 31,
                    what="block ids >= 0 in the blocks the live queries use")


@torch.library.custom_op("mla::sink_window_query_indices_ref", mutates_args=(), tags=LAYOUT_TAGS)
def sink_window_query_indices_ref(block_table: Tensor, query_seq: Tensor, query_pos: Tensor, block_size: int,
                                  sink: int, window: int, max_kv: int) -> Tensor:
    """Reference (plain torch, any device, no host sync): query t sees the ``L = query_pos[t] + 1`` positions
    of its causal prefix; column j holds the j-th selected one."""
    validate_query_window(block_table, query_seq, query_pos, block_size, sink, window, max_kv)
    live = query_seq >= 0
    L = torch.where(live, query_pos.long() + 1, 0)[:, None]
    pos, valid, _ = sink_window_positions(L, sink, window, max_kv)
    rows = torch.where(live, query_seq.long(), 0)[:, None]
    return _slots_of(block_table, rows, pos, valid, block_size)


@sink_window_query_indices_ref.register_fake
def _(block_table, query_seq, query_pos, block_size, sink, window, max_kv):
    validate_query_window(block_table, query_seq, query_pos, block_size, sink, window, max_kv)
    return query_seq.new_empty(query_seq.shape[0], max_kv, dtype=torch.int32)


declare(OP_QUERY_WINDOW, "reference", torch.ops.mla.sink_window_query_indices_ref, rank=100, devices=("any",),
        dtypes=(torch.int32,), gpu_tested=True,
        note="plain torch (index arithmetic only; the arithmetic of sink_window_indices)")


def sink_window_query_indices(block_table: Tensor, query_seq: Tensor, query_pos: Tensor, *, block_size: int,
                              sink: int, window: int, max_kv: int | None = None,
                              backend: str | None = None) -> Tensor:
    """Per query token, the slots of the first ``sink`` and the last ``window`` positions of its causal prefix
    ``[0, query_pos[t]]``: ``indices int32 [T, max_kv]`` (default ``max_kv = sink + window``), ascending by
    position, -1 padded, all -1 for padding tokens (``query_seq[t] == -1``). ``block_table [B, max_blocks]``
    maps each sequence's positions to blocks; ``query_seq [T]`` / ``query_pos [T]`` place each query.
    The rows feed ``mla_compile.ops.sparse_decode`` as ``indices[:, None]`` (one query row per token)."""
    max_kv = sink + window if max_kv is None else max_kv
    impl = resolve(OP_QUERY_WINDOW, block_table.device, backend, dtype=torch.int32)
    return impl.fn(block_table, query_seq, query_pos, block_size, sink, window, max_kv)


def to_csr(indices: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """CSR form of a padded ``indices [B, max_kv]`` with ``counts [B]``: ``(indptr int32 [B + 1], flat
    int32 [B * max_kv])``; row b's slots are ``flat[indptr[b]:indptr[b + 1]]``.

    The packed length ``indptr[-1]`` depends on data, so ``flat`` has the fixed capacity ``B * max_kv``
    (a shape, never read from data; graph-capturable) and holds -1 past ``indptr[-1]``. With a cache
    viewed as pages of one token, ``(indptr, flat)`` are FlashInfer's ``kv_indptr`` / ``kv_indices``.
    """
    B, max_kv = indices.shape
    counts = counts.long()
    indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    j = torch.arange(max_kv, device=indices.device)[None, :]
    valid = j < counts[:, None]
    # Padding entries go to one extra dump slot (all writing -1), cut off at the end: no data-dependent size.
    target = torch.where(valid, indptr[:-1, None] + j, B * max_kv).flatten()
    values = torch.where(valid, indices.long(), -1).flatten()
    flat = torch.full((B * max_kv + 1,), -1, dtype=torch.long, device=indices.device).scatter_(0, target, values)
    return indptr.to(torch.int32), flat[:-1].to(torch.int32)


# ------------------------------------------------------------------------------------------- lightning indexer

def check_index_cache(op: str, k_idx_cache: Tensor, d: int) -> None:
    """``k_idx_cache`` is a float ``[NB, BS, d]`` cache or an fp8 ``uint8 [NB, BS, d + 4]`` one (shape/dtype only)."""
    fp8 = k_idx_cache.dtype == torch.uint8 if isinstance(k_idx_cache, Tensor) else False
    width = d + FP8_INDEX_SCALE_BYTES if fp8 else d
    check_tensor(op, "k_idx_cache", k_idx_cache, ndim=3, dtypes=FLOAT_DTYPES + (torch.uint8,), shape=(None, None, width),
                 expected=f"[num_blocks, block_size, {d}] float, or [num_blocks, block_size, {d} + 4] uint8 fp8 "
                          f"index rows (d = {d} from the keys/queries)")


def validate_lightning(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                       query_seq: Tensor, query_pos: Tensor, topk: int) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode."""
    check_tensor(OP_LIGHTNING, "q_idx", q_idx, ndim=3, dtypes=FLOAT_DTYPES, expected="[T, n_idx_heads, d_idx]")
    T, Hi, d = q_idx.shape
    check_tensor(OP_LIGHTNING, "weights", weights, ndim=2, dtypes=FLOAT_DTYPES, shape=(T, Hi),
                 expected=f"[T, n_idx_heads] = [{T}, {Hi}]")
    check_index_cache(OP_LIGHTNING, k_idx_cache, d)
    check_tensor(OP_LIGHTNING, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES,
                 expected="[B, max_blocks] int32")
    B = block_table.shape[0]
    check_tensor(OP_LIGHTNING, "seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, shape=(B,), expected="[B] int32")
    check_tensor(OP_LIGHTNING, "query_seq", query_seq, ndim=1, dtypes=INDEX_DTYPES, shape=(T,),
                 expected="[T] int32 sequence of each query token, -1 for padding")
    check_tensor(OP_LIGHTNING, "query_pos", query_pos, ndim=1, dtypes=INDEX_DTYPES, shape=(T,),
                 expected="[T] int32 position of each query token")
    if topk <= 0:
        raise ValueError(f"{OP_LIGHTNING}: topk must be positive, got {topk}")
    check_same_device(OP_LIGHTNING, q_idx=q_idx, weights=weights, k_idx_cache=k_idx_cache, block_table=block_table,
                      seq_lens=seq_lens, query_seq=query_seq, query_pos=query_pos)
    if data_checks_enabled(seq_lens):
        bs = k_idx_cache.shape[1]
        check_paged_data(OP_LIGHTNING, block_table, seq_lens, bs, k_idx_cache.shape[0])
        check_range(OP_LIGHTNING, "query_seq", query_seq, -1, B, what=f"sequence ids < B = {B}, or -1 for padding")
        live = query_seq >= 0
        check_range(OP_LIGHTNING, "query_pos", query_pos[live], 0, block_table.shape[1] * bs,
                    what=f"positions < max_blocks * block_size = {block_table.shape[1] * bs} (padding tokens excepted)")


@torch.library.custom_op("mla::lightning_index_ref", mutates_args=(), tags=LAYOUT_TAGS)
def lightning_index_ref(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                        query_seq: Tensor, query_pos: Tensor, topk: int) -> Tensor:
    """Reference (plain torch, any device, float32 or float64 math): score every position of the query's
    sequence, mask the future and padding, stable descending sort, keep ``topk``.

    Returns ``indices int32 [T, topk]``: slots by descending score (equal scores: lower position first),
    -1 past the visible count and for padding tokens (``query_seq == -1``).
    """
    validate_lightning(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos, topk)
    T = q_idx.shape[0]
    if block_table.shape[0] == 0:  # no sequences: every token is padding
        return torch.full((T, topk), -1, dtype=torch.int32, device=q_idx.device)
    scores = lightning_scores_ref(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos.long() + 1)
    return positions_to_slots(select_topk(scores, topk), block_table, seq_lens, query_seq, query_pos,
                              k_idx_cache.shape[1], topk)


def lightning_scores_ref(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                         query_seq: Tensor, query_limit: Tensor) -> Tensor:
    """The lightning indexer's scores ``[T, L]`` (L = max_blocks * block_size; float32, float64 for float64
    queries) of every position of each query's sequence, ``-inf`` where not visible: positions ``>= seq_lens``
    of the sequence, ``>= query_limit[t]`` (the query's causal limit: ``query_pos + 1`` in one cache) and every
    position of a padding token (``query_seq == -1``). Plain torch, no checks (``lightning_index_ref``'s
    arithmetic; a split cache passes each query's limit in its own part). Needs ``block_table.shape[0] > 0``."""
    acc = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
    slots, valid, pos = sequence_slots(block_table, seq_lens, k_idx_cache.shape[1])  # [B, L]
    rows = k_idx_cache.reshape(-1, k_idx_cache.shape[2])[slots]
    if k_idx_cache.dtype == torch.uint8:  # fp8 index rows: dequantize only the gathered ones
        rows = dequantize_fp8_index(rows)
    keys = torch.where(valid[..., None], rows.to(acc), 0)  # unwritten rows may hold NaN
    live = query_seq >= 0
    seq = torch.where(live, query_seq.long(), 0)
    logits = torch.einsum("thd,tld->thl", q_idx.to(acc), keys[seq])  # [T, Hi, L]
    scores = (torch.relu(logits) * weights.to(acc)[..., None]).sum(dim=1)  # [T, L]
    visible = valid[seq] & (pos[None, :] < query_limit.long()[:, None]) & live[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def lightning_scores(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                     query_seq: Tensor, query_limit: Tensor, *, backend: str | None = None) -> Tensor:
    """The scores ``[T, L]`` :func:`lightning_index` selects from (:func:`lightning_scores_ref`'s contract), with
    ``lightning_index``'s backend (``backend``: None/"auto" or a name): "triton" runs its scoring kernel, the
    others the reference. For a caller that selects itself (a cache split by token merges the parts' top-k)."""
    impl = resolve(OP_LIGHTNING, q_idx.device, backend, dtype=q_idx.dtype)
    if impl.name == "triton" and torch.float64 not in (q_idx.dtype, weights.dtype, k_idx_cache.dtype):
        return triton_scores(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_limit)
    return lightning_scores_ref(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_limit)


def triton_scores(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                  query_seq: Tensor, query_limit: Tensor) -> Tensor:
    """:func:`lightning_scores` by the Triton scoring kernel (float32; CUDA, or any device under Triton's
    interpreter): a query with limit 0 is a padding token to it, the others see positions ``<= limit - 1``."""
    from mla_compile.ops.triton.lightning_index import lightning_scores as kernel_scores

    seen = (query_seq >= 0) & (query_limit > 0)
    i32 = torch.int32
    return kernel_scores(q_idx, weights, k_idx_cache, block_table.to(i32), seq_lens.to(i32),
                         torch.where(seen, query_seq, -1).to(i32), (query_limit - 1).clamp(min=0).to(i32))


def select_topk(scores: Tensor, topk: int) -> Tensor:
    """Positions ``int64 [T, min(topk, L)]`` of the highest ``scores [T, L]`` (float32 or float64, -inf where
    invisible) by descending score, equal scores lower position first (a stable descending sort; -0.0
    equals 0.0). Shared by every ``lightning_index`` implementation, so ties resolve alike everywhere.

    float32 scores go through ``torch.topk`` on unique int64 keys (order-preserving score bits above the
    reversed position), which selects exactly what the stable sort would at a fraction of its cost.
    """
    T, L = scores.shape
    k = min(topk, L)
    if scores.dtype != torch.float32:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    bits = torch.where(scores == 0, 0.0, scores).view(torch.int32)  # -0.0 -> +0.0: they tie in the sort
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # monotone in the float value
    pos = torch.arange(L, device=scores.device)
    # equal scores: the lower position gets the larger key. (L - 1 - pos), not (2**32 - 1 - pos): Inductor's
    # CUDA codegen folds the latter into an int32 index expression that Triton rejects (constant out of range)
    keys = ordered * (1 << 32) + (L - 1 - pos)
    return torch.topk(keys, k, dim=-1).indices


def positions_to_slots(order: Tensor, block_table: Tensor, seq_lens: Tensor, query_seq: Tensor, query_pos: Tensor,
                       block_size: int, topk: int) -> Tensor:
    """``int32 [T, topk]`` physical slots of the positions ``order [T, k]`` (k <= topk) of each query's
    sequence: -1 where a position is not visible (``>= seq_len``, ``> query_pos``, padding token) and in
    the columns past k. Needs ``block_table.shape[0] > 0``."""
    T = order.shape[0]
    live = query_seq >= 0
    seq = torch.where(live, query_seq.long(), 0)
    visible = ((order < seq_lens.long()[seq][:, None]) & (order <= query_pos.long()[:, None]) & live[:, None])
    col = (order // block_size).clamp(max=max(block_table.shape[1] - 1, 0))
    blocks = block_table.long()[seq[:, None], col] if order.shape[1] else order
    chosen = torch.where(visible, blocks * block_size + order % block_size, -1).to(torch.int32)
    if chosen.shape[1] < topk:  # fewer positions than topk in the whole table
        chosen = torch.cat([chosen, chosen.new_full((T, topk - chosen.shape[1]), -1)], dim=1)
    return chosen


@lightning_index_ref.register_fake
def _(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos, topk):
    validate_lightning(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos, topk)
    return q_idx.new_empty(q_idx.shape[0], topk, dtype=torch.int32)


declare(OP_LIGHTNING, "reference", torch.ops.mla.lightning_index_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch")


def lightning_index(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                    query_seq: Tensor, query_pos: Tensor, *, topk: int = 2048,
                    backend: str | None = None) -> Tensor:
    """DeepSeek-V3.2 top-k selection: ``indices int32 [T, topk]`` physical slots (-1 padded) for
    ``q_idx [T, n_idx_heads, d_idx]``, ``weights [T, n_idx_heads]`` over ``k_idx_cache [NB, BS, d_idx]``
    (float) or ``uint8 [NB, BS, d_idx + 4]`` (fp8 index rows, dequantized to float32 on read)
    through ``block_table [B, max_blocks]`` / ``seq_lens [B]``; ``query_seq [T]`` (-1 = padding) and
    ``query_pos [T]`` place each query token. Causal: token t sees positions ``<= query_pos[t]``."""
    impl = resolve(OP_LIGHTNING, q_idx.device, backend, dtype=q_idx.dtype)
    return impl.fn(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq, query_pos, topk)


# ------------------------------------------------------------------------------------------- index-key cache write

def validate_write(k_idx: Tensor, slot_mapping: Tensor, k_idx_cache: Tensor) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode. Raises before any write."""
    check_tensor(OP_WRITE, "k_idx", k_idx, ndim=2, dtypes=FLOAT_DTYPES, expected="[T, d_idx]")
    T, d = k_idx.shape
    check_tensor(OP_WRITE, "slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, shape=(T,),
                 expected="[T] int32/int64")
    check_index_cache(OP_WRITE, k_idx_cache, d)
    check_same_device(OP_WRITE, k_idx=k_idx, slot_mapping=slot_mapping, k_idx_cache=k_idx_cache)
    if data_checks_enabled(slot_mapping):
        check_range(OP_WRITE, "slot_mapping", slot_mapping, 0, k_idx_cache.shape[0] * k_idx_cache.shape[1],
                    ignore=-1, what="num_blocks * block_size, or -1 for padding")


@torch.library.custom_op("mla::write_index_cache_ref", mutates_args=("k_idx_cache",), tags=LAYOUT_TAGS)
def write_index_cache_ref(k_idx: Tensor, slot_mapping: Tensor, k_idx_cache: Tensor) -> None:
    """Reference (plain torch, any device, no host sync): ``index_put_`` of the rows at valid slots
    (quantized first when the cache is fp8 ``uint8``)."""
    validate_write(k_idx, slot_mapping, k_idx_cache)
    rows = quantize_fp8_index(k_idx) if k_idx_cache.dtype == torch.uint8 else k_idx.to(k_idx_cache.dtype)
    scatter_rows(k_idx_cache, slot_mapping, rows)


@write_index_cache_ref.register_fake
def _(k_idx, slot_mapping, k_idx_cache):
    validate_write(k_idx, slot_mapping, k_idx_cache)
    return None


declare(OP_WRITE, "reference", torch.ops.mla.write_index_cache_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch")


def write_index_cache(k_idx: Tensor, slot_mapping: Tensor, k_idx_cache: Tensor, *, backend: str | None = None) -> None:
    """Write index keys ``k_idx [T, d_idx]`` into ``k_idx_cache [NB, BS, d_idx]`` (float) or ``uint8 [NB, BS,
    d_idx + 4]`` (fp8 index rows, quantized on write) at ``slot_mapping [T]`` (-1 = padding, skipped; the
    latent cache's slots). Mutates ``k_idx_cache``; returns None."""
    resolve(OP_WRITE, k_idx_cache.device, backend, dtype=k_idx.dtype).fn(k_idx, slot_mapping, k_idx_cache)


# Triton backends: their modules (and Triton) are imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton_lightning(q_idx: Tensor, weights: Tensor, k_idx_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                      query_seq: Tensor, query_pos: Tensor, topk: int) -> Tensor:
    import mla_compile.ops.triton.lightning_index  # noqa: F401  (registers mla::lightning_index_triton)
    return torch.ops.mla.lightning_index_triton(q_idx, weights, k_idx_cache, block_table, seq_lens, query_seq,
                                                query_pos, topk)


def _triton_write(k_idx: Tensor, slot_mapping: Tensor, k_idx_cache: Tensor) -> None:
    import mla_compile.ops.triton.index_cache_write  # noqa: F401  (registers mla::write_index_cache_triton)
    torch.ops.mla.write_index_cache_triton(k_idx, slot_mapping, k_idx_cache)


declare(OP_LIGHTNING, "triton", _triton_lightning, rank=10, available=_triton_available, dtypes=FLOATS,
        package="triton", gpu_tested=True, kernels=("lightning_index_triton", "_lightning_score_kernel"), note="ours")
declare(OP_WRITE, "triton", _triton_write, rank=10, available=_triton_available, dtypes=FLOATS, package="triton",
        gpu_tested=True, kernels=("write_index_cache_triton", "_index_write_kernel"), note="ours")
