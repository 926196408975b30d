"""FlashMLA's sparse kernel (PyPI ``sgl-flash-mla``, ``flash_mla.flash_mla_sparse_fwd``) as backend
``"flashmla"`` of ``mla::v4_attention``.

Call contract (``flash_mla_interface.py`` of sgl-flash-mla 1.0.0; Hopper kernels behind ``use_legacy=True``):
``out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=,
topk_length=, use_legacy=True)`` with ``q [s_q, h_q, 512]`` bf16 (``h_q`` 64 or 128, heads contiguous),
``kv [s_kv, 1, 512]`` bf16, ``indices [s_q, 1, topk]`` int32 (-1 or ``>= s_kv`` invalid; ``topk`` in whole
tiles), optional ``attn_sink [h_q]`` float32 (output times ``exp(lse) / (exp(lse) + exp(sink))``, the LSE
untouched) and ``topk_length [s_q]`` int32 (only the leading ``topk_length[i]`` indices are read);
``out [s_q, h_q, 512]`` bf16, ``lse [s_q, h_q]`` float32 in natural log (``return_log2_lse=None``, the
default). Rows without a valid index are undefined there.

Mapping: our token-row cache ``kv_cache [NB, BS, D]`` and entry cache ``comp_cache`` become
``[NB * BS, 1, D]`` views (no copy; slot ``s`` is row ``s``). Each slot list becomes FlashMLA's index list:
out-of-range slots turn into -1 (FlashMLA's prefill treats ``>= s_kv`` as invalid, its decode checks no
bound; the Triton kernel masks them), padded with -1 to a multiple of :data:`TOPK_TILE`, and
``topk_length`` = last valid column + 1 so trailing -1 tiles are skipped (one Triton launch a list on CUDA,
``ops/triton/v4_finish.py``). When one list serves (a sliding layer's empty compressed list, or both lists on the
same cache, side by side in one index list) one call per head group applies the sink through ``attn_sink``;
otherwise the window and the compressed lists are two calls, merged by LSE in float32, and the sink is applied
once on the merged result as ``out * sigmoid(lse - sink)``. Heads are zero-padded to 64 (H <= 64) or 128 (one
call per 128 heads).
Then rows with no valid slot get ``out = 0``, ``lse = -inf``, and the output's trailing ``rope_dim``
channels are rotated back by ``-query_pos * inv_freq`` (interleaved pairs), in float32: one Triton launch
per head group on CUDA (``ops/triton/v4_finish.py``), torch ops elsewhere.

Everything is device tensor arithmetic on shapes known at trace time: no host reads, no scheduling
metadata (the sparse prefill kernel has none), so a captured CUDA graph replays with any slot values.
FlashMLA's fp8 decode (``flash_mla_with_kvcache`` with the V4 / V4.1 fp8 token formats and
``extra_k_cache``) is not used: our V4 caches hold bf16 rows, not those byte formats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops.adapters._common import (check_dtype, check_value, importable, require_capability,
                                              triton_available)
from mla_compile.ops.registry import LAYOUT_TAGS, SM90, declare
from mla_compile.ops.v4_attention import OP, rotate_interleaved, validate

BACKEND = "flashmla"
MODULE = "flash_mla"
DTYPES = (torch.bfloat16,)
HEAD_DIM = 512  # d_qk = d_v: FlashMLA's V4 kernels take 512 only
SPARSE_HEADS = (64, 128)  # the h_q FlashMLA's sparse kernels accept
# Index lists are padded to a multiple of this: FlashMLA wants topk a multiple of its kernel's index tile
# ("topk mod B_TOPK must be 0"; 64 in the sm90 decode path we already use, 128 covers a 128 tile too), and
# topk_length makes the kernel skip the padding
TOPK_TILE = 128
LSE_SCALE = 1.0  # FlashMLA's sparse prefill returns natural-log LSE by default: nothing to convert


def available() -> bool:
    """Whether ``flash_mla`` is installed (found without importing it)."""
    return importable(MODULE)


def flat_rows(name: str, cache: Tensor) -> Tensor:
    """``cache [NB, BS, D]`` as FlashMLA's ``kv [NB * BS, 1, D]``, a view (slot ``s`` is row ``s``).

    Needs contiguous rows and pages that follow each other at ``BS`` rows (a contiguous cache or a slice
    of one along the blocks); anything else is a ValueError naming the argument."""
    nb, bs, d = cache.shape
    if cache.stride(2) != 1 or (nb > 1 and cache.stride(0) != bs * cache.stride(1)) or cache.stride(1) % 8:
        raise ValueError(f"{OP}: backend {BACKEND!r} reads {name} as one row array [num_blocks * block_size, 1, "
                         f"{d}]: it needs contiguous rows, a row stride that is a multiple of 8 and a block stride "
                         f"of block_size * row stride, got strides {tuple(cache.stride())}; allocate the cache "
                         f"contiguous or use backend='triton'")
    return cache.as_strided((nb * bs, 1, d), (cache.stride(1), d, 1))


def index_width(slots: int) -> int:
    """The width of FlashMLA's index list for ``slots`` slots: the next positive multiple of :data:`TOPK_TILE`."""
    return max(-(-slots // TOPK_TILE), 1) * TOPK_TILE


def sparse_indices(slots: Tensor, n_rows: int, more: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """FlashMLA's index list for our slot list ``slots [T, L]`` (with ``more [T, L2]``: the two side by side) over
    a cache of ``n_rows`` rows.

    Returns ``indices [T, 1, Lp]`` int32 (slots outside ``[0, n_rows)`` -> -1, padded with -1 to a positive
    multiple of :data:`TOPK_TILE`), ``topk_length [T]`` int32 (last valid column + 1, 0 for none) and
    ``live [T]`` bool (the row has a valid slot). Shapes only, no host read. One Triton launch on CUDA
    (``ops/triton/v4_finish.py``), torch ops elsewhere."""
    T = slots.shape[0]
    L = slots.shape[1] + (0 if more is None else more.shape[1])
    if slots.is_cuda and triton_available():
        from mla_compile.ops.triton.v4_finish import sparse_indices_triton
        return sparse_indices_triton(slots.contiguous(), n_rows, None if more is None else more.contiguous(),
                                     index_width(L))
    if more is not None:
        slots = torch.cat([slots.to(more.dtype), more], dim=1)
    valid = (slots >= 0) & (slots < n_rows)
    idx = torch.nn.functional.pad(torch.where(valid, slots, -1).to(torch.int32), (0, index_width(L) - L), value=-1)
    col = torch.arange(1, L + 1, device=slots.device, dtype=torch.int32)
    length = torch.where(valid, col, 0).amax(dim=1) if L else torch.zeros(T, dtype=torch.int32, device=slots.device)
    return idx.unsqueeze(1).contiguous(), length.to(torch.int32).contiguous(), valid.any(dim=1)


def head_groups(H: int) -> tuple[int, list[tuple[int, int]]]:
    """The padded head count FlashMLA runs (64 for H <= 64, else 128) and the ``(start, stop)`` head ranges,
    one call each."""
    width = SPARSE_HEADS[0] if H <= SPARSE_HEADS[0] else SPARSE_HEADS[1]
    return width, [(h, min(h + width, H)) for h in range(0, H, width)]


def _padded(q: Tensor, sinks: Tensor, h0: int, h1: int, width: int) -> tuple[Tensor, Tensor]:
    """Heads ``h0:h1`` of ``q [T, H, 512]`` zero-padded to ``width`` (contiguous) and their sinks as float32,
    padded with -inf (which has no effect in FlashMLA)."""
    T, _, D = q.shape
    qg, sink = q[:, h0:h1], sinks[h0:h1].to(torch.float32)
    if h1 - h0 != width:
        qg = torch.cat([qg, qg.new_zeros(T, width - (h1 - h0), D)], dim=1)
        sink = torch.cat([sink, sink.new_full((width - (h1 - h0),), float("-inf"))])
    return qg.contiguous(), sink.contiguous()


def combine(parts: list[tuple[Tensor, Tensor, Tensor]], sinks: Tensor, sink_applied: bool) -> tuple[Tensor, Tensor]:
    """Merge partial results ``(out [T, H, D], lse [T, H], live [T])`` over disjoint slot lists by LSE in
    float32 and apply the sink's share ``sigmoid(lse - sink)`` unless FlashMLA already did (one part).
    Rows that are not live in a part drop that part whatever FlashMLA wrote there (NaN, inf); rows live in
    none get ``out = 0``, ``lse = -inf``. Returns float32 ``out`` and ``lse``."""
    outs = [torch.where(live[:, None, None], out.float(), 0.0) for out, _, live in parts]
    lses = [torch.where(live[:, None], lse.float() * LSE_SCALE, float("-inf")) for _, lse, live in parts]
    if len(parts) == 1:
        out, lse = outs[0], lses[0]
    else:
        m = torch.stack(lses).amax(dim=0)
        shift = torch.where(torch.isneginf(m), 0.0, m)
        w = [torch.exp(x - shift) for x in lses]
        total = sum(w)
        lse = shift + torch.log(total)  # -inf where no part is live
        inv = torch.where(total > 0, 1.0 / torch.where(total > 0, total, 1.0), 0.0)
        out = sum(o * (wi * inv)[..., None] for o, wi in zip(outs, w))
    if not sink_applied:
        share = torch.where(torch.isneginf(lse), 0.0, torch.sigmoid(lse - sinks.float()[None, :]))
        out = out * share[..., None]
    return out, lse


def flashmla_v4_attention_core(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor,
                               comp_slots: Tensor, sinks: Tensor, query_pos: Tensor, inv_freq: Tensor,
                               scale: float) -> tuple[Tensor, Tensor]:
    """``mla::v4_attention`` through FlashMLA on any tensors (CPU with a fake ``flash_mla`` in tests).

    Returns ``out [T, H, D]`` (q's dtype) and ``lse [T, H]`` float32 under the op's contract."""
    validate(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq)
    check_dtype(OP, BACKEND, "q", q, DTYPES)
    check_dtype(OP, BACKEND, "kv_cache", kv_cache, DTYPES)
    check_dtype(OP, BACKEND, "comp_cache", comp_cache, DTYPES)
    check_value(OP, BACKEND, "head dim (q.shape[-1])", q.shape[-1], (HEAD_DIM,))
    T, H, D = q.shape
    lists = [(kv_cache, window_slots, None, "kv_cache")] if window_slots.shape[1] else []
    if comp_slots.shape[1]:
        same = (comp_cache.data_ptr() == kv_cache.data_ptr() and comp_cache.shape == kv_cache.shape
                and comp_cache.stride() == kv_cache.stride())
        if same and lists:  # both lists index one cache: one call over the two lists side by side
            lists = [(kv_cache, window_slots, comp_slots, "kv_cache")]
        else:
            lists.append((comp_cache, comp_slots, None, "comp_cache"))
    if T * H == 0 or not lists:
        return q.new_zeros(T, H, D), q.new_full((T, H), float("-inf"), dtype=torch.float32)
    import flash_mla

    one = len(lists) == 1
    prepared = []
    for cache, slots, more, name in lists:
        kv = flat_rows(name, cache)
        prepared.append((kv, *sparse_indices(slots, kv.shape[0], more)))
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    width, groups = head_groups(H)
    for h0, h1 in groups:
        qg, sink = _padded(q, sinks, h0, h1, width)
        parts = []
        for kv, idx, length, live in prepared:
            o, _max_logits, l = flash_mla.flash_mla_sparse_fwd(
                qg, kv, idx, scale, d_v=HEAD_DIM, attn_sink=sink if one else None, topk_length=length,
                use_legacy=True)
            parts.append((o[:, :h1 - h0], l[:, :h1 - h0], live))
        finish(parts, sinks[h0:h1], one, query_pos, inv_freq, out[:, h0:h1], lse[:, h0:h1])
    return out, lse


def finish(parts: list[tuple[Tensor, Tensor, Tensor]], sinks: Tensor, sink_applied: bool, query_pos: Tensor,
           inv_freq: Tensor, out: Tensor, lse: Tensor) -> None:
    """:func:`combine` then the rope back-rotation, written into the views ``out [T, h, D]`` and ``lse [T, h]``.
    One Triton launch on CUDA (``ops/triton/v4_finish.py``), torch ops elsewhere."""
    if out.is_cuda and triton_available():
        from mla_compile.ops.triton.v4_finish import v4_finish_triton
        v4_finish_triton(parts, sinks, sink_applied, query_pos, inv_freq, out, lse)
        return
    o, l = combine(parts, sinks, sink_applied)
    freqs = query_pos.float()[:, None] * inv_freq.float()[None, :]
    out.copy_(rotate_interleaved(o, freqs.cos(), -freqs.sin()))
    lse.copy_(l)


@torch.library.custom_op("mla::v4_attention_flashmla", mutates_args=(), tags=LAYOUT_TAGS)
def v4_attention_flashmla(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor, comp_slots: Tensor,
                          sinks: Tensor, query_pos: Tensor, inv_freq: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``mla::v4_attention`` through FlashMLA's sparse kernel on sm90 (same contract as ``mla::v4_attention_ref``)."""
    require_capability(OP, BACKEND, q.device, SM90, SM90)
    return flashmla_v4_attention_core(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq,
                                      scale)


@v4_attention_flashmla.register_fake
def _(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq, scale):
    validate(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq)
    T, H, D = q.shape
    return q.new_empty(T, H, D), q.new_empty(T, H, dtype=torch.float32)


declare(OP, BACKEND, torch.ops.mla.v4_attention_flashmla, rank=20, available=available, dtypes=DTYPES,
        cache_dtypes=DTYPES, head_dims=((HEAD_DIM,),), stride_align=8, min_capability=SM90, max_capability=SM90,
        package="sgl-flash-mla", gpu_tested=True, kernels=("_v4_finish_kernel=flashmla (adapter boundary)",),
        note="FlashMLA's sparse kernel (flash_mla_sparse_fwd, sm90): window and compressed lists as two calls "
             "merged by LSE (one call with attn_sink when one list serves), heads padded to 64 / 128")
