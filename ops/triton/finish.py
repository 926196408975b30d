"""One launch for the decode boundary of the library adapters (FlashMLA, FlashInfer).

``finish_decode_triton`` does what ``ops.adapters._common.finish_decode`` does with four to six torch
kernels (visibility from ``seq_lens``, two ``where``, an LSE transpose copy, the log base change):
queries that see no row get ``out = 0`` and ``lse = -inf``; the LSE is written ``[B, s_q, H]`` float32,
natural log, from any strided ``[B, s_q, H]`` view times ``lse_scale``. ``out`` is zeroed in place (the
adapter owns it: a fresh library output), rows that see keys are not touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mla_compile.ops.triton._common import pow2


@triton.jit
def _finish_decode_kernel(out_ptr, lse_in_ptr, lse_out_ptr, seq_lens_ptr, S_Q, H, ROW,
                          stride_lb, stride_lq, stride_lh, lse_scale,
                          BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * S_Q + qi
    b = row // S_Q
    qi = row % S_Q
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    vis = seq_len - (S_Q - 1 - qi) > 0
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        ok = h < H
        x = tl.load(lse_in_ptr + b * stride_lb + qi * stride_lq + h * stride_lh, mask=ok & vis, other=0.0)
        y = tl.where(vis, x.to(tl.float32) * lse_scale, float("-inf"))
        tl.store(lse_out_ptr + row * H + h, y, mask=ok)
    if not vis:
        zero = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
        for i0 in range(0, ROW, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            tl.store(out_ptr + row * ROW + i, zero, mask=i < ROW)


def finish_decode_triton(out: Tensor, lse: Tensor, seq_lens: Tensor, lse_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """``out [B, s_q, H, Dc]`` (zeroed in place where a query sees nothing; made contiguous first if it is
    not), ``lse [B, s_q, H]`` any strides and float dtype -> ``(out, lse * lse_scale as float32, -inf where
    empty)``, both contiguous."""
    out = out.contiguous()
    B, s_q, H, D = out.shape
    lse_out = torch.empty(B, s_q, H, dtype=torch.float32, device=out.device)
    if B * s_q == 0:
        return out, lse_out
    _finish_decode_kernel[(B * s_q,)](
        out, lse, lse_out, seq_lens, s_q, H, H * D, lse.stride(0), lse.stride(1), lse.stride(2), float(lse_scale),
        BLOCK_H=min(pow2(H), 256), BLOCK=1024, num_warps=4)
    return out, lse_out
