"""One launch for the decode and prefill boundaries of the library adapters (FlashMLA, FlashInfer).

``finish_decode_triton`` does what ``ops.adapters._common.finish_decode`` does with four to six torch
kernels (visibility from ``seq_lens``, two ``where``, an LSE transpose copy, the log base change):
queries that see no row get ``out = 0`` and ``lse = -inf``; the LSE is written ``[B, s_q, H]`` float32,
natural log, from any strided ``[B, s_q, H]`` view times ``lse_scale``. ``out`` is zeroed in place (the
adapter owns it: a fresh library output), rows that see keys are not touched. ``finish_prefill_triton`` is
the same for token rows ``[T, H, Dv]`` of ``cu_seqlens`` sequences: the output is read nowhere and written only
on rows that see no key (a ``torch.where`` over it would read and write all of it).

Both run in an adapter's custom-op body, right after the library's kernel: on sm_90 they are launched with PDL
(``_pdl.py``), every program waiting before it reads anything, so their launch overlaps that kernel's end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.triton._common import pow2
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait


@triton.jit
def _finish_rows(out_ptr, lse_in_ptr, lse_out_ptr, row, lse_row, stride_lh, vis, H, ROW, lse_scale,
                 BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``row``'s LSE (``lse_in_ptr + lse_row`` strided by ``stride_lh``) times ``lse_scale`` into
    ``lse_out_ptr [rows, H]`` (-inf unless ``vis``); its ``ROW`` outputs zeroed unless ``vis``."""
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        ok = h < H
        x = tl.load(lse_in_ptr + lse_row + h * stride_lh, mask=ok & vis, other=0.0)
        y = tl.where(vis, x.to(tl.float32) * lse_scale, float("-inf"))
        tl.store(lse_out_ptr + row * H + h, y, mask=ok)
    if not vis:
        zero = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
        for i0 in range(0, ROW, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            tl.store(out_ptr + row * ROW + i, zero, mask=i < ROW)


@triton.jit
def _finish_decode_kernel(out_ptr, lse_in_ptr, lse_out_ptr, seq_lens_ptr, S_Q, H, ROW,
                          stride_lb, stride_lq, stride_lh, lse_scale,
                          BLOCK_H: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One program a query row ``b * S_Q + qi``: visible when ``seq_len - (S_Q - 1 - qi) > 0``."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)  # b * S_Q + qi
    b = row // S_Q
    qi = row % S_Q
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    vis = seq_len - (S_Q - 1 - qi) > 0
    _finish_rows(out_ptr, lse_in_ptr, lse_out_ptr, row, b * stride_lb + qi * stride_lq, stride_lh, vis, H, ROW,
                 lse_scale, BLOCK_H, BLOCK)


@triton.jit
def _finish_prefill_kernel(out_ptr, lse_in_ptr, lse_out_ptr, cu_q_ptr, cu_k_ptr, n_seq, H, ROW, stride_lt,
                           stride_lh, lse_scale, CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
                           CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """One program a token row ``t``: its sequence found in ``cu_q`` (padding rows past ``cu_q[n_seq]`` have
    none), live when it sees a key (bottom-right causal: ``min(len_k, loc + len_k - len_q + 1) > 0``)."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    seq = 0
    for c in range(0, n_seq, CHUNK):  # seq = entries of cu_q[1:] at or below t
        idx = c + 1 + tl.arange(0, CHUNK)
        cu = tl.load(cu_q_ptr + idx, mask=idx <= n_seq, other=0).to(tl.int64)
        seq += tl.sum(((cu <= t) & (idx <= n_seq)).to(tl.int32), axis=0)
    live = seq < n_seq  # (no read of cu for a padding row: with no sequence cu has one entry)
    q0 = tl.load(cu_q_ptr + seq, mask=live, other=0).to(tl.int64)
    len_q = tl.load(cu_q_ptr + seq + 1, mask=live, other=0).to(tl.int64) - q0
    len_k = (tl.load(cu_k_ptr + seq + 1, mask=live, other=0).to(tl.int64)
             - tl.load(cu_k_ptr + seq, mask=live, other=0).to(tl.int64))
    if CAUSAL:
        seen = tl.minimum(len_k, t - q0 + len_k - len_q + 1)
    else:
        seen = len_k
    vis = live & (seen > 0)
    _finish_rows(out_ptr, lse_in_ptr, lse_out_ptr, t, t * stride_lt, stride_lh, vis, H, ROW, lse_scale, BLOCK_H,
                 BLOCK)


def finish_decode_triton(out: Tensor, lse: Tensor, seq_lens: Tensor, lse_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """``out [B, s_q, H, Dc]`` (zeroed in place where a query sees nothing; made contiguous first if it is
    not), ``lse [B, s_q, H]`` any strides and float dtype -> ``(out, lse * lse_scale as float32, -inf where
    empty)``, both contiguous."""
    out = out.contiguous()
    B, s_q, H, D = out.shape
    lse_out = torch.empty(B, s_q, H, dtype=torch.float32, device=out.device)
    if B * s_q == 0:
        return out, lse_out
    wrap_triton(_finish_decode_kernel)[(B * s_q,)](
        out, lse, lse_out, seq_lens, s_q, H, H * D, lse.stride(0), lse.stride(1), lse.stride(2), float(lse_scale),
        BLOCK_H=min(pow2(H), 256), BLOCK=1024, num_warps=4, **launch_kwargs(out.device))
    return out, lse_out


def finish_prefill_triton(out: Tensor, lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool,
                          lse_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """``out [T, H, Dv]`` (zeroed in place on rows that see no key and on padding rows past
    ``cu_seqlens_q[-1]``; made contiguous first if it is not), ``lse [T, H]`` any strides and float dtype ->
    ``(out, lse * lse_scale as float32, -inf on those rows)``, both contiguous. One launch: each row finds its
    sequence in ``cu_seqlens_q [N + 1]`` itself."""
    out = out.contiguous()
    T, H, D = out.shape
    lse_out = torch.empty(T, H, dtype=torch.float32, device=out.device)
    if T == 0 or H == 0:
        return out, lse_out
    n_seq = cu_seqlens_q.shape[0] - 1
    wrap_triton(_finish_prefill_kernel)[(T,)](
        out, lse, lse_out, cu_seqlens_q, cu_seqlens_k, n_seq, H, H * D, lse.stride(0), lse.stride(1),
        float(lse_scale), CAUSAL=bool(causal), BLOCK_H=min(pow2(H), 256), BLOCK=1024, CHUNK=128, num_warps=4,
        **launch_kwargs(out.device))
    return out, lse_out
