"""Triton split-KV decode for ``mla::sparse_decode``: absorbed MLA over a list of physical slots per query.

One program owns ``BLOCK_H`` heads of one query ``(b, i)`` and one contiguous range of its index list
(a split). Each tile of ``BLOCK_N`` indices is loaded, -1 (and anything outside
``[0, num_blocks * block_size)``) is masked off, and the listed rows are gathered once for all the
program's heads: bf16/fp16/fp32 rows as they are, fp8 rows (the 656-byte DeepSeek format)
dequantized in registers to q's dtype. Scores, the online softmax and the split merge are those of
the dense kernel (``ops/triton/decode.py``, whose reduce kernel is reused); a query whose list holds
no valid slot gets ``out = 0``, ``lse = -inf``. The split count comes from shapes only, so a captured
CUDA graph replays with any index values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.sparse_decode import validate
from mla_compile.ops.triton._common import (dot_two_part, last_dim_contiguous, num_sms, online_softmax_step, pow2,
                                             split_count)
from mla_compile.ops.triton._fp8 import load_fp8_tile
from mla_compile.ops.triton._plan import split_buffers, split_plan
from mla_compile.ops.triton.decode import reduce_splits

_LOG2E = 1.4426950408889634


@triton.jit
def _sparse_split_kernel(
    q_ptr, kv_ptr, idx_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt,
    stride_ib, stride_is,
    H, S_Q, topk, n_slots, n_splits, split_cap, DC: tl.constexpr, DR: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    bq = tl.program_id(2).to(tl.int64)  # query (b, i) = (bq // S_Q, bq % S_Q)
    b = bq // S_Q
    i = bq % S_Q
    scale_log2 = tl.full([], scale_log2, tl.float32)  # Inductor passes Python floats as fp64

    n_used = split_count(n_splits, split_cap)
    if pid_s >= n_used:
        return
    per_split = tl.cdiv(tl.cdiv(topk, n_used), BLOCK_N) * BLOCK_N
    start = pid_s * per_split
    end = tl.minimum(start + per_split, topk)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    c_ok = offs_c < DC
    r_ok = offs_r < DR

    q_row = q_ptr + b * stride_qb + i * stride_qs + heads.to(tl.int64) * stride_qh
    q_c = tl.load(q_row[:, None] + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_row[:, None] + DC + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if not FP8:
        q_c = q_c.to(kv_ptr.dtype.element_ty)
        q_r = q_r.to(kv_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
    idx_row = idx_ptr + b * stride_ib + i * stride_is
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + offs_n, mask=offs_n < end, other=-1).to(tl.int64)
        ok = (slot >= 0) & (slot < n_slots)
        slot = tl.where(ok, slot, 0)
        kv_row = kv_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
        if FP8:
            k_c, k_r = load_fp8_tile(kv_row, ok, offs_c, offs_r, DC, DR, BLOCK_N, BLOCK_DC)
            k_c, k_r = k_c.to(q_c.dtype), k_r.to(q_c.dtype)
        else:
            k_c = tl.load(kv_row[:, None] + offs_c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
            k_r = tl.load(kv_row[:, None] + DC + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        s = dot_two_part(q_c, k_c, q_r, k_r, IEEE)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, k_c, True, IEEE)  # the latent is the value

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]  # acc is 0 where empty
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    row_idx = bq * H + heads
    if DIRECT:  # one split: the final result
        tl.store(o_ptr + row_idx[:, None] * DC + offs_c[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & c_ok[None, :])
        tl.store(lse_ptr + row_idx, lse2 * 0.6931471805599453, mask=h_ok)
    else:
        ws_row = row_idx * n_splits + pid_s
        tl.store(o_ptr + ws_row[:, None] * DC + offs_c[None, :], out, mask=h_ok[:, None] & c_ok[None, :])
        tl.store(lse_ptr + ws_row, lse2, mask=h_ok)


def _pick(H: int, n_queries: int, topk: int, dc: int, device: torch.device, config: dict | None,
          wide: bool) -> dict:
    """Tile sizes, warps, stages and split count, from shapes only (as the dense kernel's ``_pick``)."""
    cfg = dict(config or {})
    block_h = cfg.setdefault("BLOCK_H", min(32 if wide else 64, pow2(H)))
    cfg.setdefault("BLOCK_N", 16 if wide else 32 if block_h == 32 and pow2(dc) >= 256 else 64)
    cfg.setdefault("num_warps", 8 if block_h * pow2(dc) >= 16 * 512 else 4)
    cfg.setdefault("num_stages", 2 if wide or block_h == 64 else 3)
    cap = topk // (4 * cfg["BLOCK_N"])  # a floor division only: see split_plan
    cfg["SPLITS"], cfg["DIRECT"] = split_plan(n_queries * triton.cdiv(H, block_h), num_sms(device), cap,
                                              cfg.get("SPLITS"))
    cfg.setdefault("SPLIT_CAP", cfg["SPLITS"] if "SPLITS" in (config or {}) else cap)  # splits used on the device
    return cfg


def _launch(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float, kv_lora_rank: int,
            config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Kernel path (the interpreter on CPU tensors too). ``q [B, s_q, H, D]``, ``indices [B, s_q, topk]``.

    ``config`` overrides the heuristics: BLOCK_H, BLOCK_N, num_warps, num_stages, SPLITS.
    """
    B, s_q, H, D = q.shape
    topk = indices.shape[2]
    fp8 = kv_cache.dtype == torch.uint8
    dc = kv_lora_rank
    dr = D - dc
    out = torch.empty(B, s_q, H, dc, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, s_q, H, dtype=torch.float32, device=q.device)
    if B * s_q * H == 0:
        return out, lse
    q = last_dim_contiguous(q)
    kv_cache = last_dim_contiguous(kv_cache)
    indices = last_dim_contiguous(indices)
    if fp8 and (kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4):
        raise ValueError(f"mla.sparse_decode (triton): an fp8 kv_cache needs row/block strides that keep the fp32 "
                         f"scales 4-byte aligned, got strides {tuple(kv_cache.stride())}; allocate it contiguous")
    compute = q if fp8 else kv_cache
    n_queries = B * s_q
    cfg = _pick(H, n_queries, topk, dc, q.device, config, compute.element_size() > 2)
    splits, direct = cfg["SPLITS"], cfg["DIRECT"]
    block_dc = pow2(dc, 128 if fp8 else 16)
    o_buf, l_buf = split_buffers(out, lse, n_queries * H, splits, dc, direct)
    grid = (triton.cdiv(H, cfg["BLOCK_H"]), splits, n_queries)
    wrap_triton(_sparse_split_kernel)[grid](
        q, kv_cache, indices, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        indices.stride(0), indices.stride(1),
        H, s_q, topk, kv_cache.shape[0] * kv_cache.shape[1], splits, cfg["SPLIT_CAP"], DC=dc, DR=dr,
        BLOCK_SIZE=kv_cache.shape[1], BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_DC=block_dc, BLOCK_DR=pow2(dr), DIRECT=direct, IEEE=compute.dtype == torch.float32, FP8=fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    reduce_splits(wrap_triton, o_buf, l_buf, out, lse, n_queries * H, splits, cfg["SPLIT_CAP"], dc, block_dc, direct)
    return out, lse


@triton_op("mla::sparse_decode_triton", mutates_args=())
def sparse_decode_triton(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float,
                         kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Triton ``mla::sparse_decode`` (same contract as ``mla::sparse_decode_ref``); non-CUDA or float64
    runs the reference."""
    if q.device.type != "cuda" or torch.float64 in (q.dtype, kv_cache.dtype):
        return torch.ops.mla.sparse_decode_ref(q, kv_cache, indices, scale, kv_lora_rank)
    validate(q, kv_cache, indices, kv_lora_rank)
    return _launch(q, kv_cache, indices, scale, kv_lora_rank)
