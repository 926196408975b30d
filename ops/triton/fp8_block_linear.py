"""Triton ``mla::fp8_block_linear``: a tiled GEMM over fp8 block-quantized weights (DeepSeek's format).

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y = x @ W.T`` for one group (expert). ``BLOCK_N``
divides 128, so a tile's rows share one weight-scale row; the K loop walks 128-wide steps, one scale
column each. The e4m3 codes are exact in bf16/fp32: the dot runs on the codes and the partial sum is
scaled afterwards (``acc += dot(x, codes.T) * s_w``), as DeepSeek's own kernel does. With ``act_quant`` the
activation step is rounded per row to e4m3 codes first (scale ``amax / 448``, round to nearest even, in
integer arithmetic so the interpreter matches torch) and its per-row scale joins ``s_w``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.fp8_block_linear import validate
from mla_compile.ops.triton._common import last_dim_contiguous
from mla_compile.ops.triton._fp8 import FP8_MAX, SCALE_FLOOR, e4m3_codes


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K, KB,
    s_xe, s_xm, s_we, s_wn, s_se, s_sn, s_ye, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT_QUANT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + e * s_xe + offs_m.to(tl.int64) * s_xm
    w_rows = w_ptr + e * s_we + offs_n.to(tl.int64) * s_wn
    s_row = s_ptr + e * s_se + (pid_n * BLOCK_N // 128) * s_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, KB):
        k = kb * 128 + offs_k
        k_ok = k < K
        x = tl.load(x_rows[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        codes = tl.load(w_rows[:, None] + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        w = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load(s_row + kb)
        if ACT_QUANT:
            amax = tl.max(tl.abs(x), axis=1)
            sx = tl.maximum(tl.math.div_rn(amax, tl.full([BLOCK_M], FP8_MAX, tl.float32)), SCALE_FLOOR)
            quot = tl.math.div_rn(x, tl.broadcast_to(sx[:, None], (BLOCK_M, 128)))
            quot = tl.minimum(tl.maximum(quot, -FP8_MAX), FP8_MAX)
            x = e4m3_codes(quot).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if IEEE:
            part = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:  # codes are exact in bf16; x was bf16 (or its fp8 codes)
            part = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        if ACT_QUANT:
            acc += part * (sx[:, None] * scale)
        else:
            acc += part * scale
    y = y_ptr + e * s_ye + offs_m.to(tl.int64)[:, None] * s_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract."""
    grouped = weight.dim() == 3
    w3 = weight if grouped else weight[None]
    s3 = last_dim_contiguous(weight_scale_inv if grouped else weight_scale_inv[None])
    E, N, K = w3.shape
    M = x.shape[-2]
    x3 = x if x.dim() == 3 else x[None]
    x3 = last_dim_contiguous(x3)
    w3 = last_dim_contiguous(w3).view(torch.uint8)  # raw codes: the interpreter has no float8 numpy dtype
    y = torch.empty(E, M, N, dtype=x.dtype, device=x.device)
    if M * N == 0:
        return y if grouped else y[0]
    s_xe = x3.stride(0) if x3.shape[0] == E else 0  # a shared [M, K] activation for every group
    ieee = x.dtype == torch.float32
    # fp32 operands take twice the registers of bf16 ones: smaller tiles, more warps and one stage keep them
    # from spilling (sm_90 compile at 2 stages: 144 B of stack; test_triton_sm90_compile_fp8_linear.py)
    block_m = 16 if M <= 16 else (32 if ieee else 64)
    block_n = 32 if ieee else 64  # divides 128: a tile's rows share one weight-scale row
    num_warps, num_stages = (8, 1) if ieee else (4, 3)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), E)
    wrap_triton(_fp8_linear_kernel)[grid](
        x3, w3, s3, y, M, N, K, triton.cdiv(K, 128),
        s_xe, x3.stride(1), w3.stride(0), w3.stride(1), s3.stride(0), s3.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, ACT_QUANT=act_quant, IEEE=ieee, num_warps=num_warps,
        num_stages=num_stages,
    )
    return y if grouped else y[0]


@triton_op("mla::fp8_block_linear_triton", mutates_args=())
def fp8_block_linear_triton(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, act_quant: bool) -> Tensor:
    """Triton ``mla::fp8_block_linear`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return torch.ops.mla.fp8_block_linear_ref(x, weight, weight_scale_inv, act_quant)
    validate(x, weight, weight_scale_inv)
    return _launch(x, weight, weight_scale_inv, act_quant)
