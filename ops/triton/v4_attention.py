"""Triton kernel for ``mla::v4_attention``: DeepSeek-V4 sink attention over window + compressed slots.

One program owns ``BLOCK_H`` heads of one query row t. It walks the row's window slots (token-row cache)
and then its compressed slots (entry cache) in tiles of ``BLOCK_N``; -1 and out-of-range slots are masked.
Each row is loaded as three tiles: the ``D - rope_dim`` leading (nope) channels and the even and odd
channels of the trailing rope slice, so the final back-rotation of the output's interleaved pairs is a
per-pair update of two accumulators. Online softmax in base 2 (float32), then the sink factor
``sigmoid(lse - sink)`` and the rotation by ``-pos * inv_freq``. A row with no valid slot gets
``out = 0``, ``lse = -inf``. Long slot lists are split over up to 16 programs (the count comes from the
lists' widths, shapes only; up to 32 of a tile or two each for a static handful of rows), whose partial (max, sum,
accumulator) a second kernel merges before the sink and the rotation; nothing is read on the host, so a captured
CUDA graph replays with any slot values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.triton._common import last_dim_contiguous, pow2
from mla_compile.ops.v4_attention import validate

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    return tl.dot(a, tl.trans(b))


@triton.jit
def _pv(p, v, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v, acc)


@triton.jit
def _tile(q_n, q_e, q_o, row, ok, offs_n, offs_r, n_ok, r_ok, DN, m_i, l_i, acc_n, acc_e, acc_o, scale_log2,
          IEEE: tl.constexpr):
    """One tile of rows (``row`` pointers, ``ok`` mask): scores, online-softmax update of the three parts."""
    k_n = tl.load(row[:, None] + offs_n[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0)
    k_e = tl.load(row[:, None] + DN + 2 * offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
    k_o = tl.load(row[:, None] + DN + 2 * offs_r[None, :] + 1, mask=ok[:, None] & r_ok[None, :], other=0.0)
    s = _dot(q_n, k_n, IEEE) + _dot(q_e, k_e, IEEE) + _dot(q_o, k_o, IEEE)
    s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc_n = _pv(p, k_n, acc_n * alpha[:, None], IEEE)
    acc_e = _pv(p, k_e, acc_e * alpha[:, None], IEEE)
    acc_o = _pv(p, k_o, acc_o * alpha[:, None], IEEE)
    return m_new, l_i, acc_n, acc_e, acc_o


@triton.jit
def _finish(acc_n, acc_e, acc_o, m_i, l_i, t, heads, h_ok, offs_n, offs_r, n_ok, r_ok, sink_ptr, pos_ptr, freq_ptr,
            o_ptr, lse_ptr, H, D: tl.constexpr, DN: tl.constexpr):
    """Normalise (base-2 ``m_i``, ``l_i``), apply the sink's share, rotate the rope pairs back, store."""
    empty = l_i == 0.0
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
    # sigmoid(lse - sink) / l: the softmax normaliser and the sink's share in one factor (0 for empty rows)
    factor = tl.where(empty, 0.0, 1.0 / ((1.0 + tl.exp(sink - lse)) * tl.where(empty, 1.0, l_i)))
    out_n = acc_n * factor[:, None]
    e = acc_e * factor[:, None]
    o = acc_o * factor[:, None]
    pos = tl.load(pos_ptr + t).to(tl.float32)
    ang = pos * tl.load(freq_ptr + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    c, s = tl.cos(ang)[None, :], tl.sin(ang)[None, :]
    out_e = e * c + o * s  # rotation by -angle: (a, b) -> (a cos + b sin, b cos - a sin)
    out_o = o * c - e * s
    o_row = o_ptr + (t * H + heads.to(tl.int64)) * D
    ty = o_ptr.dtype.element_ty
    tl.store(o_row[:, None] + offs_n[None, :], out_n.to(ty), mask=h_ok[:, None] & n_ok[None, :])
    tl.store(o_row[:, None] + DN + 2 * offs_r[None, :], out_e.to(ty), mask=h_ok[:, None] & r_ok[None, :])
    tl.store(o_row[:, None] + DN + 2 * offs_r[None, :] + 1, out_o.to(ty), mask=h_ok[:, None] & r_ok[None, :])
    tl.store(lse_ptr + t * H + heads, lse, mask=h_ok)


@triton.jit
def _v4_attention_kernel(
    q_ptr, kv_ptr, ws_ptr, comp_ptr, cs_ptr, sink_ptr, pos_ptr, freq_ptr, o_ptr, lse_ptr, ws_acc_ptr, ws_ml_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_cb, stride_ct, stride_wt, stride_st,
    H, W, K, n_kv, n_comp, n_splits,
    D: tl.constexpr, DN: tl.constexpr, R2: tl.constexpr, BS_KV: tl.constexpr, BS_C: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R2: tl.constexpr,
    DIRECT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    scale_log2 = tl.full([], scale_log2, tl.float32)  # Inductor passes Python floats as fp64
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_n = tl.arange(0, BLOCK_DN)
    offs_r = tl.arange(0, BLOCK_R2)
    n_ok = offs_n < DN
    r_ok = offs_r < R2
    q_row = q_ptr + t * stride_qt + heads.to(tl.int64) * stride_qh
    q_n = tl.load(q_row[:, None] + offs_n[None, :], mask=h_ok[:, None] & n_ok[None, :], other=0.0)
    q_e = tl.load(q_row[:, None] + DN + 2 * offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_o = tl.load(q_row[:, None] + DN + 2 * offs_r[None, :] + 1, mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_n, q_e, q_o = q_n.to(kv_ptr.dtype.element_ty), q_e.to(kv_ptr.dtype.element_ty), q_o.to(kv_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_H, BLOCK_DN], dtype=tl.float32)
    acc_e = tl.zeros([BLOCK_H, BLOCK_R2], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_H, BLOCK_R2], dtype=tl.float32)
    # this split's share of each list: contiguous ranges in whole tiles
    w_per = tl.cdiv(tl.cdiv(W, n_splits), BLOCK_N) * BLOCK_N
    w_end = tl.minimum((split + 1) * w_per, W)
    for n0 in range(split * w_per, w_end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(ws_ptr + t * stride_wt + j, mask=j < w_end, other=-1).to(tl.int64)
        ok = (slot >= 0) & (slot < n_kv)
        slot = tl.where(ok, slot, 0)
        row = kv_ptr + (slot // BS_KV) * stride_kb + (slot % BS_KV) * stride_kt
        m_i, l_i, acc_n, acc_e, acc_o = _tile(q_n, q_e, q_o, row, ok, offs_n, offs_r, n_ok, r_ok, DN, m_i, l_i,
                                              acc_n, acc_e, acc_o, scale_log2, IEEE)
    k_per = tl.cdiv(tl.cdiv(K, n_splits), BLOCK_N) * BLOCK_N
    k_end = tl.minimum((split + 1) * k_per, K)
    for n0 in range(split * k_per, k_end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(cs_ptr + t * stride_st + j, mask=j < k_end, other=-1).to(tl.int64)
        ok = (slot >= 0) & (slot < n_comp)
        slot = tl.where(ok, slot, 0)
        row = comp_ptr + (slot // BS_C) * stride_cb + (slot % BS_C) * stride_ct
        m_i, l_i, acc_n, acc_e, acc_o = _tile(q_n, q_e, q_o, row, ok, offs_n, offs_r, n_ok, r_ok, DN, m_i, l_i,
                                              acc_n, acc_e, acc_o, scale_log2, IEEE)
    if DIRECT:
        _finish(acc_n, acc_e, acc_o, m_i, l_i, t, heads, h_ok, offs_n, offs_r, n_ok, r_ok, sink_ptr, pos_ptr,
                freq_ptr, o_ptr, lse_ptr, H, D, DN)
    else:  # partial state of this split: (m, l) and the unnormalised accumulator, in the row's channel order
        part = (t * H + heads.to(tl.int64)) * n_splits + split
        tl.store(ws_ml_ptr + 2 * part, m_i, mask=h_ok)
        tl.store(ws_ml_ptr + 2 * part + 1, l_i, mask=h_ok)
        a_row = ws_acc_ptr + part * D
        tl.store(a_row[:, None] + offs_n[None, :], acc_n, mask=h_ok[:, None] & n_ok[None, :])
        tl.store(a_row[:, None] + DN + 2 * offs_r[None, :], acc_e, mask=h_ok[:, None] & r_ok[None, :])
        tl.store(a_row[:, None] + DN + 2 * offs_r[None, :] + 1, acc_o, mask=h_ok[:, None] & r_ok[None, :])


@triton.jit
def _v4_merge_kernel(ws_acc_ptr, ws_ml_ptr, sink_ptr, pos_ptr, freq_ptr, o_ptr, lse_ptr, H,
                     N_SPLITS: tl.constexpr, D: tl.constexpr, DN: tl.constexpr, R2: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R2: tl.constexpr):
    """Merge the splits of one (row, head block) by their base-2 (m, l), then :func:`_finish`. The split count is a
    constant (the launch's, from shapes): the loops unroll, so every split's loads are in flight at once."""
    pid_h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_n = tl.arange(0, BLOCK_DN)
    offs_r = tl.arange(0, BLOCK_R2)
    n_ok = offs_n < DN
    r_ok = offs_r < R2
    base = (t * H + heads.to(tl.int64)) * N_SPLITS
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for sp in tl.static_range(N_SPLITS):
        m = tl.maximum(m, tl.load(ws_ml_ptr + 2 * (base + sp), mask=h_ok, other=float("-inf")))
    shift = tl.where(m == float("-inf"), 0.0, m)
    l_tot = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_H, BLOCK_DN], dtype=tl.float32)
    acc_e = tl.zeros([BLOCK_H, BLOCK_R2], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_H, BLOCK_R2], dtype=tl.float32)
    for sp in tl.static_range(N_SPLITS):
        m_s = tl.load(ws_ml_ptr + 2 * (base + sp), mask=h_ok, other=float("-inf"))
        l_s = tl.load(ws_ml_ptr + 2 * (base + sp) + 1, mask=h_ok, other=0.0)
        wgt = tl.where(l_s > 0.0, tl.math.exp2(m_s - shift), 0.0)
        l_tot += wgt * l_s
        a_row = ws_acc_ptr + (base + sp) * D
        acc_n += wgt[:, None] * tl.load(a_row[:, None] + offs_n[None, :], mask=h_ok[:, None] & n_ok[None, :],
                                        other=0.0)
        acc_e += wgt[:, None] * tl.load(a_row[:, None] + DN + 2 * offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                                        other=0.0)
        acc_o += wgt[:, None] * tl.load(a_row[:, None] + DN + 2 * offs_r[None, :] + 1,
                                        mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    _finish(acc_n, acc_e, acc_o, m, l_tot, t, heads, h_ok, offs_n, offs_r, n_ok, r_ok, sink_ptr, pos_ptr, freq_ptr,
            o_ptr, lse_ptr, H, D, DN)


def _launch(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor, comp_slots: Tensor,
            sinks: Tensor, query_pos: Tensor, inv_freq: Tensor, scale: float,
            config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Kernel path (the interpreter on CPU tensors too). ``config`` overrides BLOCK_H, BLOCK_N, SPLITS, num_warps,
    MERGE_BLOCK_H and FEW (whether the few-rows split applies: :func:`few_rows`)."""
    T, H, D = q.shape
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T * H == 0:
        return out, lse
    if comp_cache.dtype != kv_cache.dtype:
        raise ValueError(f"mla.v4_attention (triton): kv_cache and comp_cache must share a dtype, got "
                         f"{kv_cache.dtype} and {comp_cache.dtype}")
    q, kv_cache, comp_cache = (last_dim_contiguous(x) for x in (q, kv_cache, comp_cache))
    window_slots, comp_slots = last_dim_contiguous(window_slots), last_dim_contiguous(comp_slots)
    inv_freq, sinks, query_pos = inv_freq.contiguous(), sinks.contiguous(), query_pos.contiguous()
    r2 = inv_freq.shape[0]
    dn = D - 2 * r2
    cfg = dict(config or {})
    block_h = cfg.get("BLOCK_H", min(16, pow2(H)))
    W, K = window_slots.shape[1], comp_slots.shape[1]
    hb = triton.cdiv(H, block_h)
    few = cfg.get("FEW", few_rows(T, hb))  # FEW=False: the split a symbolic row count gets (benchmarks)
    block_n = cfg.get("BLOCK_N", 16 if few or D < 256 else 32)
    # splits of the slot lists: a static handful of rows (a decode step of one or two sequences) spreads its lists
    # over up to 32 programs a head block, a tile or two each; otherwise (T may be symbolic) from the lists' widths
    # only: enough programs for short batches over long lists
    splits = cfg.get("SPLITS", min(32, triton.cdiv(W + K, block_n)) if few
                     else max(1, min(16, triton.cdiv(W + K, 8 * block_n))))
    splits = max(1, splits)
    direct = splits == 1
    ws_acc = out if direct else torch.empty(T * H * splits, D, dtype=torch.float32, device=q.device)
    ws_ml = lse if direct else torch.empty(T * H * splits, 2, dtype=torch.float32, device=q.device)
    wrap_triton(_v4_attention_kernel)[(hb, T, splits)](
        q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq, out, lse, ws_acc, ws_ml,
        scale * _LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), comp_cache.stride(0), comp_cache.stride(1),
        window_slots.stride(0), comp_slots.stride(0),
        H, W, K, kv_cache.shape[0] * kv_cache.shape[1], comp_cache.shape[0] * comp_cache.shape[1], splits,
        D=D, DN=dn, R2=r2, BS_KV=kv_cache.shape[1], BS_C=comp_cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_DN=pow2(dn), BLOCK_R2=pow2(r2), DIRECT=direct, IEEE=kv_cache.dtype == torch.float32,
        num_warps=cfg.get("num_warps", 8 if D >= 256 else 4),
    )
    if not direct:
        # the merge has no dot: with few rows one head a program (H programs a row), else the kernel's head blocks
        merge_h = cfg.get("MERGE_BLOCK_H", 1 if few else block_h)
        merge_warps = 4 if merge_h == 1 else cfg.get("num_warps", 8 if D >= 256 else 4)
        wrap_triton(_v4_merge_kernel)[(triton.cdiv(H, merge_h), T)](
            ws_acc, ws_ml, sinks, query_pos, inv_freq, out, lse, H, N_SPLITS=splits, D=D, DN=dn, R2=r2,
            BLOCK_H=merge_h, BLOCK_DN=pow2(dn), BLOCK_R2=pow2(r2), num_warps=merge_warps)
    return out, lse


def few_rows(T, head_blocks: int) -> bool:
    """True when ``T`` query rows are a plain int (static in the graph being traced: Dynamo specializes 1) and
    ``T * head_blocks`` programs would leave most SMs idle; a symbolic T is never read (no guard)."""
    return isinstance(T, int) and T * head_blocks <= 16


@triton_op("mla::v4_attention_triton", mutates_args=())
def v4_attention_triton(q: Tensor, kv_cache: Tensor, window_slots: Tensor, comp_cache: Tensor, comp_slots: Tensor,
                        sinks: Tensor, query_pos: Tensor, inv_freq: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Triton ``mla::v4_attention`` (the reference's contract); non-CUDA or float64 runs the reference."""
    if q.device.type != "cuda" or torch.float64 in (q.dtype, kv_cache.dtype, comp_cache.dtype):
        return torch.ops.mla.v4_attention_ref(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos,
                                              inv_freq, scale)
    validate(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq)
    return _launch(q, kv_cache, window_slots, comp_cache, comp_slots, sinks, query_pos, inv_freq, scale)
