"""``mla::v4_attention``: DeepSeek-V4 attention over "window slots + selected compressed slots" with a sink.

V4 keeps one shared KV row per token (width ``D``, e.g. 512, the trailing ``rope_dim`` channels rotated)
read as both key and value. A query row ``q[t] [H, D]`` attends over the rows listed in
``window_slots[t]`` (physical slots of the token-row cache ``kv_cache [NB, BS, D]``) together with the
rows listed in ``comp_slots[t]`` (slots of a compressed-entry cache ``comp_cache [NBc, BSc, D]``); -1
marks an unused column, a slot listed twice counts twice. Each head ``h`` has a learnable sink
``sinks[h]``, an extra logit in the softmax denominator that contributes no value:

    s_j = scale * q[t, h] . row_j,    o = sum_j exp(s_j) row_j / (exp(sinks[h]) + sum_j exp(s_j))

Then the output's trailing ``rope_dim`` channels are rotated back by the query position (interleaved
pairs, angle ``-query_pos[t] * inv_freq``), as V4 does because the values carry the keys' RoPE.

Contract of the returned LSE: ``lse[t, h] = log(sum_j exp(s_j))`` over the listed slots only (natural
log, float32), without the sink, so that partial results over disjoint slot sets merge by LSE as for
every other attention op here; the sink is an exact LSE-level correction,
``o = o_without_sink * sigmoid(lse - sinks[h])``, which this op has applied to ``out``. A row whose
slots are all -1 gets ``lse = -inf`` and ``out = 0`` (with a sink the true denominator is never empty:
it is ``exp(sinks[h])`` and the attention mass on values is 0). ``sinks = -inf`` gives plain attention.

The slot lists come from :func:`window_slots` (the ``window`` positions ending at the query, through
the token block table) and :func:`compressed_slots` (every compressed entry the query may see, HCA) or
the V4 indexer's top-k (CSA, :mod:`mla_compile.ops.v4_index`): plain torch index arithmetic on
metadata tensors, no host reads, so a step that builds them is capturable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_range, check_same_device, check_tensor,
                                     data_checks_enabled)
from mla_compile.ops.registry import (FLOATS, LAYOUT_TAGS, call_impl, declare, declare_op, declare_split_op,
                                      run_split_part)
from mla_compile.ops.select import resolve

OP = declare_op("v4_attention", "mla.v4_attention", cache=True)


def validate(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor, comp_slots: Tensor,
             sinks: Tensor, query_pos: Tensor, inv_freq: Tensor) -> None:
    """Shape/dtype checks (no sync); slot range checks on CPU or in checked mode."""
    check_tensor(OP, "q", q, ndim=3, dtypes=FLOAT_DTYPES, expected="[T, H, D]")
    T, H, D = q.shape
    check_tensor(OP, "kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, D),
                 expected=f"[num_blocks, block_size, {D}] (q's last dim)")
    check_tensor(OP, "comp_cache", comp_cache, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, D),
                 expected=f"[num_blocks, block_size, {D}] (q's last dim)")
    check_tensor(OP, "window_slots", window_slots, ndim=2, dtypes=INDEX_DTYPES, shape=(T, None),
                 expected=f"[{T}, W] slots of kv_cache, -1 = unused")
    check_tensor(OP, "comp_slots", comp_slots, ndim=2, dtypes=INDEX_DTYPES, shape=(T, None),
                 expected=f"[{T}, K] slots of comp_cache, -1 = unused")
    check_tensor(OP, "sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES, shape=(H,), expected=f"[{H}] per-head sink logits")
    check_tensor(OP, "query_pos", query_pos, ndim=1, dtypes=INDEX_DTYPES, shape=(T,), expected=f"[{T}] positions")
    check_tensor(OP, "inv_freq", inv_freq, ndim=1, dtypes=FLOAT_DTYPES, expected="[rope_dim / 2]")
    if not 0 <= 2 * inv_freq.shape[0] <= D:
        raise ValueError(f"{OP}: inv_freq must have rope_dim / 2 <= D / 2 = {D // 2} entries, got {inv_freq.shape[0]}")
    check_same_device(OP, q=q, kv_cache=kv_cache, comp_cache=comp_cache, window_slots=window_slots,
                      comp_slots=comp_slots, sinks=sinks, query_pos=query_pos, inv_freq=inv_freq)
    if data_checks_enabled(window_slots):
        check_range(OP, "window_slots", window_slots, 0, kv_cache.shape[0] * kv_cache.shape[1], ignore=-1,
                    what="num_blocks * block_size of kv_cache, or -1")
        check_range(OP, "comp_slots", comp_slots, 0, comp_cache.shape[0] * comp_cache.shape[1], ignore=-1,
                    what="num_blocks * block_size of comp_cache, or -1")


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x [T, H, D]`` as interleaved pairs
    ``(x0, x1), (x2, x3), ...`` by ``cos/sin [T, rope_dim / 2]`` (V4's layout: ``[nope | rope]``, pairs kept
    in place): ``(a, b) -> (a cos - b sin, b cos + a sin)``."""
    r = 2 * cos.shape[-1]
    if r == 0:
        return x
    nope, rope = x[..., : x.shape[-1] - r], x[..., x.shape[-1] - r:]
    a, b = rope[..., 0::2], rope[..., 1::2]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return torch.cat([nope, rot], dim=-1)


@torch.library.custom_op("mla::v4_attention_ref", mutates_args=(), tags=LAYOUT_TAGS)
def v4_attention_ref(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor, comp_slots: Tensor,
                     sinks: Tensor, query_pos: Tensor, inv_freq: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device, float32 or float64 math): gather, masked softmax, sink, rotate back."""
    validate(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    D = q.shape[2]
    slots = torch.cat([window_slots.long(), comp_slots.long()], dim=1)  # [T, L]
    visible = slots >= 0
    n_win = kv_cache.shape[0] * kv_cache.shape[1]
    flat = torch.cat([kv_cache.reshape(-1, D).to(acc), comp_cache.reshape(-1, D).to(acc)], dim=0)
    offset = torch.cat([torch.zeros_like(window_slots, dtype=torch.long),
                        torch.full_like(comp_slots, n_win, dtype=torch.long)], dim=1)
    rows = flat[torch.where(visible, slots + offset, 0)]
    rows = torch.where(visible[..., None], rows, 0)  # unwritten rows may hold NaN
    scores = torch.einsum("thd,tld->thl", q.to(acc), rows) * scale
    vis = visible[:, None, :]
    scores = scores.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H], -inf when nothing is visible
    probs = torch.where(vis, torch.exp(scores - lse[..., None]), 0.0)
    out = torch.einsum("thl,tld->thd", probs, rows)
    share = torch.where(torch.isneginf(lse), 0.0, torch.sigmoid(lse - sinks.to(acc)[None, :]))  # -inf - -inf: NaN
    out = out * share[..., None]  # the slots' share of the mass, the rest goes to the sink
    freqs = query_pos.to(acc)[:, None] * inv_freq.to(acc)[None, :]
    out = rotate_interleaved(out, freqs.cos(), -freqs.sin())
    return out.to(q.dtype).contiguous(), lse.to(torch.float32).contiguous()


def fake(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq, scale, *backend_args):
    """Fake outputs shared by every v4_attention implementation: validate, then ``out``, ``lse``."""
    validate(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq)
    T, H, D = q.shape
    return q.new_empty(T, H, D), q.new_empty(T, H, dtype=torch.float32)


v4_attention_ref.register_fake(fake)


declare(OP, "reference", torch.ops.mla.v4_attention_ref, rank=100, devices=("any",), dtypes=FLOATS,
        cache_dtypes=FLOATS, gpu_tested=True, note="plain torch, the numerical ground truth")


def v4_attention(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor, comp_slots: Tensor,
                 sinks: Tensor, query_pos: Tensor, inv_freq: Tensor, scale: float, *,
                 backend: str | None = None, slots: int | None = None) -> tuple[Tensor, Tensor]:
    """V4 sink attention; see the module docstring. Returns ``out [T, H, D]`` (q's dtype), ``lse [T, H]`` float32.

    ``backend``: None/"auto" (the selector's choice: by the timing table of this GPU, a split that runs the
    fastest backend for the call's number of query rows ``T``, :func:`v4_attention_split`), or a declared
    backend name ("reference", "triton", "flashmla", or a split's name). ``slots``: the number of slots each
    query row lists (``W + K``), the "context" of the selector's timing class; give it only when it is fixed
    for the model (a sliding layer's window, a CSA layer's window + top-k), not when it grows with the
    context (an HCA layer's entry list): None, the default, ranks by the op's timings at every slot count."""
    # the selector's facts: heads, head dims (D,) (a backend may take only some, FlashMLA 512), listed slots
    impl = resolve(OP, q.device, backend, dtype=q.dtype, cache=kv_cache,
                   shape=lambda: (q.shape[1], (q.shape[2],), 1, slots))
    return call_impl(OP, impl, (q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq, scale),
                     None)


@torch.library.custom_op("mla::v4_attention_split", mutates_args=(), tags=LAYOUT_TAGS)
def v4_attention_split(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor, comp_slots: Tensor,
                       sinks: Tensor, query_pos: Tensor, inv_freq: Tensor, scale: float, tiers: str,
                       plan_id: int) -> tuple[Tensor, Tensor]:
    """``mla::v4_attention`` through the part of ``tiers`` (``"triton:2/flashmla"``: see
    :func:`~mla_compile.ops.registry.split_name`) whose row bound covers this call's ``T`` query rows (a
    static shape at run time: each CUDA-graph size records its own part). ``plan_id``: -1 (no v4_attention
    backend plans on the host)."""
    return run_split_part(OP, tiers, q.shape[0],
                          (q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq, scale),
                          plan_id)


v4_attention_split.register_fake(fake)
declare_split_op(OP, torch.ops.mla.v4_attention_split, "batch")


# ------------------------------------------------------------------------------------------- slot lists

def window_slots(block_table: Tensor, query_seq: Tensor, query_pos: Tensor, *, block_size: int,
                 window: int) -> Tensor:
    """``int32 [T, window]``: column j is the slot of position ``query_pos[t] - window + 1 + j`` of the
    query's sequence (row ``query_seq[t]`` of ``block_table [B, max_blocks]``); -1 for negative positions
    and for padding tokens (``query_seq == -1``). The query's own row is the last column."""
    T = query_seq.shape[0]
    if block_table.shape[0] == 0 or block_table.shape[1] == 0:
        return torch.full((T, window), -1, dtype=torch.int32, device=query_seq.device)
    live = query_seq >= 0
    seq = torch.where(live, query_seq.long(), 0)
    pos = query_pos.long()[:, None] - window + 1 + torch.arange(window, device=query_seq.device)[None, :]
    ok = (pos >= 0) & live[:, None]
    p = pos.clamp(min=0)
    blocks = block_table.long()[seq[:, None], (p // block_size).clamp(max=block_table.shape[1] - 1)]
    return torch.where(ok, blocks * block_size + p % block_size, -1).to(torch.int32)


def compressed_slots(block_table: Tensor, query_seq: Tensor, query_pos: Tensor, *, block_size: int,
                     rate: int) -> Tensor:
    """``int32 [T, max_blocks * block_size]``: column j is the slot of compressed entry j of the query's
    sequence (``block_table [B, max_blocks]`` of the entry cache) when the query may see it, i.e. entry j's
    window ``[j * rate, (j + 1) * rate)`` has ended at or before the query (``j < (query_pos + 1) // rate``),
    else -1 (also for padding tokens). Every visible entry is listed: heavily compressed attention."""
    T = query_seq.shape[0]
    n = block_table.shape[1] * block_size
    if block_table.shape[0] == 0 or n == 0:
        return torch.full((T, n), -1, dtype=torch.int32, device=query_seq.device)
    live = query_seq >= 0
    seq = torch.where(live, query_seq.long(), 0)
    j = torch.arange(n, device=query_seq.device)[None, :]
    ok = (j < (query_pos.long()[:, None] + 1) // rate) & live[:, None]
    blocks = block_table.long()[seq[:, None], j // block_size]
    return torch.where(ok, blocks * block_size + j % block_size, -1).to(torch.int32)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor, comp_slots: Tensor,
            sinks: Tensor, query_pos: Tensor, inv_freq: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.v4_attention  # noqa: F401  (registers mla::v4_attention_triton)
    return torch.ops.mla.v4_attention_triton(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos,
                                             inv_freq, scale)


declare(OP, "triton", _triton, rank=10, available=_triton_available, dtypes=FLOATS, cache_dtypes=FLOATS,
        package="triton", gpu_tested=True, kernels=("v4_attention_triton", "_v4_attention_kernel"),
        note="ours; slot lists split over up to 16 programs, merged by a second kernel")
