"""Triton ``mla::skinny_absorb_q`` / ``mla::skinny_absorb_out``: per-head GEMVs for up to ``MAX_ROWS`` tokens.

``_skinny_absorb_q_kernel``, grid (heads, latent-column tiles): a program loads ``W_UK[h]``'s ``[BLOCK_N,
BLOCK_C]`` tiles (the reduction runs over the nope dim), once for every token, and writes each token's
``BLOCK_C`` latent columns from float32 sums; the programs of the first column tile also copy the token's q_pe
into the last ``Dr`` columns. ``_skinny_absorb_out_kernel``, grid (heads, value-row tiles): a program loads
``W_UV[h]``'s ``[BLOCK_V, BLOCK_C]`` tiles (the reduction runs over the latent dim) and writes each token's
``BLOCK_V`` outputs at ``h * V`` of its token-major row. The weights' head and row strides are taken as given
(``kv_b_proj``'s views); a weight without a unit last stride is copied first (the model's views have one).
On sm_90 both are launched with PDL (``_pdl.py``): the first weight tile is requested before the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.skinny_absorb import MAX_ROWS, validate_out, validate_q
from mla_compile.ops.triton._common import last_dim_contiguous
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait

Q_BLOCK_C = 64  # latent columns a program of absorb_q writes
Q_MAX_BLOCK_N = 128
OUT_BLOCK_V = 16  # value rows a program of absorb_out writes
OUT_MAX_BLOCK_C = 512


@triton.jit
def absorb_q_tile(
    q_ptr, w_ptr, pe_ptr, out_ptr, hd, cb,
    T, N, C, R,
    s_qt, s_qh, s_wh, s_wn, s_pt, s_ph, s_ot, s_oh,
    cos_ptr, sin_ptr, s_cos, s_sin,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
    ROPE: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    """Head ``hd``'s latent columns ``[cb * BLOCK_C, (cb + 1) * BLOCK_C)`` of every token (at most ``ROWS``): the
    ``_skinny_absorb_q_kernel`` program ``(hd, cb)``; the ``cb == 0`` program also copies the tokens' q_pe into the last
    ``R`` columns, with ``ROPE`` rotated by the token's ``cos`` / ``sin`` rows (``R / 2`` float32 each) as
    ``models.rope.apply_rope`` (``INTERLEAVE``: pairs, written de-interleaved; else rotate-half), rounded to the
    output's dtype."""
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    r_idx = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    w_head = w_ptr + hd * s_wh
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w = tl.load(w_head + n[:, None].to(tl.int64) * s_wn + c[None, :],
                    mask=n_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        pdl_wait(PDL)  # W_UK's tile is in flight before q, the previous kernel's output, is read
        pdl_launch_dependents(PDL)
        for r in tl.static_range(ROWS):
            xr = tl.load(q_ptr + r * s_qt + hd * s_qh + n, mask=n_ok & (r < T), other=0.0).to(tl.float32)
            part = tl.sum(w * xr[:, None], axis=0)
            acc += tl.where(r_idx[:, None] == r, part[None, :], 0.0)
    out = out_ptr + r_idx[:, None].to(tl.int64) * s_ot + hd * s_oh + c[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(r_idx < T)[:, None] & c_ok[None, :])
    if cb == 0:
        if ROPE:
            j = tl.arange(0, BLOCK_R // 2)
            j_ok = j < R // 2
            for r in tl.static_range(ROWS):
                ok = j_ok & (r < T)
                pe_row = pe_ptr + r * s_pt + hd * s_ph
                if INTERLEAVE:
                    x1 = tl.load(pe_row + 2 * j, mask=ok, other=0.0).to(tl.float32)
                    x2 = tl.load(pe_row + 2 * j + 1, mask=ok, other=0.0).to(tl.float32)
                else:
                    x1 = tl.load(pe_row + j, mask=ok, other=0.0).to(tl.float32)
                    x2 = tl.load(pe_row + R // 2 + j, mask=ok, other=0.0).to(tl.float32)
                cs = tl.load(cos_ptr + r * s_cos + j, mask=ok, other=0.0).to(tl.float32)
                sn = tl.load(sin_ptr + r * s_sin + j, mask=ok, other=0.0).to(tl.float32)
                dst = out_ptr + r * s_ot + hd * s_oh + C
                tl.store(dst + j, (x1 * cs - x2 * sn).to(out_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + R // 2 + j, (x2 * cs + x1 * sn).to(out_ptr.dtype.element_ty), mask=ok)
        else:
            d = tl.arange(0, BLOCK_R)
            d_ok = d < R
            for r in tl.static_range(ROWS):
                pe = tl.load(pe_ptr + r * s_pt + hd * s_ph + d, mask=d_ok & (r < T), other=0.0)
                tl.store(out_ptr + r * s_ot + hd * s_oh + C + d, pe.to(out_ptr.dtype.element_ty),
                         mask=d_ok & (r < T))


@triton.jit
def _skinny_absorb_q_kernel(
    q_ptr, w_ptr, pe_ptr, out_ptr,
    T, N, C, R,
    s_qt, s_qh, s_wh, s_wn, s_pt, s_ph, s_ot, s_oh,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    absorb_q_tile(q_ptr, w_ptr, pe_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), T, N, C, R,
                  s_qt, s_qh, s_wh, s_wn, s_pt, s_ph, s_ot, s_oh, q_ptr, q_ptr, 0, 0, ROWS, BLOCK_N, BLOCK_C, BLOCK_R,
                  PDL, False, False)


@triton.jit
def _skinny_absorb_out_kernel(
    x_ptr, w_ptr, out_ptr,
    T, C, V,
    s_xt, s_xh, s_wh, s_wv, s_ot,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    hd = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V
    r_idx = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_V], dtype=tl.float32)
    w_rows = w_ptr + hd * s_wh + v.to(tl.int64) * s_wv
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < C
        w = tl.load(w_rows[:, None] + c[None, :], mask=v_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        pdl_wait(PDL)  # W_UV's tile is in flight before the latent output is read
        pdl_launch_dependents(PDL)
        for r in tl.static_range(ROWS):
            xr = tl.load(x_ptr + r * s_xt + hd * s_xh + c, mask=c_ok & (r < T), other=0.0).to(tl.float32)
            part = tl.sum(w * xr[None, :], axis=1)
            acc += tl.where(r_idx[:, None] == r, part[None, :], 0.0)
    out = out_ptr + r_idx[:, None].to(tl.int64) * s_ot + hd * V + v[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(r_idx < T)[:, None] & v_ok[None, :])


def q_abs_output(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """An uninitialized ``q_abs [T, H, Dc + Dr]`` of q_nope's dtype for a launch of at most ``MAX_ROWS`` tokens."""
    T, H, _ = q_nope.shape
    assert T <= MAX_ROWS, T
    return torch.empty(T, H, w_uk.shape[2] + q_pe.shape[2], dtype=q_nope.dtype, device=q_nope.device)


def launch_q(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """absorb_q's kernel path (the interpreter on CPU tensors too): at most ``MAX_ROWS`` tokens."""
    T, H, N = q_nope.shape
    C, R = w_uk.shape[2], q_pe.shape[2]
    out = q_abs_output(q_nope, w_uk, q_pe)
    if T == 0 or H == 0:
        return out
    q_nope, q_pe, w_uk = last_dim_contiguous(q_nope), last_dim_contiguous(q_pe), last_dim_contiguous(w_uk)
    grid = (H, triton.cdiv(C, Q_BLOCK_C))
    wrap_triton(_skinny_absorb_q_kernel)[grid](
        q_nope, w_uk, q_pe, out, T, N, C, R,
        q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1),
        q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1),
        ROWS=MAX_ROWS, BLOCK_N=min(triton.next_power_of_2(N), Q_MAX_BLOCK_N), BLOCK_C=Q_BLOCK_C,
        BLOCK_R=triton.next_power_of_2(max(R, 1)), num_warps=4,
        **launch_kwargs(q_nope.device, N > 0),
    )
    return out


def launch_out(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """absorb_out's kernel path (the interpreter on CPU tensors too): at most ``MAX_ROWS`` tokens."""
    T, H, C = out_lat.shape
    V = w_uv.shape[1]
    assert T <= MAX_ROWS, T
    out = torch.empty(T, H * V, dtype=out_lat.dtype, device=out_lat.device)
    if T == 0 or H * V == 0:
        return out
    out_lat, w_uv = last_dim_contiguous(out_lat), last_dim_contiguous(w_uv)
    grid = (H, triton.cdiv(V, OUT_BLOCK_V))
    wrap_triton(_skinny_absorb_out_kernel)[grid](
        out_lat, w_uv, out, T, C, V,
        out_lat.stride(0), out_lat.stride(1), w_uv.stride(0), w_uv.stride(1), out.stride(0),
        ROWS=MAX_ROWS, BLOCK_V=OUT_BLOCK_V, BLOCK_C=min(triton.next_power_of_2(C), OUT_MAX_BLOCK_C), num_warps=4,
        **launch_kwargs(out_lat.device, C > 0),
    )
    return out


def _kernel_serves(x: Tensor) -> bool:
    return x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= MAX_ROWS


@torch.library.custom_op("mla::skinny_absorb_q_triton", mutates_args=())
def skinny_absorb_q_triton(q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """Triton ``mla::skinny_absorb_q`` (contract of ``mla::absorb_q``): the GEMV up to ``MAX_ROWS`` tokens; more
    tokens, non-CUDA tensors or float32/float64 run ``mla::absorb_q``."""
    if not _kernel_serves(q_nope):
        return torch.ops.mla.absorb_q(q_nope, w_uk, q_pe)
    validate_q(q_nope, w_uk, q_pe)
    return launch_q(q_nope, w_uk, q_pe)


@skinny_absorb_q_triton.register_fake
def _(q_nope, w_uk, q_pe):
    validate_q(q_nope, w_uk, q_pe)
    T, H, _ = q_nope.shape
    return q_nope.new_empty(T, H, w_uk.shape[2] + q_pe.shape[2])


@torch.library.custom_op("mla::skinny_absorb_out_triton", mutates_args=())
def skinny_absorb_out_triton(out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """Triton ``mla::skinny_absorb_out`` (contract of ``mla::absorb_out``): the GEMV up to ``MAX_ROWS`` tokens;
    more tokens, non-CUDA tensors or float32/float64 run ``mla::absorb_out``."""
    if not _kernel_serves(out_lat):
        return torch.ops.mla.absorb_out(out_lat, w_uv)
    validate_out(out_lat, w_uv)
    return launch_out(out_lat, w_uv)


@skinny_absorb_out_triton.register_fake
def _(out_lat, w_uv):
    validate_out(out_lat, w_uv)
    T, H, _ = out_lat.shape
    return out_lat.new_empty(T, H * w_uv.shape[1])
