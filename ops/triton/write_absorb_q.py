"""Triton ``mla::write_latent_cache_absorb_q``: ``mla::skinny_absorb_q``'s programs and
``mla::write_latent_cache_fused``'s in one launch.

Grid ``(H * cdiv(Dc, Q_BLOCK_C) + T,)``: program ``p < H * cdiv(Dc, Q_BLOCK_C)`` is the absorb kernel's program
``(p // cdiv(Dc, Q_BLOCK_C), p % cdiv(Dc, Q_BLOCK_C))`` (``skinny_absorb.absorb_q_tile``, with ``ROPE``: the
``cb == 0`` programs rotate each token's q_pe by its cos / sin row as they copy it into the last ``Dr`` columns),
the last ``T`` programs the fused write's token rows (``fused_kv_write.kv_write_row``: the latent's norm, k_pe's RoPE,
the store at the token's slot, fp8 rows into a uint8 cache). The two parts share no data, so the write costs no
launch of its own and q_pe's RoPE no kernel of its own. On sm_90 the launch takes PDL (``_pdl.py``): every program
waits before reading the step's tensors (an absorb program after requesting its first W_UK tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from mla_compile.ops.registry import LAYOUT_TAGS
from mla_compile.ops.triton._common import last_dim_contiguous, pow2
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait
from mla_compile.ops.triton.fused_kv_write import kv_write_row
from mla_compile.ops.triton.skinny_absorb import Q_BLOCK_C, Q_MAX_BLOCK_N, absorb_q_tile, q_abs_output
from mla_compile.ops.write_absorb_q import MAX_ROWS, fake, validate


@triton.jit
def _write_absorb_q_kernel(
    q_ptr, w_ptr, pe_ptr, out_ptr, T, N, C, R, s_qt, s_qh, s_wh, s_wn, s_pt, s_ph, s_ot, s_oh, s_cos, s_sin,
    lat_ptr, kpe_ptr, nw_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, n_slots, block_size, eps, s_lat, s_kpe, s_cb, s_ct,
    ABSORB_PROGRAMS, COL_TILES,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    DC: tl.constexpr, HALF: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr, ROUND_NORM: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < ABSORB_PROGRAMS:
        absorb_q_tile(q_ptr, w_ptr, pe_ptr, out_ptr, (pid // COL_TILES).to(tl.int64), pid % COL_TILES, T, N, C, R,
                      s_qt, s_qh, s_wh, s_wn, s_pt, s_ph, s_ot, s_oh, cos_ptr, sin_ptr, s_cos, s_sin, ROWS, BLOCK_N,
                      BLOCK_C, BLOCK_R, PDL, True, INTERLEAVE)
    else:
        pdl_wait(PDL)  # every operand but the norm weight comes from the step's kernels
        pdl_launch_dependents(PDL)
        kv_write_row((pid - ABSORB_PROGRAMS).to(tl.int64), lat_ptr, kpe_ptr, nw_ptr, cos_ptr, sin_ptr, slot_ptr,
                     cache_ptr, n_slots, block_size, eps, s_lat, s_kpe, s_cos, s_sin, s_cb, s_ct, DC, HALF, BLOCK_DC,
                     BLOCK_HALF, INTERLEAVE, ROUND_NORM, FP8)


def launch(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor,
           kv_cache: Tensor, eps: float, interleave: bool, q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """The one launch (the interpreter on CPU tensors too): at most ``MAX_ROWS`` tokens; mutates ``kv_cache``,
    returns ``q_abs``. The cache's layout requirements are ``mla::write_latent_cache_fused``'s kernel's."""
    T, H, N = q_nope.shape
    C, R = w_uk.shape[2], q_pe.shape[2]
    out = q_abs_output(q_nope, w_uk, q_pe)
    if T == 0 or H == 0:
        return out
    fp8 = kv_cache.dtype == torch.uint8
    if kv_cache.stride(-1) != 1 or (fp8 and (kv_cache.stride(1) % 4 or kv_cache.stride(0) % 4)):
        raise ValueError(f"mla.write_latent_cache_absorb_q (triton): kv_cache needs a unit stride in its last dim"
                         f"{' and row/block strides that keep the fp32 scales 4-byte aligned' if fp8 else ''}, "
                         f"got strides {tuple(kv_cache.stride())}")
    q_nope, q_pe, w_uk = last_dim_contiguous(q_nope), last_dim_contiguous(q_pe), last_dim_contiguous(w_uk)
    latent, k_pe, norm_weight, cos, sin = (last_dim_contiguous(t) for t in (latent, k_pe, norm_weight, cos, sin))
    col_tiles = triton.cdiv(C, Q_BLOCK_C)
    absorb_programs = H * col_tiles
    dc, half = latent.shape[1], k_pe.shape[1] // 2
    wrap_triton(_write_absorb_q_kernel)[(absorb_programs + T,)](
        q_nope, w_uk, q_pe, out, T, N, C, R, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1),
        q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, kv_cache.shape[0] * kv_cache.shape[1],
        kv_cache.shape[1], float(eps), latent.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        absorb_programs, col_tiles,
        ROWS=MAX_ROWS, BLOCK_N=min(triton.next_power_of_2(N), Q_MAX_BLOCK_N), BLOCK_C=Q_BLOCK_C,
        BLOCK_R=triton.next_power_of_2(max(R, 2)), DC=dc, HALF=half, BLOCK_DC=pow2(dc, 128 if fp8 else 16),
        BLOCK_HALF=pow2(half), INTERLEAVE=bool(interleave),
        ROUND_NORM=torch.promote_types(norm_weight.dtype, latent.dtype) == latent.dtype, FP8=fp8, num_warps=4,
        **launch_kwargs(q_nope.device, N > 0),
    )
    return out


def _kernel_serves(q_nope: Tensor, kv_cache: Tensor) -> bool:
    return (q_nope.device.type == "cuda" and q_nope.dtype in (torch.bfloat16, torch.float16)
            and q_nope.shape[0] <= MAX_ROWS and kv_cache.dtype != torch.float64)


@torch.library.custom_op("mla::write_latent_cache_absorb_q_triton", mutates_args=("kv_cache",), tags=LAYOUT_TAGS)
def write_latent_cache_absorb_q_triton(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor,
                                       slot_mapping: Tensor, kv_cache: Tensor, eps: float, interleave: bool,
                                       q_nope: Tensor, w_uk: Tensor, q_pe: Tensor) -> Tensor:
    """Triton ``mla::write_latent_cache_absorb_q`` (contract of the ``_ref`` op): :func:`launch` up to ``MAX_ROWS``
    tokens on CUDA half precision; more tokens: ``mla::write_latent_cache_fused`` and ``mla::absorb_q`` of the
    rotated q_pe; elsewhere the reference."""
    validate(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, q_nope, w_uk, q_pe)
    if _kernel_serves(q_nope, kv_cache):
        return launch(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, eps, interleave, q_nope, w_uk,
                      q_pe)
    if q_nope.device.type != "cuda":
        return torch.ops.mla.write_latent_cache_absorb_q_ref(latent, k_pe, norm_weight, cos, sin, slot_mapping,
                                                             kv_cache, eps, interleave, q_nope, w_uk, q_pe)
    from mla_compile.ops.write_absorb_q import rope_heads

    torch.ops.mla.write_latent_cache_fused(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, eps,
                                           interleave)
    return torch.ops.mla.absorb_q(q_nope, w_uk, rope_heads(q_pe, cos, sin, interleave))


write_latent_cache_absorb_q_triton.register_fake(fake)
