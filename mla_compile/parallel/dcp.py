"""Decode context parallelism (as vLLM's DCP) at the op level: a sequence's latent cache split by token.

Token ``t`` of a sequence lives on DCP rank ``(t // interleave) % dcp`` at local position
``(t // (interleave * dcp)) * interleave + t % interleave`` of that rank's own paged cache (block-interleaved:
``interleave`` consecutive tokens per rank, round robin; ``interleave = block_size`` fills whole blocks).
Each rank decodes over its part and returns ``(out, lse)``; the parts are all-gathered and merged by LSE with
``mla::merge_attn_states`` (natural-log LSE), which gives exactly the attention over the whole sequence.
A rank whose part is empty contributes ``lse = -inf`` and weighs nothing. KV capacity per rank grows ``dcp``
times (no rank holds a whole row set of a sequence).

All helpers are tensor ops (no host syncs), usable in host planning or inside a compiled step.
"""

from __future__ import annotations

from torch import Tensor

from mla_compile import ops
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


def dcp_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, group: Group, *,
               kv_lora_rank: int = 512, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode of one query per sequence over a cache split across ``group`` (the DCP ranks).

    ``q [B, H, D]``: the same queries on every rank of the group; ``kv_cache``, ``block_table``, ``seq_lens``:
    this rank's part (``seq_lens`` from :func:`local_seq_lens`, may be 0). Returns ``(out [B, H, kv_lora_rank],
    lse [B, H])`` of attention over the whole sequences, on every rank; a sequence with no tokens anywhere
    gets ``out = 0``, ``lse = -inf``.
    """
    if q.dim() != 3:
        raise ValueError(f"dcp_decode: q must be [B, H, D] (one query per sequence), got {list(q.shape)}")
    out, lse = ops.decode(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank=kv_lora_rank, backend=backend)
    if group.size == 1 and group.group is None:
        return out, lse
    outs = all_gather(out.unsqueeze(0), 0, group)
    lses = all_gather(lse.unsqueeze(0), 0, group)
    return merge_parts(outs, lses)
