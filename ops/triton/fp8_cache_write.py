"""Triton ``mla::write_latent_cache_fp8``: quantize ``[latent | k_pe]`` rows into the 656-byte DeepSeek
fp8 format (``mla_compile.ops.fp8_cache``) at their slots, in one pass.

Bytes equal the reference's: group scales ``max(amax / 448, 2**-64)`` and quotients use IEEE division
(``div_rn``), e4m3 codes and the bf16 rope are rounded to nearest even in integer arithmetic. Slot -1
(padding) and slots outside ``[0, num_blocks * block_size)`` are masked off: never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.fp8_cache import validate_write
from mla_compile.ops.triton._common import last_dim_contiguous, pow2, slot_dest
from mla_compile.ops.triton._fp8 import bf16_bits, store_fp8_latent


@triton.jit
def _fp8_write_kernel(
    lat_ptr, kpe_ptr, slot_ptr, cache_ptr,
    T, n_slots, block_size,
    s_lat, s_kpe, s_cb, s_ct,
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1).to(tl.int64)
    ok, dst = slot_dest(slot, cache_ptr, n_slots, block_size, s_cb, s_ct)

    offs_c = tl.arange(0, BLOCK_DC)
    m = ok[:, None] & (offs_c < DC)[None, :]
    x = tl.load(lat_ptr + rows[:, None] * s_lat + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
    store_fp8_latent(dst, x, ok, DC, BLOCK_R, BLOCK_DC)

    offs_r = tl.arange(0, BLOCK_DR)
    mr = ok[:, None] & (offs_r < DR)[None, :]
    kpe = tl.load(kpe_ptr + rows[:, None] * s_kpe + offs_r[None, :], mask=mr, other=0.0).to(tl.float32)
    rope_dst = (dst + DC + 4 * (DC // 128)).to(tl.pointer_type(tl.int16))
    tl.store(rope_dst[:, None] + offs_r[None, :], bf16_bits(kpe), mask=mr)


def _launch(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor) -> None:
    """Kernel path (the interpreter on CPU tensors too). Mutates ``kv_cache``."""
    T, dc = latent.shape
    dr = k_pe.shape[1]
    if T == 0 or kv_cache.numel() == 0:
        return
    if kv_cache.stride(-1) != 1 or kv_cache.stride(1) % 4 or kv_cache.stride(0) % 4:
        raise ValueError(f"mla.write_latent_cache_fp8 (triton): kv_cache needs a unit stride in its last dim and "
                         f"row/block strides that keep the fp32 scales 4-byte aligned, got strides "
                         f"{tuple(kv_cache.stride())}; allocate it contiguous or use backend='reference'")
    latent, k_pe = last_dim_contiguous(latent), last_dim_contiguous(k_pe)
    block_dc = pow2(dc, 128)
    block_r = max(1, 4096 // block_dc)
    wrap_triton(_fp8_write_kernel)[(triton.cdiv(T, block_r),)](
        latent, k_pe, slot_mapping, kv_cache,
        T, kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[1],
        latent.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        DC=dc, DR=dr, BLOCK_R=block_r, BLOCK_DC=block_dc, BLOCK_DR=pow2(dr, 1), num_warps=4,
    )


@triton_op("mla::write_latent_cache_fp8_triton", mutates_args=("kv_cache",))
def write_latent_cache_fp8_triton(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor) -> None:
    """Triton ``mla::write_latent_cache_fp8`` (contract of the ``_ref`` op); non-CUDA runs the reference."""
    if kv_cache.device.type != "cuda":
        torch.ops.mla.write_latent_cache_fp8_ref(latent, k_pe, slot_mapping, kv_cache)
        return
    validate_write(latent, k_pe, slot_mapping, kv_cache)
    _launch(latent, k_pe, slot_mapping, kv_cache)
