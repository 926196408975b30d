"""Decode context parallelism (as vLLM's DCP) at the op level: a sequence's latent cache split by token.

Token ``t`` of a sequence lives on DCP rank ``(t // interleave) % dcp`` at local position
``(t // (interleave * dcp)) * interleave + t % interleave`` of that rank's own paged cache (block-interleaved:
``interleave`` consecutive tokens per rank, round robin; ``interleave = block_size`` fills whole blocks).
Each rank decodes over its part and returns ``(out, lse)``; the parts are all-gathered and merged by LSE with
``mla::merge_attn_states`` (natural-log LSE), which gives exactly the attention over the whole sequence.
A rank whose part is empty contributes ``lse = -inf`` and weighs nothing. KV capacity per rank grows ``dcp``
times (no rank holds a whole row set of a sequence).

Beyond one query per sequence (:func:`dcp_decode` with ``s_q > 1``, and
:class:`~mla_compile.parallel.attention.DCPAttention`): a decode query at position ``p`` sees the first
``local_seq_lens(p + 1)`` tokens of a rank's part (multi-token decode, ``query_len > 1``; :func:`query_rows`);
prefill over cached context attends each rank's context slices; a sparse (V3.2) layer picks its top-k from every
rank's candidates (:func:`merge_topk`); a sink + window layer attends each rank's share of the sink and window
positions (:func:`sink_window_slots`).

All helpers are tensor ops (no host syncs), usable in host planning or inside a compiled step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile import ops
from mla_compile.ops.sparse_index import sink_window_positions
from mla_compile.parallel.groups import Group
from mla_compile.parallel.layers import all_gather


def _check(dcp: int, interleave: int) -> None:
    if dcp < 1 or interleave < 1:
        raise ValueError(f"dcp and interleave must be positive, got dcp={dcp}, interleave={interleave}")


def owner(positions: Tensor, dcp: int, interleave: int) -> Tensor:
    """The DCP rank holding token ``positions`` of a sequence."""
    _check(dcp, interleave)
    return (positions // interleave) % dcp


def local_position(positions: Tensor, dcp: int, interleave: int) -> Tensor:
    """Where token ``positions`` sits in its owner's part of the sequence."""
    _check(dcp, interleave)
    return (positions // (interleave * dcp)) * interleave + positions % interleave


def global_position(local: Tensor, dcp: int, rank: int, interleave: int) -> Tensor:
    """The sequence position of DCP ``rank``'s token at ``local`` position of its part (inverse of
    :func:`local_position` on that rank's tokens)."""
    _check(dcp, interleave)
    return ((local // interleave) * dcp + rank) * interleave + local % interleave


def local_seq_lens(seq_lens: Tensor, dcp: int, rank: int, interleave: int) -> Tensor:
    """Tokens of sequences of ``seq_lens`` held by DCP ``rank`` (same dtype); sums to ``seq_lens`` over ranks."""
    _check(dcp, interleave)
    if not 0 <= rank < dcp:
        raise ValueError(f"rank must lie in [0, {dcp}), got {rank}")
    span = interleave * dcp
    full = seq_lens // span
    rest = seq_lens - full * span
    return full * interleave + (rest - rank * interleave).clamp(0, interleave)


def local_slot_mapping(positions: Tensor, block_table: Tensor, seq_index: Tensor, block_size: int, dcp: int,
                       rank: int, interleave: int) -> Tensor:
    """Cache slots of new tokens in DCP ``rank``'s cache, -1 for tokens another rank holds (the cache write skips
    them). ``positions [T]`` of tokens of sequences ``seq_index [T]``, whose local blocks are ``block_table``."""
    mine = owner(positions, dcp, interleave) == rank
    lp = local_position(positions, dcp, interleave).masked_fill(~mine, 0)  # others' tokens may pass my blocks
    block = block_table[seq_index, lp // block_size].long()
    return (block * block_size + lp % block_size).masked_fill(~mine, -1)


def merge_parts(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge ``P`` partial results over disjoint key sets, ``outs [P, T, H, D]`` and ``lses [P, T, H]``, by LSE
    with ``mla::merge_attn_states``: ``(out [T, H, D], lse [T, H])``."""
    out, lse = outs[0], lses[0]
    for p in range(1, outs.shape[0]):
        out, lse = ops.merge_attn_states(out, lse, outs[p], lses[p])
    return out, lse


def merge_topk(scores: Tensor, positions: Tensor, topk: int, group: Group) -> tuple[Tensor, Tensor]:
    """The ``topk`` best of every DCP rank's candidates: ``scores [T, k]`` (``-inf``: no candidate) at sequence
    positions ``positions [T, k]`` (int64), the same ``k`` on every rank of ``group``. Candidates are all-gathered
    and ordered by descending score, equal scores lower position first (the order of
    :func:`mla_compile.ops.sparse_index.select_topk`), so when each rank's candidates are its own top ``k >= topk``
    in that order, the result is exactly the top ``topk`` of the whole sequence. Returns ``(scores, positions)``
    ``[T, min(topk, P * k)]``, ``-inf`` / ``-1`` where fewer candidates exist."""
    if group.group is not None:
        P, (T, k) = group.size, scores.shape
        scores = all_gather(scores.unsqueeze(0), 0, group).permute(1, 0, 2).reshape(T, P * k)
        positions = all_gather(positions.unsqueeze(0), 0, group).permute(1, 0, 2).reshape(T, P * k)
    none = torch.isneginf(scores)
    positions = positions.masked_fill(none, torch.iinfo(torch.int64).max)  # after every real candidate
    by_pos = torch.argsort(positions, dim=-1, stable=True)
    scores, positions = scores.gather(-1, by_pos), positions.gather(-1, by_pos)
    scores = torch.where(scores == 0, 0.0, scores)  # -0.0 ties with 0.0, as in select_topk
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    scores, positions = scores.gather(-1, order), positions.gather(-1, order)
    return scores, positions.masked_fill(torch.isneginf(scores), -1)


def gather_merge(out: Tensor, lse: Tensor, group: Group) -> tuple[Tensor, Tensor]:
    """Every rank of ``group``'s partial ``(out [T, H, D], lse [T, H])`` over its own keys, all-gathered and merged
    by LSE (:func:`merge_parts`): the attention over the union of the ranks' keys, the same on every rank."""
    if group.group is None:
        return out, lse
    return merge_parts(all_gather(out.unsqueeze(0), 0, group), all_gather(lse.unsqueeze(0), 0, group))


def query_rows(block_table: Tensor, seq_lens: Tensor, positions: Tensor, query_len: int, dcp: int, rank: int,
               interleave: int) -> tuple[Tensor, Tensor]:
    """Multi-token decode over DCP ``rank``'s part as one query per row: ``(block_table [B * query_len,
    max_blocks], seq_lens [B * query_len])``, row ``b * query_len + i`` the ``i``-th query of sequence ``b``,
    seeing the first ``local_seq_lens(positions + 1)`` tokens of this rank's part (its causal limit here; a
    negative position sees none) and at most the sequence's ``seq_lens [B]`` here (padding sequences, length 0,
    stay empty). ``positions [B * query_len]``: each query's sequence position."""
    limit = local_seq_lens((positions.long() + 1).clamp(min=0), dcp, rank, interleave).to(seq_lens.dtype)
    table = block_table.repeat_interleave(query_len, 0)
    return table, torch.minimum(limit, seq_lens.repeat_interleave(query_len, 0))


def sink_window_slots(block_table: Tensor, query_seq: Tensor, query_pos: Tensor, block_size: int, sink: int,
                      window: int, dcp: int, rank: int, interleave: int) -> Tensor:
    """The sink + window rule under DCP: per query token, the slots in DCP ``rank``'s cache of the first ``sink``
    and the last ``window`` positions of its causal prefix ``[0, query_pos]`` that this rank holds,
    ``int32 [T, sink + window]`` (-1 for positions another rank holds, and padding; all -1 for padding tokens,
    ``query_seq == -1``). ``block_table [B, max_blocks]`` is this rank's (its part of sequence ``b`` in the first
    blocks of row ``b``). The union over the ranks is :func:`mla_compile.ops.sink_window_query_indices`'s
    selection, each position on its owner: attending each rank's slots and merging by LSE is exact."""
    live = query_seq >= 0
    L = torch.where(live, query_pos.long() + 1, 0)[:, None]
    pos, valid, _ = sink_window_positions(L, sink, window, sink + window)
    mine = valid & (owner(pos, dcp, interleave) == rank)
    lp = local_position(pos, dcp, interleave)
    col = (lp // block_size).clamp(max=max(block_table.shape[1] - 1, 0))
    seq = torch.where(live, query_seq.long(), 0)[:, None]
    if block_table.shape[0] == 0 or block_table.shape[1] == 0:
        blocks = torch.zeros_like(lp)
    else:
        blocks = block_table.long()[seq, torch.where(mine, col, 0)]
    return torch.where(mine, blocks * block_size + lp % block_size, -1).to(torch.int32)


def dcp_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, group: Group, *,
               kv_lora_rank: int = 512, backend: str | None = None, positions: Tensor | None = None,
               interleave: int | None = None) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode over a cache split across ``group`` (the DCP ranks): ``mla::decode``'s contract
    (:func:`mla_compile.ops.decode`) over the whole sequences, each rank holding its part.

    ``q [B, H, D]`` (one query per sequence) or ``[B, s_q, H, D]``: the same queries on every rank of the group;
    ``kv_cache``, ``block_table``, ``seq_lens``: this rank's part (``seq_lens`` from :func:`local_seq_lens` of
    each sequence's length after the step, may be 0). With ``s_q > 1`` the new tokens are the last ``s_q`` of
    each sequence and query ``i`` sees the positions before ``G - (s_q - 1 - i)`` (``G``: the whole length, the
    sum of the group's ``seq_lens``, all-gathered), or, given ``positions [B, s_q]`` (int; no gather), the
    positions up to ``positions[b, i]``. ``interleave``: the split's tokens per rank in a row (default: the
    cache's block size). Returns ``(out [B, (s_q,) H, kv_lora_rank], lse [B, (s_q,) H])`` on every rank, q's
    layout; a query that sees no tokens anywhere gets ``out = 0``, ``lse = -inf``.
    """
    if q.dim() not in (3, 4):
        raise ValueError(f"dcp_decode: q must be [B, H, D] or [B, s_q, H, D], got {list(q.shape)}")
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(1) if squeeze else q
    B, s_q, H, D = q4.shape
    table, lens = block_table, seq_lens
    if s_q > 1:
        interleave = kv_cache.shape[1] if interleave is None else interleave
        if positions is None:
            total = all_gather(seq_lens.unsqueeze(0), 0, group).sum(0)
            positions = total.long()[:, None] - s_q + torch.arange(s_q, device=q.device)[None, :]
        elif tuple(positions.shape) != (B, s_q):
            raise ValueError(f"dcp_decode: positions must be [B, s_q] = [{B}, {s_q}], got {list(positions.shape)}")
        table, lens = query_rows(block_table, seq_lens, positions.reshape(-1), s_q, group.size, group.rank,
                                 interleave)
    out, lse = ops.decode(q4.reshape(B * s_q, H, D), kv_cache, table, lens, scale, kv_lora_rank=kv_lora_rank,
                          backend=backend)
    out, lse = gather_merge(out, lse, group)
    if squeeze:
        return out, lse
    return out.view(B, s_q, H, kv_lora_rank), lse.view(B, s_q, H)


def plan_dcp_step(decode, prefill, block_size: int, dcp: int, rank: int, *, interleave: int | None = None,
                  **plan_kw):
    """:func:`~mla_compile.models.metadata.plan_step` for DCP ``rank``: the chunks' ``blocks`` are this rank's own cache
    blocks of each sequence (enough for its part, :func:`local_seq_lens`); ``start`` and the tokens are the
    sequence's, as without DCP. Returns the step with this rank's metadata: slots of the tokens it holds (-1 for
    the others), its block tables and its part of each decode sequence's length. Positions and logits rows are
    the same on every rank. ``interleave`` defaults to ``block_size``. Decode chunks of ``query_len > 1`` tokens
    (``query_len=`` as for ``plan_step``) are planned alike.

    Prefill chunks over cached context (``start > 0``: prefix hits, chunked prefill) get this rank's context
    slices (:func:`~mla_compile.models.metadata.context_slices` of its part of each context), present on every rank
    whenever any chunk has context, so every rank's graph runs the same collectives.
    """
    import numpy as np

    from mla_compile.models.metadata import SeqChunk, plan_step

    interleave = block_size if interleave is None else interleave
    _check(dcp, interleave)
    if not 0 <= rank < dcp:
        raise ValueError(f"rank must lie in [0, {dcp}), got {rank}")
    chunks = list(decode) + list(prefill)
    for i, c in enumerate(chunks):
        end = torch.tensor([c.start + len(c.tokens)])
        need = -(-int(local_seq_lens(end, dcp, rank, interleave)[0]) // block_size)
        if len(c.blocks) < need:
            raise ValueError(f"sequence {i}: this rank holds {need} blocks of its first {int(end[0])} tokens, but "
                             f"{len(c.blocks)} local blocks were given")
    # the global plan (ids, positions, cu_seqlens, logits rows), with stand-in blocks of the right count
    stand_in = lambda c: SeqChunk(range(-(-(c.start + len(c.tokens)) // block_size)), c.tokens, c.start)  # noqa: E731
    step = plan_step([stand_in(c) for c in decode], [stand_in(c) for c in prefill], block_size, **plan_kw)
    meta = step.meta
    width = max([len(c.blocks) for c in chunks] + [1])
    slots = np.full(step.input_ids.shape[0], -1, dtype=np.int64)
    at = 0
    q = meta.decode.query_len if meta.decode is not None else 1
    for c in decode:  # decode tokens first (query_len each), padding sequences after the real ones
        for j in range(len(c.tokens)):
            slots[at + j] = _local_slot(c.start + j, c.blocks, block_size, dcp, rank, interleave)
        at += q
    if meta.decode is not None:
        at = meta.decode.block_table.shape[0] * q
        table = np.zeros((meta.decode.block_table.shape[0], width), dtype=np.int32)
        for i, c in enumerate(decode):
            table[i, :len(c.blocks)] = list(c.blocks)
        meta.decode.block_table = torch.from_numpy(table)
        meta.decode.seq_lens = local_seq_lens(meta.decode.seq_lens, dcp, rank, interleave)
    for c in prefill:
        for j in range(len(c.tokens)):
            slots[at + j] = _local_slot(c.start + j, c.blocks, block_size, dcp, rank, interleave)
        at += len(c.tokens)
    if meta.prefill is not None:
        table = np.zeros((meta.prefill.block_table.shape[0], width), dtype=np.int32)
        for i, c in enumerate(prefill):
            table[i, :len(c.blocks)] = list(c.blocks)
        meta.prefill.block_table = torch.from_numpy(table)
        if meta.prefill.context is not None:
            from mla_compile.models.metadata import context_slices

            starts = torch.tensor([c.start for c in prefill] + [0] * (table.shape[0] - len(prefill)))
            meta.prefill.context = context_slices(local_seq_lens(starts, dcp, rank, interleave).tolist(),
                                                  plan_kw.get("context_chunk_tokens", 65536),
                                                  plan_kw.get("min_batch", 2))
    meta.slot_mapping = torch.from_numpy(slots)
    return step


def _local_slot(pos: int, blocks, block_size: int, dcp: int, rank: int, interleave: int) -> int:
    if (pos // interleave) % dcp != rank:
        return -1
    lp = (pos // (interleave * dcp)) * interleave + pos % interleave
    return int(blocks[lp // block_size]) * block_size + lp % block_size


def localize(meta, positions: Tensor, block_size: int, dcp: int, rank: int, interleave: int | None = None):
    """This DCP rank's metadata for a step planned as without DCP (``plan_step``, ``MetadataBuilder``), reusing the
    step's block ids as this rank's own: every rank's cache has the same blocks and a sequence's part fits the
    first of its blocks (simple, but each rank keeps as many blocks as one unsplit cache; plan with
    :func:`plan_dcp_step` to size each rank's cache to its part). Tensor ops on the step's device, no host sync.

    Cached context (prefix hits, chunked prefill) keeps the step's slices: slice ``c``'s positions ``[a, b)`` of
    a sequence are this rank's local positions ``[local_seq_lens(a), local_seq_lens(b))`` (contiguous, since a
    rank's tokens keep their order), and each slice's workspace size ``rows`` (host) stays the global one, an
    upper bound of the local rows. Decode steps of ``query_len > 1`` localize like single-token ones
    (:class:`~mla_compile.parallel.attention.DCPAttention` derives each query's causal limit from ``positions``).
    """
    from mla_compile.models.metadata import ContextSlices, DecodeMetadata, MLAMetadata, PrefillMetadata

    interleave = block_size if interleave is None else interleave
    parts, decode, prefill, n_dec = [], None, meta.prefill, 0
    if meta.decode is not None:
        d = meta.decode
        n_dec = d.num_tokens
        seq = torch.arange(n_dec, device=positions.device) // d.query_len
        parts.append(local_slot_mapping(positions[:n_dec], d.block_table, seq, block_size, dcp, rank, interleave))
        decode = DecodeMetadata(d.block_table, local_seq_lens(d.seq_lens, dcp, rank, interleave), d.query_len, d.plan)
    if meta.prefill is not None:
        p = meta.prefill
        rest = positions[n_dec:]
        tok = torch.arange(rest.shape[0], device=positions.device, dtype=p.cu_seqlens_q.dtype)
        seq = torch.searchsorted(p.cu_seqlens_q, tok, right=True) - 1
        seq = seq.clamp(0, p.block_table.shape[0] - 1)  # padding tokens past the last sequence: slot -1 below
        parts.append(local_slot_mapping(rest, p.block_table, seq, block_size, dcp, rank, interleave))
        if p.context is not None:
            ctx = p.context
            first = local_seq_lens(ctx.starts, dcp, rank, interleave)
            last = local_seq_lens(ctx.starts + ctx.cu_seqlens.diff(dim=1), dcp, rank, interleave)
            cu = torch.cat([torch.zeros_like(ctx.cu_seqlens[:, :1]), (last - first).cumsum(1).to(ctx.cu_seqlens.dtype)],
                           1)
            prefill = PrefillMetadata(p.cu_seqlens_q, p.cu_seqlens_k, p.block_table,
                                      ContextSlices(cu, first.to(ctx.starts.dtype), ctx.rows), p.plan)
    slots = parts[0] if len(parts) == 1 else torch.cat(parts)
    slots = slots.masked_fill(meta.slot_mapping < 0, -1)
    return MLAMetadata(slots, decode, prefill, meta.logits_indices)
