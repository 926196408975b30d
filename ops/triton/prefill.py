"""Triton varlen flash-attention forward for ``mla::prefill`` (qk 192 = 128 + 64, v 128 for DeepSeek).

The grid is ``(cdiv(T, BLOCK_M) + N, H)``, from shapes only: each program finds its sequence and
query block by searching ``cu_seqlens_q`` on the device (``tiles_started``), so no maximum length is
read on the host. The qk dim is split into a power-of-two tile (128) and a remainder tile (64), each
with its own ``tl.dot``. Causal programs first run the key tiles every row of the block sees without
a mask, then the diagonal tiles with the bottom-right causal mask. Padding rows past
``cu_seqlens_q[-1]`` get ``out = 0``, ``lse = -inf``, as do rows that see no key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.prefill import validate
from mla_compile.ops.triton._common import (causal_bounds, dot_two_part, last_dim_contiguous, online_softmax_step,
                                             pow2, prefill_outputs, tiles_started)

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, o_ptr, lse_ptr,
    scale_log2, n_seq, T, H, n_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    DQK: tl.constexpr, DV: tl.constexpr,
    DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    slot = n_slots - 1 - tl.program_id(0)  # the longest causal blocks sit last in each sequence: start them first
    h = tl.program_id(1)
    scale_log2 = tl.full([], scale_log2, tl.float32)  # Inductor passes Python floats as fp64
    seq = -1  # the segment owning tile ``slot`` (see ``tiles_started``)
    for c in range(0, n_seq + 1, CHUNK):
        idx = c + tl.arange(0, CHUNK)
        seq += tiles_started(tl.load(cu_q_ptr + idx, mask=idx <= n_seq, other=0), idx, n_seq, slot, BLOCK_M)
    q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
    m0 = (slot - (q_start // BLOCK_M + seq)) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, BLOCK_DV)
    v_ok = offs_v < DV
    rows = (q_start + offs_m).to(tl.int64)
    o_rows = o_ptr + (rows * H + h)[:, None] * DV + offs_v[None, :]
    if seq == n_seq:  # padding rows past cu_seqlens_q[-1]
        pad_ok = rows < T
        zeros = tl.zeros([BLOCK_M, BLOCK_DV], dtype=o_ptr.dtype.element_ty)
        tl.store(o_rows, zeros, mask=pad_ok[:, None] & v_ok[None, :])
        tl.store(lse_ptr + rows * H + h, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=pad_ok)
        return
    len_q = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_start
    if m0 >= len_q:  # an unused slot between two sequences' tiles
        return
    k_start = tl.load(cu_k_ptr + seq).to(tl.int32)
    len_k = tl.load(cu_k_ptr + seq + 1).to(tl.int32) - k_start
    off = len_k - len_q  # bottom-right alignment: local query j sees local keys <= j + off

    m_ok = offs_m < len_q
    offs_a = tl.arange(0, DA)
    offs_b = tl.arange(0, BLOCK_DB)
    a_ok = offs_a < DQK
    b_ok = DA + offs_b < DQK
    q_row = q_ptr + rows * stride_qt + h * stride_qh
    q_a = tl.load(q_row[:, None] + offs_a[None, :], mask=m_ok[:, None] & a_ok[None, :], other=0.0)
    q_b = tl.load(q_row[:, None] + DA + offs_b[None, :], mask=m_ok[:, None] & b_ok[None, :], other=0.0)
    k_base = k_ptr + k_start.to(tl.int64) * stride_kt + h * stride_kh
    v_base = v_ptr + k_start.to(tl.int64) * stride_vt + h * stride_vh

    hi, full_end = causal_bounds(m0, off, len_k, BLOCK_M, BLOCK_N, CAUSAL)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # Key tiles that every row of the block sees: no mask.
    for n0 in range(0, full_end, BLOCK_N):
        kt = (n0 + offs_n).to(tl.int64)
        k_a = tl.load(k_base + kt[:, None] * stride_kt + offs_a[None, :], mask=a_ok[None, :], other=0.0)
        k_b = tl.load(k_base + kt[:, None] * stride_kt + DA + offs_b[None, :], mask=b_ok[None, :], other=0.0)
        v = tl.load(v_base + kt[:, None] * stride_vt + offs_v[None, :], mask=v_ok[None, :], other=0.0)
        s = dot_two_part(q_a, k_a, q_b, k_b, IEEE)
        m_i, l_i, acc = online_softmax_step(s * scale_log2, m_i, l_i, acc, v, False, IEEE)

    # Diagonal (causal) and tail (length) tiles: masked.
    for n0 in range(full_end, hi, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < len_k
        kt = n.to(tl.int64)
        k_a = tl.load(k_base + kt[:, None] * stride_kt + offs_a[None, :], mask=n_ok[:, None] & a_ok[None, :], other=0.0)
        k_b = tl.load(k_base + kt[:, None] * stride_kt + DA + offs_b[None, :],
                      mask=n_ok[:, None] & b_ok[None, :], other=0.0)
        v = tl.load(v_base + kt[:, None] * stride_vt + offs_v[None, :], mask=n_ok[:, None] & v_ok[None, :], other=0.0)
        s = dot_two_part(q_a, k_a, q_b, k_b, IEEE)
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= offs_m[:, None] + off)
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, True, IEEE)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & v_ok[None, :])
    tl.store(lse_ptr + rows * H + h, lse, mask=m_ok)


def _pick(dqk: int, dv: int, config: dict | None, wide: bool = False) -> dict:
    """Tiles, warps and stages. bf16/fp16 defaults use wgmma without spills at qk 192 / v 128 (sm_90
    compile: 208 registers, 168 KB shared); ``wide`` (float32) takes smaller tiles to fit shared memory."""
    cfg = dict(config or {})
    cfg.setdefault("BLOCK_M", 64 if wide else 128)
    cfg.setdefault("BLOCK_N", 32 if wide else 64)
    cfg.setdefault("num_warps", 4 if wide else 8)
    cfg.setdefault("num_stages", 2 if wide or dqk + dv > 320 else 3)
    return cfg


def _launch(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
            causal: bool, config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Kernel path (the interpreter on CPU tensors too). ``config``: BLOCK_M, BLOCK_N, num_warps, num_stages."""
    T, H, dqk = q.shape
    dv = v.shape[-1]
    out, lse = prefill_outputs(q, v)
    if T == 0 or H == 0:
        return out, lse
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    cfg = _pick(dqk, dv, config, q.element_size() > 2)
    n_seq = cu_seqlens_q.shape[0] - 1
    da = 1 << (dqk.bit_length() - 1) if dqk >= 16 else 16  # largest power of two <= dqk
    n_slots = triton.cdiv(T, cfg["BLOCK_M"]) + n_seq
    wrap_triton(_prefill_kernel)[(n_slots, H)](
        q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse,
        scale * _LOG2E, n_seq, T, H, n_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        DQK=dqk, DV=dv, DA=da, BLOCK_DB=pow2(dqk - da), BLOCK_DV=pow2(dv),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=bool(causal), IEEE=q.dtype == torch.float32,
        CHUNK=128, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, lse


@triton_op("mla::prefill_triton", mutates_args=())
def prefill_triton(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                   causal: bool) -> tuple[Tensor, Tensor]:
    """Triton ``mla::prefill`` (same contract as ``mla::prefill_ref``); non-CUDA or float64 runs the reference."""
    if q.device.type != "cuda" or q.dtype == torch.float64:
        return torch.ops.mla.prefill_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    validate(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    return _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
