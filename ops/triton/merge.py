"""Triton ``mla::merge_attn_states``: one pass over both partial outputs, weights from natural-log LSEs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.merge import validate
from mla_compile.ops.triton._common import last_dim_contiguous, pow2


@triton.jit
def _merge_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr,
    R, H,
    s_oa_t, s_oa_h, s_ob_t, s_ob_h, s_la_t, s_la_h, s_lb_t, s_lb_h,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R
    t = rows // H
    h = rows % H
    la = tl.load(la_ptr + t * s_la_t + h * s_la_h, mask=r_ok, other=float("-inf"))
    lb = tl.load(lb_ptr + t * s_lb_t + h * s_lb_h, mask=r_ok, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.math.exp2((la - m_safe) * 1.4426950408889634)  # exactly 0 for an empty part
    wb = tl.math.exp2((lb - m_safe) * 1.4426950408889634)
    total = wa + wb
    empty = total == 0.0
    denom = tl.where(empty, 1.0, total)
    ca = (wa / denom)[:, None]
    cb = (wb / denom)[:, None]
    use_a = (wa > 0.0)[:, None]
    use_b = (wb > 0.0)[:, None]
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(denom))
    tl.store(lse_ptr + rows, lse, mask=r_ok)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = r_ok[:, None] & (d < D)[None, :]
        a = tl.load(oa_ptr + (t * s_oa_t + h * s_oa_h)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
        b = tl.load(ob_ptr + (t * s_ob_t + h * s_ob_h)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
        # an empty part may hold NaN: select, never multiply it by 0
        o = tl.where(use_a, a, 0.0) * ca + tl.where(use_b, b, 0.0) * cb
        tl.store(out_ptr + rows[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Kernel path (the interpreter on CPU tensors too)."""
    T, H, D = out_a.shape
    out = torch.empty(T, H, D, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=out_a.device)
    if T * H == 0:
        return out, lse
    out_a, out_b = last_dim_contiguous(out_a), last_dim_contiguous(out_b)
    block_d = min(pow2(D), 512)
    block_r = max(1, 2048 // block_d)
    wrap_triton(_merge_kernel)[(triton.cdiv(T * H, block_r),)](
        out_a, lse_a, out_b, lse_b, out, lse, T * H, H,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        D=D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )
    return out, lse


@triton_op("mla::merge_attn_states_triton", mutates_args=())
def merge_attn_states_triton(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Triton ``mla::merge_attn_states`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    if out_a.device.type != "cuda" or out_a.dtype == torch.float64:
        return torch.ops.mla.merge_attn_states_ref(out_a, lse_a, out_b, lse_b)
    validate(out_a, lse_a, out_b, lse_b)
    return _launch(out_a, lse_a, out_b, lse_b)
