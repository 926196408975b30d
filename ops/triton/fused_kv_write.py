"""Triton kernel of ``mla::write_latent_cache_fused``: one program per token computes the latent's
RMSNorm, the RoPE of k_pe and stores ``[norm | rope]`` at the token's cache slot (slot -1 and slots out
of range are skipped). Rounding follows the unfused torch code: the normalized latent is rounded to the
latent's dtype before the weight multiply, the product to the promoted dtype of weight and latent, the
rotated k_pe to k_pe's dtype, then both to the cache dtype.

With ``FP8`` (a uint8 cache of DeepSeek fp8 rows) the rounded norm is quantized by the fp8 cache write's
own helper (:func:`mla_compile.ops.triton._fp8.store_fp8_latent`: e4m3 codes + float32 group scales)
and the rotated k_pe is stored as bfloat16, so a row's bytes are those of ``mla::write_latent_cache_fp8``
given the same normed latent and roped k_pe. On sm_90 it is launched with PDL (``_pdl.py``): it waits for the
kernel before it first thing, then lets the next one be scheduled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mla_compile.ops.triton._common import pow2
from mla_compile.ops.triton._pdl import launch_kwargs, pdl_launch_dependents, pdl_wait
from mla_compile.ops.triton._fp8 import bf16_bits, store_fp8_latent


@triton.jit
def _fused_kv_write_kernel(
    lat_ptr, kpe_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr,
    n_slots, block_size, eps,
    s_lat, s_kpe, s_cos, s_sin, s_cb, s_ct,
    DC: tl.constexpr, HALF: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr, ROUND_NORM: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)  # every operand but the norm weight comes from the step's kernels
    pdl_launch_dependents(PDL)
    kv_write_row(tl.program_id(0).to(tl.int64), lat_ptr, kpe_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr,
                 n_slots, block_size, eps, s_lat, s_kpe, s_cos, s_sin, s_cb, s_ct, DC, HALF, BLOCK_DC, BLOCK_HALF,
                 INTERLEAVE, ROUND_NORM, FP8)


@triton.jit
def kv_write_row(
    t, lat_ptr, kpe_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr,
    n_slots, block_size, eps,
    s_lat, s_kpe, s_cos, s_sin, s_cb, s_ct,
    DC: tl.constexpr, HALF: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr, ROUND_NORM: tl.constexpr, FP8: tl.constexpr,
):
    """Token ``t``'s row (a ``_fused_kv_write_kernel`` program, after its PDL wait): see the module docstring."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (slot < n_slots)
    dst = cache_ptr + (slot // block_size) * s_cb + (slot % block_size) * s_ct
    eps = tl.full([], eps, tl.float32)  # Python floats may arrive as fp64

    d = tl.arange(0, BLOCK_DC)
    dm = d < DC
    x = tl.load(lat_ptr + t * s_lat + d, mask=dm & ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / DC
    xn = x * tl.math.rsqrt(var + eps)
    xn = xn.to(lat_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    y = w * xn
    if ROUND_NORM:  # the product's dtype: torch.promote_types(weight, latent)
        y = y.to(lat_ptr.dtype.element_ty)
    else:
        y = y.to(w_ptr.dtype.element_ty)
    if FP8:  # one row of the fp8 write's [rows, BLOCK_DC] tile; 0 past DC leaves the group maxima alone
        slot1 = tl.zeros([1], tl.int64) + slot
        store_fp8_latent(dst + (slot1 - slot), tl.reshape(y.to(tl.float32), (1, BLOCK_DC)),
                         (slot1 >= 0) & (slot1 < n_slots), DC, 1, BLOCK_DC)
    else:
        tl.store(dst + d, y.to(cache_ptr.dtype.element_ty), mask=dm & ok)

    j = tl.arange(0, BLOCK_HALF)
    jm = (j < HALF) & ok
    if INTERLEAVE:
        x1 = tl.load(kpe_ptr + t * s_kpe + 2 * j, mask=jm, other=0.0).to(tl.float32)
        x2 = tl.load(kpe_ptr + t * s_kpe + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(kpe_ptr + t * s_kpe + j, mask=jm, other=0.0).to(tl.float32)
        x2 = tl.load(kpe_ptr + t * s_kpe + HALF + j, mask=jm, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * s_cos + j, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * s_sin + j, mask=jm, other=0.0).to(tl.float32)
    o1 = (x1 * c - x2 * s).to(kpe_ptr.dtype.element_ty)
    o2 = (x2 * c + x1 * s).to(kpe_ptr.dtype.element_ty)
    if FP8:  # the rope part of an fp8 row: bfloat16 after the e4m3 latent and its scales
        rope_dst = (dst + DC + 4 * (DC // 128)).to(tl.pointer_type(tl.int16))
        tl.store(rope_dst + j, bf16_bits(o1.to(tl.float32)), mask=jm)
        tl.store(rope_dst + HALF + j, bf16_bits(o2.to(tl.float32)), mask=jm)
    else:
        tl.store(dst + DC + j, o1.to(cache_ptr.dtype.element_ty), mask=jm)
        tl.store(dst + DC + HALF + j, o2.to(cache_ptr.dtype.element_ty), mask=jm)


def launch(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor,
           kv_cache: Tensor, eps: float, interleave: bool) -> None:
    """Run the kernel (any device the Triton runtime accepts; the interpreter on CPU tensors). Mutates ``kv_cache``
    (float rows, or fp8 rows when it is uint8)."""
    T, dc = latent.shape
    half = k_pe.shape[1] // 2
    if T == 0 or kv_cache.numel() == 0:
        return
    fp8 = kv_cache.dtype == torch.uint8
    if kv_cache.stride(-1) != 1 or (fp8 and (kv_cache.stride(1) % 4 or kv_cache.stride(0) % 4)):
        raise ValueError(f"mla.write_latent_cache_fused (triton): kv_cache needs a unit stride in its last dim"
                         f"{' and row/block strides that keep the fp32 scales 4-byte aligned' if fp8 else ''}, "
                         f"got strides {tuple(kv_cache.stride())}")
    latent, k_pe, norm_weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (latent, k_pe, norm_weight))
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    round_norm = torch.promote_types(norm_weight.dtype, latent.dtype) == latent.dtype
    _fused_kv_write_kernel[(T,)](
        latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache,
        kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[1], float(eps),
        latent.stride(0), k_pe.stride(0), cos.stride(0), sin.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        DC=dc, HALF=half, BLOCK_DC=pow2(dc, 128 if fp8 else 16), BLOCK_HALF=pow2(half), INTERLEAVE=bool(interleave),
        ROUND_NORM=bool(round_norm), FP8=fp8, num_warps=4 if dc <= 512 else 8, **launch_kwargs(latent.device),
    )
