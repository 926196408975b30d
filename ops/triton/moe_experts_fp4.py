"""Triton ``mla::moe_experts_fp4``: the routed fp4 experts for few tokens, reading only the picks' weights.

Two kernels, as :mod:`mla_compile.ops.triton.moe_experts_fp8`'s: kernel 1 takes one (token, pick) row and
``BLOCK_N`` rows of its expert's gate and up projections, the clamp and ``silu(g) * u`` fused, and stores the
activation (x's dtype); kernel 2 takes one token and ``BLOCK_H`` output columns and runs its picks' down rows, each
weighted by its routing weight, the picks unrolled in a fixed order (deterministic). A pick of weight 0 (expert
parallelism gives the other ranks' picks weight 0 and expert 0) is skipped: kernel 1 returns before any load,
kernel 2 masks its loads (no memory traffic; its arithmetic on zeros stays). The packed codes are read as
int32 words (the K loop's loads pipelined for one or two tokens) and decoded two codes per 32-bit operation
(:func:`~mla_compile.ops.triton.fp4_block_linear.fp4_block_sums`): at one token the decode, not memory, bounds a
byte-at-a-time decode. Each 32-block's products are summed in float32 in one thread and scaled by its power of two;
a program keeps ``[rows, blocks]`` partial sums and reduces them once after its K loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.fp4_block_linear import as_bytes
from mla_compile.ops.moe_experts import _out_dtype
from mla_compile.ops.moe_experts_fp4 import validate
from mla_compile.ops.triton._common import last_dim_contiguous, num_sms, widest_tile
from mla_compile.ops.triton.fp4_block_linear import as_words, fp4_block_sums, load_blocks, load_x_blocks


@triton.jit
def _moe_fp4_gate_up_kernel(
    x_ptr, ids_ptr, wt_ptr, g_ptr, u_ptr, gs_ptr, us_ptr, h_ptr, limit,
    H, I, K,
    s_x, s_ids, s_wt, s_ge, s_gn, s_ue, s_un, s_gse, s_gsn, s_use, s_usn, s_h,
    LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    limit = tl.full([], limit, tl.float32)  # Inductor passes Python floats as fp64: the clamps would make acc fp64
    row = tl.program_id(0)
    t = (row // K).to(tl.int64)
    if tl.load(wt_ptr + t * s_wt + row % K) == 0:  # a pick of weight 0 (another rank's, under expert parallelism)
        return  # reads nothing; the down kernel never reads its activation row
    e = tl.load(ids_ptr + t * s_ids + row % K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    n64 = offs_n.to(tl.int64)
    g_rows = g_ptr + e * s_ge + n64 * s_gn
    u_rows = u_ptr + e * s_ue + n64 * s_un
    gs_rows = gs_ptr + e * s_gse + n64 * s_gsn
    us_rows = us_ptr + e * s_use + n64 * s_usn
    x_row = x_ptr + t * s_x
    G: tl.constexpr = BLOCK_K // 32
    acc_g = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, G], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        x = load_x_blocks(x_row, k0, H // 32, G)
        w, s = load_blocks(g_rows, gs_rows, n_ok, k0, H // 32, G)
        acc_g += fp4_block_sums(w, s, x)
        w, s = load_blocks(u_rows, us_rows, n_ok, k0, H // 32, G)
        acc_u += fp4_block_sums(w, s, x)
    gv = tl.sum(acc_g, axis=1)
    uv = tl.sum(acc_u, axis=1)
    if LIMIT:
        gv = tl.minimum(gv, limit)
        uv = tl.minimum(tl.maximum(uv, -limit), limit)
    a = gv / (1.0 + tl.exp(-gv)) * uv
    tl.store(h_ptr + row.to(tl.int64) * s_h + offs_n, a.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_fp4_down_kernel(
    h_ptr, w_ptr, ids_ptr, dn_ptr, ds_ptr, out_ptr,
    H, I,
    s_h, s_w, s_ids, s_de, s_dh, s_dse, s_dsh, s_out,
    K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    h64 = offs_h.to(tl.int64)
    G: tl.constexpr = BLOCK_K // 32
    acc = tl.zeros([BLOCK_H, G], dtype=tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
        for j in tl.static_range(K):
            e = tl.load(ids_ptr + t * s_ids + j).to(tl.int64)
            weight = tl.load(w_ptr + t * s_w + j)
            blocks = tl.where(weight != 0, I // 32, 0)  # a pick of weight 0 loads nothing (its h row is unwritten)
            a = load_x_blocks(h_ptr + (t * K + j) * s_h, k0, blocks, G)
            w, s = load_blocks(dn_ptr + e * s_de + h64 * s_dh, ds_ptr + e * s_dse + h64 * s_dsh, h_ok, k0, blocks, G)
            acc += weight * fp4_block_sums(w, s, a)
    tl.store(out_ptr + t * s_out + offs_h, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=h_ok)


# Launch parameters (a benchmark may swap them; BENCHMARKS.md runs 274-277). ``*_k``: K values a program step (a
# multiple of 32); ``waves``: the widest output tile (16, 8 or 4 rows) is taken that still gives every SM this many
# programs; ``stages``: the K loop's loads pipelined this deep for at most ``pipelined_tokens`` tokens, where memory
# latency bounds the kernels; above, one stage (the staging's instructions cost more than the latency they hide once
# the decode's arithmetic bounds the kernels).
CONFIG = dict(gate_up_k=512, down_k=512, waves=2, num_warps=4, stages=3, pipelined_tokens=2)


def kernel_operands(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                    up_scale: Tensor, down: Tensor, down_scale: Tensor):
    """The fp4 experts kernels' views of a call's tensors: ``(x, weights, ids, (gate, up, down) words, their scale
    bytes, h)``: x with a unit last stride, float32 weights and ids contiguous, the codes as int32 words
    (:func:`~mla_compile.ops.triton.fp4_block_linear.as_words`), the scales as bytes, and the activation buffer
    ``h [T * k, I]`` of x's dtype."""
    words = tuple(as_words(w) for w in (gate, up, down))
    scales = tuple(last_dim_contiguous(as_bytes(s)) for s in (gate_scale, up_scale, down_scale))
    h = torch.empty(x.shape[0] * ids.shape[1], gate.shape[1], dtype=x.dtype, device=x.device)
    return last_dim_contiguous(x), weights.float().contiguous(), ids.contiguous(), words, scales, h


def _launch(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
            up_scale: Tensor, down: Tensor, down_scale: Tensor, out_float32: bool,
            swiglu_limit: float | None) -> Tensor:
    """Kernel path (the interpreter on CPU tensors too); shapes as the op's contract."""
    T, H = x.shape
    K = ids.shape[1]
    I = gate.shape[1]
    out = torch.empty(T, H, dtype=_out_dtype(x, out_float32), device=x.device)
    if T == 0:
        return out
    x, weights, ids, (g, u, d), (gs, us, ds), h = kernel_operands(x, weights, ids, gate, gate_scale, up, up_scale,
                                                                  down, down_scale)
    block_n = widest_tile(T * K, I, num_sms(x.device), CONFIG["waves"])
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    stages = CONFIG["stages"] if T <= CONFIG["pipelined_tokens"] else 1
    wrap_triton(_moe_fp4_gate_up_kernel)[(T * K, triton.cdiv(I, block_n))](
        x, ids, weights, g, u, gs, us, h, limit, H, I, K,
        x.stride(0), ids.stride(0), weights.stride(0), g.stride(0), g.stride(1), u.stride(0), u.stride(1),
        gs.stride(0), gs.stride(1),
        us.stride(0), us.stride(1), h.stride(0),
        LIMIT=swiglu_limit is not None, BLOCK_N=block_n, BLOCK_K=CONFIG["gate_up_k"], STAGES=stages,
        num_warps=CONFIG["num_warps"],
    )
    block_h = widest_tile(T, H, num_sms(x.device), CONFIG["waves"])
    wrap_triton(_moe_fp4_down_kernel)[(T, triton.cdiv(H, block_h))](
        h, weights, ids, d, ds, out, H, I,
        h.stride(0), weights.stride(0), ids.stride(0), d.stride(0), d.stride(1), ds.stride(0), ds.stride(1),
        out.stride(0),
        K=K, BLOCK_H=block_h, BLOCK_K=CONFIG["down_k"], STAGES=stages, num_warps=CONFIG["num_warps"],
    )
    return out


@triton_op("mla::moe_experts_fp4_triton", mutates_args=())
def moe_experts_fp4_triton(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                           up_scale: Tensor, down: Tensor, down_scale: Tensor, out_float32: bool,
                           swiglu_limit: float | None) -> Tensor:
    """Triton ``mla::moe_experts_fp4`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    args = (x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale)
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return torch.ops.mla.moe_experts_fp4_ref(*args, out_float32, swiglu_limit)
    validate(*args)
    return _launch(*args, out_float32, swiglu_limit)
