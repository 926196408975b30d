"""Triton kernels for ``mla::v4_compress_write``: the V4 compressor, pooled, normed, rotated and written.

Two launches, in order on one stream: ``_compress_entry_kernel`` (one program per token row; only rows
that close a window do work) pools the window's ``R`` sources with a per-channel online softmax over the
gates (+ position bias), reading sources of this call from ``kv``/``gate`` and earlier ones from the ring
state, then RMSNorm, RoPE at the entry's position and the store into the entry cache; then
``_state_write_kernel`` copies each sequence's last ``R`` rows of the call into the ring. (The ring rows a
closing token reads can be overwritten by a later token of the same call, so the reads finish first.)
Channels are held as three tiles, the nope part and the even / odd channels of the rope slice, so the
interleaved rotation is a per-pair update. No host reads: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.triton._common import pow2
from mla_compile.ops.v4_compress import validate


@triton.jit
def _source(kv_ptr, g_ptr, skv_ptr, sg_ptr, bias_ptr, t, j, p, w, seq, srow, qseq_ptr, qpos_ptr, T,
            offs, ok, ch_off, RATE: tl.constexpr, R: tl.constexpr, CIN: tl.constexpr, C: tl.constexpr,
            OVERLAP: tl.constexpr):
    """Source j of the window closed at row t: ``(kv, gate + bias)`` at channels ``offs`` of its series
    (-inf gate for a source before position 0)."""
    if OVERLAP:
        src = w * RATE - RATE + j
        half = tl.where(j < RATE, 0, C)  # Ca of window w-1, then Cb of window w
        bias_row = j % RATE
    else:
        src = w * RATE + j
        half = 0
        bias_row = j
    row = t - (p - src)
    rc = tl.minimum(tl.maximum(row, 0), T - 1)
    in_call = (row >= 0) & (tl.load(qseq_ptr + rc).to(tl.int64) == seq) & (tl.load(qpos_ptr + rc).to(tl.int64) == src)
    ring = (tl.maximum(src, 0) % R)
    col = half + ch_off + offs
    kv_call = tl.load(kv_ptr + rc * CIN + col, mask=ok & in_call, other=0.0).to(tl.float32)
    g_call = tl.load(g_ptr + rc * CIN + col, mask=ok & in_call, other=0.0).to(tl.float32)
    st = (srow * R + ring) * CIN + col
    kv_st = tl.load(skv_ptr + st, mask=ok & (~in_call) & (src >= 0), other=0.0).to(tl.float32)
    g_st = tl.load(sg_ptr + st, mask=ok & (~in_call) & (src >= 0), other=0.0).to(tl.float32)
    kv = tl.where(in_call, kv_call, kv_st)
    g = tl.where(in_call, g_call, g_st) + tl.load(bias_ptr + bias_row * CIN + col, mask=ok, other=0.0).to(tl.float32)
    g = tl.where(src >= 0, g, float("-inf"))
    kv = tl.where(src >= 0, kv, 0.0)
    return kv, g


@triton.jit
def _pool_step(kv, g, m, l, acc):
    m_new = tl.maximum(m, g)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    e = tl.exp(g - shift)
    return m_new, l * alpha + e, acc * alpha + e * kv


@triton.jit
def _compress_entry_kernel(
    kv_ptr, g_ptr, qseq_ptr, qpos_ptr, slot_ptr, skv_ptr, sg_ptr, bias_ptr, w_ptr, freq_ptr, cache_ptr, table_ptr,
    eps, T, B, max_blocks, stride_tb, stride_cb, stride_ct,
    RATE: tl.constexpr, R: tl.constexpr, CIN: tl.constexpr, C: tl.constexpr, DN: tl.constexpr, R2: tl.constexpr,
    BS: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R2: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    seq = tl.load(qseq_ptr + t).to(tl.int64)
    p = tl.load(qpos_ptr + t).to(tl.int64)
    if (seq < 0) | (p % RATE != RATE - 1):
        return
    w = p // RATE
    srow = tl.load(slot_ptr + seq).to(tl.int64)
    eps = tl.full([], eps, tl.float32)
    offs_n = tl.arange(0, BLOCK_DN)
    offs_r = tl.arange(0, BLOCK_R2)
    n_ok = offs_n < DN
    r_ok = offs_r < R2
    m_n = tl.full([BLOCK_DN], float("-inf"), tl.float32)
    l_n = tl.zeros([BLOCK_DN], tl.float32)
    a_n = tl.zeros([BLOCK_DN], tl.float32)
    m_e = tl.full([BLOCK_R2], float("-inf"), tl.float32)
    l_e = tl.zeros([BLOCK_R2], tl.float32)
    a_e = tl.zeros([BLOCK_R2], tl.float32)
    m_o = tl.full([BLOCK_R2], float("-inf"), tl.float32)
    l_o = tl.zeros([BLOCK_R2], tl.float32)
    a_o = tl.zeros([BLOCK_R2], tl.float32)
    for j in range(0, R):
        kv, g = _source(kv_ptr, g_ptr, skv_ptr, sg_ptr, bias_ptr, t, j, p, w, seq, srow, qseq_ptr, qpos_ptr, T,
                        offs_n, n_ok, 0, RATE, R, CIN, C, OVERLAP)
        m_n, l_n, a_n = _pool_step(kv, g, m_n, l_n, a_n)
        kv, g = _source(kv_ptr, g_ptr, skv_ptr, sg_ptr, bias_ptr, t, j, p, w, seq, srow, qseq_ptr, qpos_ptr, T,
                        2 * offs_r, r_ok, DN, RATE, R, CIN, C, OVERLAP)
        m_e, l_e, a_e = _pool_step(kv, g, m_e, l_e, a_e)
        kv, g = _source(kv_ptr, g_ptr, skv_ptr, sg_ptr, bias_ptr, t, j, p, w, seq, srow, qseq_ptr, qpos_ptr, T,
                        2 * offs_r + 1, r_ok, DN, RATE, R, CIN, C, OVERLAP)
        m_o, l_o, a_o = _pool_step(kv, g, m_o, l_o, a_o)
    x_n = tl.where(n_ok, a_n / tl.where(n_ok, l_n, 1.0), 0.0)
    x_e = tl.where(r_ok, a_e / tl.where(r_ok, l_e, 1.0), 0.0)
    x_o = tl.where(r_ok, a_o / tl.where(r_ok, l_o, 1.0), 0.0)
    ms = (tl.sum(x_n * x_n, axis=0) + tl.sum(x_e * x_e, axis=0) + tl.sum(x_o * x_o, axis=0)) / C
    inv = 1.0 / tl.sqrt(ms + eps)
    x_n = x_n * inv * tl.load(w_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    x_e = x_e * inv * tl.load(w_ptr + DN + 2 * offs_r, mask=r_ok, other=0.0).to(tl.float32)
    x_o = x_o * inv * tl.load(w_ptr + DN + 2 * offs_r + 1, mask=r_ok, other=0.0).to(tl.float32)
    ang = (w * RATE).to(tl.float32) * tl.load(freq_ptr + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    c, s = tl.cos(ang), tl.sin(ang)
    y_e = x_e * c - x_o * s
    y_o = x_o * c + x_e * s
    col = tl.minimum(w // BS, max_blocks - 1)
    block = tl.load(table_ptr + seq * stride_tb + col).to(tl.int64)
    dst = cache_ptr + block * stride_cb + (w % BS) * stride_ct
    ty = cache_ptr.dtype.element_ty
    tl.store(dst + offs_n, x_n.to(ty), mask=n_ok)
    tl.store(dst + DN + 2 * offs_r, y_e.to(ty), mask=r_ok)
    tl.store(dst + DN + 2 * offs_r + 1, y_o.to(ty), mask=r_ok)


@triton.jit
def _state_write_kernel(kv_ptr, g_ptr, qseq_ptr, qpos_ptr, slot_ptr, skv_ptr, sg_ptr, T, R: tl.constexpr,
                        CIN: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    seq = tl.load(qseq_ptr + t).to(tl.int64)
    p = tl.load(qpos_ptr + t).to(tl.int64)
    later = t + R
    lc = tl.minimum(later, T - 1)
    overwritten = (later < T) & (tl.load(qseq_ptr + lc).to(tl.int64) == seq) & \
        (tl.load(qpos_ptr + lc).to(tl.int64) == p + R)
    if (seq < 0) | overwritten:
        return
    srow = tl.load(slot_ptr + seq).to(tl.int64)
    dst = (srow * R + p % R) * CIN
    for c0 in range(0, CIN, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        ok = offs < CIN
        tl.store(skv_ptr + dst + offs, tl.load(kv_ptr + t * CIN + offs, mask=ok).to(skv_ptr.dtype.element_ty), mask=ok)
        tl.store(sg_ptr + dst + offs, tl.load(g_ptr + t * CIN + offs, mask=ok).to(sg_ptr.dtype.element_ty), mask=ok)


def _launch(kv: Tensor, gate: Tensor, query_seq: Tensor, query_pos: Tensor, state_slot: Tensor, state_kv: Tensor,
            state_gate: Tensor, position_bias: Tensor, norm_weight: Tensor, inv_freq: Tensor, cache: Tensor,
            block_table: Tensor, rate: int, eps: float, overlap: bool) -> None:
    """Kernel path (the interpreter on CPU tensors too). ``state_kv``/``state_gate`` must be contiguous."""
    T, Cin = kv.shape
    if T == 0:
        return
    if not (state_kv.is_contiguous() and state_gate.is_contiguous()):
        raise ValueError("mla.v4_compress_write (triton): state_kv and state_gate must be contiguous")
    if cache.stride(-1) != 1:
        raise ValueError("mla.v4_compress_write (triton): cache rows must be contiguous (last-dim stride 1)")
    kv, gate = kv.contiguous(), gate.contiguous()
    query_seq, query_pos, state_slot = query_seq.contiguous(), query_pos.contiguous(), state_slot.contiguous()
    position_bias, norm_weight, inv_freq = position_bias.contiguous(), norm_weight.contiguous(), inv_freq.contiguous()
    C = Cin // 2 if overlap else Cin
    R = state_kv.shape[1]
    r2 = inv_freq.shape[0]
    dn = C - 2 * r2
    if block_table.shape[0] and block_table.shape[1]:
        block_table = block_table.contiguous()
        wrap_triton(_compress_entry_kernel)[(T,)](
            kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, position_bias, norm_weight, inv_freq,
            cache, block_table, eps, T, block_table.shape[0], block_table.shape[1], block_table.stride(0),
            cache.stride(0), cache.stride(1),
            RATE=rate, R=R, CIN=Cin, C=C, DN=dn, R2=r2, BS=cache.shape[1], OVERLAP=overlap,
            BLOCK_DN=pow2(dn, 1), BLOCK_R2=pow2(r2, 1), num_warps=4,
        )
    wrap_triton(_state_write_kernel)[(T,)](kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, T,
                                           R=R, CIN=Cin, BLOCK=min(pow2(Cin), 1024), num_warps=4)


@triton_op("mla::v4_compress_write_triton", mutates_args=("state_kv", "state_gate", "cache"))
def v4_compress_write_triton(kv: Tensor, gate: Tensor, query_seq: Tensor, query_pos: Tensor, state_slot: Tensor,
                             state_kv: Tensor, state_gate: Tensor, position_bias: Tensor, norm_weight: Tensor,
                             inv_freq: Tensor, cache: Tensor, block_table: Tensor, rate: int, eps: float,
                             overlap: bool) -> None:
    """Triton ``mla::v4_compress_write`` (the reference's contract); non-CUDA or float64 runs the reference."""
    if kv.device.type != "cuda" or torch.float64 in (kv.dtype, cache.dtype, state_kv.dtype):
        torch.ops.mla.v4_compress_write_ref(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate,
                                            position_bias, norm_weight, inv_freq, cache, block_table, rate, eps,
                                            overlap)
        return
    validate(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, position_bias, norm_weight, inv_freq,
             cache, block_table, rate, overlap)
    _launch(kv, gate, query_seq, query_pos, state_slot, state_kv, state_gate, position_bias, norm_weight, inv_freq,
            cache, block_table, rate, eps, overlap)
