"""``mla::write_latent_cache_fused``: RMSNorm of the latent + RoPE of k_pe + the paged cache write, one op.

Contract: for every token t whose ``slot_mapping[t] != -1``, the cache row at that slot becomes
``[rms_norm(latent[t]) | rope(k_pe[t])]`` cast to the cache dtype, where ``rms_norm`` is DeepSeek's
(float32 mean of squares, ``x * rsqrt(var + eps)`` cast back to the input dtype, times ``norm_weight``)
and ``rope`` is :func:`mla_compile.models.rope.apply_rope`'s math (``interleave`` pairs or rotate-half) in
float32, cast back to k_pe's dtype. It is what ``kv_a_layernorm`` + ``apply_rope`` +
``mla::write_latent_cache`` compute, in one launch. A ``uint8`` cache holds the 656-byte DeepSeek fp8
rows instead (``mla_compile.ops.fp8_cache``): the row is quantized exactly as
``mla::write_latent_cache_fp8`` quantizes ``[rms_norm(latent) | rope(k_pe)]`` (same bytes). The fusion
pass in :mod:`mla_compile.lowerings.passes` puts it in compiled graphs; nothing calls it directly.

``latent [T, Dc]``, ``k_pe [T, Dr]`` (Dr even), ``norm_weight [Dc]``, ``cos``/``sin [T, Dr/2]`` float32,
``slot_mapping [T]``, ``kv_cache`` (mutated; nothing is returned): float ``[num_blocks, block_size, Dc + Dr]``
or fp8 rows ``uint8 [num_blocks, block_size, Dc + Dc / 32 + 2 * Dr]`` (Dc a multiple of 128).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import FLOAT_DTYPES, check_tensor
from mla_compile.ops.registry import LAYOUT_TAGS, declare_kernels
from mla_compile.ops._paged import scatter_rows
from mla_compile.ops.cache_write import validate as validate_write
from mla_compile.ops.fp8_cache import quantize_fp8_rows
from mla_compile.ops.fp8_cache import validate_write as validate_write_fp8
from mla_compile.ops.triton import available as _triton_available

OP = "mla.write_latent_cache_fused"


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """DeepSeek's RMSNorm (the HF module's math): float32 statistics, cast back, times ``weight``."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """RoPE of ``x [T, Dr]`` by ``cos/sin [T, Dr/2]``, as :func:`mla_compile.models.rope.apply_rope` (de-interleaved output)."""
    xf = x.float()
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def validate(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor, slot_mapping: Tensor,
             kv_cache: Tensor) -> None:
    """The cache write's checks (the fp8 write's for a uint8 cache) plus the norm weight and the rotary
    tables (no sync)."""
    write_checks = validate_write_fp8 if kv_cache.dtype == torch.uint8 else validate_write
    write_checks(latent, k_pe, slot_mapping, kv_cache, op=OP)
    T, Dc = latent.shape
    Dr = k_pe.shape[1]
    if Dr % 2:
        raise ValueError(f"{OP}: k_pe's last dim (rope_dim) must be even, got {Dr}")
    check_tensor(OP, "norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, shape=(Dc,), expected=f"[{Dc}]")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(OP, name, t, ndim=2, dtypes=FLOAT_DTYPES, shape=(T, Dr // 2), expected=f"[{T}, {Dr // 2}] float32")


@torch.library.custom_op("mla::write_latent_cache_fused", mutates_args=("kv_cache",), tags=LAYOUT_TAGS)
def write_latent_cache_fused(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor,
                             slot_mapping: Tensor, kv_cache: Tensor, eps: float, interleave: bool) -> None:
    """Norm + RoPE + cache write: the Triton kernel on CUDA (when Triton imports), else the reference."""
    validate(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache)
    if kv_cache.device.type == "cuda" and _triton_available() and kv_cache.dtype != torch.float64:
        from mla_compile.ops.triton.fused_kv_write import launch

        launch(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, eps, interleave)
        return
    write_latent_cache_fused_reference(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, eps, interleave)


def write_latent_cache_fused_reference(latent: Tensor, k_pe: Tensor, norm_weight: Tensor, cos: Tensor, sin: Tensor,
                                       slot_mapping: Tensor, kv_cache: Tensor, eps: float, interleave: bool) -> None:
    """Plain torch on any device: the unfused computation, then the shared scatter (a uint8 cache gets
    the rows of :func:`mla_compile.ops.fp8_cache.quantize_fp8_rows`)."""
    normed, roped = rms_norm(latent, norm_weight, eps), rope(k_pe, cos, sin, interleave)
    if kv_cache.dtype == torch.uint8:
        rows = quantize_fp8_rows(normed, roped)
    else:
        rows = torch.cat([normed, roped], dim=-1).to(kv_cache.dtype)
    scatter_rows(kv_cache, slot_mapping, rows)


@write_latent_cache_fused.register_fake
def _(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache, eps, interleave):
    validate(latent, k_pe, norm_weight, cos, sin, slot_mapping, kv_cache)
    return None


declare_kernels("fused (triton/reference)", "write_latent_cache_fused")
declare_kernels("triton", "_fused_kv_write_kernel")
