"""Triton ``mla::write_latent_cache``: scatter ``[latent | k_pe]`` rows to their slots in one pass.

Slot -1 (padding) and slots outside ``[0, num_blocks * block_size)`` are masked off: never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.cache_write import validate
from mla_compile.ops.triton._common import last_dim_contiguous, pow2, slot_dest


@triton.jit
def _cache_write_kernel(
    lat_ptr, kpe_ptr, slot_ptr, cache_ptr,
    T, n_slots, block_size,
    s_lat, s_kpe, s_cb, s_ct,
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1).to(tl.int64)
    ok, dst = slot_dest(slot, cache_ptr, n_slots, block_size, s_cb, s_ct)
    for d0 in range(0, DC, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (d < DC)[None, :]
        x = tl.load(lat_ptr + rows[:, None] * s_lat + d[None, :], mask=m)
        tl.store(dst[:, None] + d[None, :], x.to(cache_ptr.dtype.element_ty), mask=m)
    for d0 in range(0, DR, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = ok[:, None] & (d < DR)[None, :]
        x = tl.load(kpe_ptr + rows[:, None] * s_kpe + d[None, :], mask=m)
        tl.store(dst[:, None] + DC + d[None, :], x.to(cache_ptr.dtype.element_ty), mask=m)


def _launch(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor) -> None:
    """Kernel path (the interpreter on CPU tensors too). Mutates ``kv_cache``."""
    T, dc = latent.shape
    dr = k_pe.shape[1]
    if T == 0 or kv_cache.numel() == 0:
        return
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"mla.write_latent_cache (triton): kv_cache needs a unit stride in its last dim, got "
                         f"strides {tuple(kv_cache.stride())}; allocate it contiguous or use backend='reference'")
    latent, k_pe = last_dim_contiguous(latent), last_dim_contiguous(k_pe)
    block_d = min(pow2(max(dc, dr)), 256)
    block_r = max(1, 2048 // block_d)
    wrap_triton(_cache_write_kernel)[(triton.cdiv(T, block_r),)](
        latent, k_pe, slot_mapping, kv_cache,
        T, kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[1],
        latent.stride(0), k_pe.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        DC=dc, DR=dr, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )


@triton_op("mla::write_latent_cache_triton", mutates_args=("kv_cache",))
def write_latent_cache_triton(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor) -> None:
    """Triton ``mla::write_latent_cache`` (contract of the ``_ref`` op); non-CUDA runs the reference."""
    if kv_cache.device.type != "cuda":
        torch.ops.mla.write_latent_cache_ref(latent, k_pe, slot_mapping, kv_cache)
        return
    validate(latent, k_pe, slot_mapping, kv_cache)
    _launch(latent, k_pe, slot_mapping, kv_cache)
