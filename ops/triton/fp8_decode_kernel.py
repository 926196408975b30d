"""The Triton split-KV decode kernel over the 656-byte fp8 latent cache (``mla::decode_fp8``).

Same program layout, causal limits, splits and outputs as ``decode._decode_split_kernel``; only the KV
tile differs. The e4m3 codes are loaded per 128-wide scale group and converted exactly to q's dtype;
the per-row group scales never touch the tile:

- scores: ``s = sum_g scale_g[n] * (q_g . codes_g[n]) + q_pe . k_pe`` (one dot per group,
  weighted per key row);
- values: ``acc_g += (P * scale_g[n]) @ codes_g`` (the scale folded into P, rounded to q's dtype like
  P itself is on the bf16 path).

Each group's codes are loaded twice, as ``[BLOCK_N, 128]`` for the value dot and ``[128, BLOCK_N]`` for
the score dot (the second read hits L2): Triton 3.6 cannot feed a transposed 8-bit tile from shared
memory to ``tl.dot``, and the register transpose it falls back to makes the load synchronous (sm_90
compile: 32 async / 16 plain loads and a 64x512 register path, against 92 / 6 with two loads). Groups
are unrolled (``G = kv_lora_rank / 128`` in 1..4, one accumulator each). With float16 q, ``P * scale``
is rounded to float16: groups with ``amax`` below ~1e-3 lose relative precision to float16 subnormals.

So the dots see the codes straight from shared memory (the loads stay asynchronous and pipelined)
and no dequantized float32 tile is built in registers; the keys carry no rounding beyond float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_compile.ops.triton._common import decode_program, paged_rows
from mla_compile.ops.triton._fp8 import GROUP


@triton.jit
def _codes(kv_row, ok, g: tl.constexpr, offs_k, DC: tl.constexpr):
    """Group ``g`` of the rows at ``kv_row [BLOCK_N]``: codes ``[BLOCK_N, 128]`` uint8 and scales
    ``[BLOCK_N]`` float32 (0 where not ``ok``)."""
    codes = tl.load(kv_row[:, None] + g * GROUP + offs_k[None, :], mask=ok[:, None], other=0)
    sc = tl.load((kv_row + DC).to(tl.pointer_type(tl.float32)) + g, mask=ok, other=0.0)
    return codes, sc


@triton.jit
def _exact(codes, dtype: tl.constexpr):
    """e4m3 codes (uint8) to ``dtype`` (bf16/fp16/fp32 hold every e4m3 value exactly)."""
    return codes.to(tl.float8e4nv, bitcast=True).to(dtype)


@triton.jit
def _pv(p, sc, codes, acc, alpha, dtype: tl.constexpr, IEEE: tl.constexpr):
    """``acc * alpha + (p * sc) @ codes`` in ``dtype``: the group scale folded into P (rounded like P)."""
    pg = (p * sc[None, :]).to(dtype)
    if IEEE:
        return tl.dot(pg, _exact(codes, dtype), acc * alpha[:, None], input_precision="ieee")
    return tl.dot(pg, _exact(codes, dtype), acc * alpha[:, None])


@triton.jit
def _qk(q, kv_row, ok, g: tl.constexpr, offs_k, IEEE: tl.constexpr):
    """``q @ codes_g^T`` ``[BLOCK_H, BLOCK_N]``, the codes loaded as ``[128, BLOCK_N]`` (a second read of the
    value tile's bytes, served by L2): Triton cannot feed a transposed 8-bit tile from shared memory to
    the dot, and a register transpose would make the value tile's load synchronous."""
    codes_t = tl.load(kv_row[None, :] + g * GROUP + offs_k[:, None], mask=ok[None, :], other=0)
    k_t = _exact(codes_t, q.dtype)
    if IEEE:
        return tl.dot(q, k_t, input_precision="ieee")
    return tl.dot(q, k_t)


@triton.jit
def _decode_fp8_split_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt,
    stride_bt,
    M, H, S_Q, n_splits, split_cap, DC: tl.constexpr, DR: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    G: tl.constexpr, BLOCK_DR: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    PAGE_TILES: tl.constexpr,
):
    """The split kernel of ``decode._decode_split_kernel`` over fp8 rows; ``G = DC / 128`` in 1..4 groups,
    each with its own ``[BLOCK_N, 128]`` codes tile and ``[BLOCK_H, 128]`` accumulator."""
    scale_log2 = tl.full([], scale_log2, tl.float32)  # Inductor passes Python floats as fp64
    b = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    pid_s, n_used, start, end, rows, row_ok, qi, limit = decode_program(b, seq_len, n_splits, split_cap, M, H, S_Q,
                                                                        BLOCK_H, BLOCK_N)
    if pid_s >= n_used:
        return
    offs_k = tl.arange(0, GROUP)
    offs_r = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < DR
    if PAGE_TILES:  # no padded rope columns (``_pick`` checks)
        r_ok = tl.full([BLOCK_DR], 1, tl.int1)

    q_row = q_ptr + b * stride_qb + qi.to(tl.int64) * stride_qs + (rows % H).to(tl.int64) * stride_qh
    q_ptrs = q_row[:, None] + offs_k[None, :]
    q0 = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    acc0 = tl.zeros([BLOCK_H, GROUP], dtype=tl.float32)
    if G > 1:
        q1 = tl.load(q_ptrs + GROUP, mask=row_ok[:, None], other=0.0)
        acc1 = tl.zeros([BLOCK_H, GROUP], dtype=tl.float32)
    if G > 2:
        q2 = tl.load(q_ptrs + 2 * GROUP, mask=row_ok[:, None], other=0.0)
        acc2 = tl.zeros([BLOCK_H, GROUP], dtype=tl.float32)
    if G > 3:
        q3 = tl.load(q_ptrs + 3 * GROUP, mask=row_ok[:, None], other=0.0)
        acc3 = tl.zeros([BLOCK_H, GROUP], dtype=tl.float32)
    q_r = tl.load(q_row[:, None] + DC + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos, pos_ok, kv_row = paged_rows(bt_row, kv_ptr, n0, end, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N,
                                         PAGE_TILES)
        rope_ptr = (kv_row + DC + 4 * G).to(tl.pointer_type(tl.bfloat16))
        k_r = tl.load(rope_ptr[:, None] + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q_r, tl.trans(k_r.to(q_r.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q_r, tl.trans(k_r.to(q_r.dtype)))
        # scores: sum over groups of scale_g[n] * (q_g . codes_g[n]); the codes tiles stay exact
        k0, sc0 = _codes(kv_row, pos_ok, 0, offs_k, DC)
        s += _qk(q0, kv_row, pos_ok, 0, offs_k, IEEE) * sc0[None, :]
        if G > 1:
            k1, sc1 = _codes(kv_row, pos_ok, 1, offs_k, DC)
            s += _qk(q1, kv_row, pos_ok, 1, offs_k, IEEE) * sc1[None, :]
        if G > 2:
            k2, sc2 = _codes(kv_row, pos_ok, 2, offs_k, DC)
            s += _qk(q2, kv_row, pos_ok, 2, offs_k, IEEE) * sc2[None, :]
        if G > 3:
            k3, sc3 = _codes(kv_row, pos_ok, 3, offs_k, DC)
            s += _qk(q3, kv_row, pos_ok, 3, offs_k, IEEE) * sc3[None, :]
        visible = pos_ok[None, :] & (pos[None, :] < limit[:, None])
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        acc0 = _pv(p, sc0, k0, acc0, alpha, q0.dtype, IEEE)
        if G > 1:
            acc1 = _pv(p, sc1, k1, acc1, alpha, q0.dtype, IEEE)
        if G > 2:
            acc2 = _pv(p, sc2, k2, acc2, alpha, q0.dtype, IEEE)
        if G > 3:
            acc3 = _pv(p, sc3, k3, acc3, alpha, q0.dtype, IEEE)

    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)  # acc is 0 where empty
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    row_idx = b * M + rows
    if DIRECT:  # one split: the final result
        o_row = o_ptr + row_idx[:, None] * DC + offs_k[None, :]
        tl.store(lse_ptr + row_idx, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        ws_row = row_idx * n_splits + pid_s
        o_row = o_ptr + ws_row[:, None] * DC + offs_k[None, :]
        tl.store(lse_ptr + ws_row, lse2, mask=row_ok)
    ty = o_ptr.dtype.element_ty
    tl.store(o_row, (acc0 * inv[:, None]).to(ty), mask=row_ok[:, None])
    if G > 1:
        tl.store(o_row + GROUP, (acc1 * inv[:, None]).to(ty), mask=row_ok[:, None])
    if G > 2:
        tl.store(o_row + 2 * GROUP, (acc2 * inv[:, None]).to(ty), mask=row_ok[:, None])
    if G > 3:
        tl.store(o_row + 3 * GROUP, (acc3 * inv[:, None]).to(ty), mask=row_ok[:, None])
