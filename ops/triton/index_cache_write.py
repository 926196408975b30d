"""Triton ``mla::write_index_cache``: scatter index keys to their slots in one pass, as float rows or as
fp8 index rows (``mla_compile.ops.fp8_index``: d e4m3 codes, then the key's float32 scale).

fp8 bytes equal the reference's: the scale ``max(amax / 448, 2**-64)`` and the quotients use IEEE
division (``div_rn``, as the reference's tensor divisor does), the e4m3 codes are rounded to nearest even
in integer arithmetic. The scale is stored byte by byte (no alignment needed for any d). Slot -1
(padding) and slots outside ``[0, num_blocks * block_size)`` are masked off: never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.sparse_index import validate_write
from mla_compile.ops.triton._common import last_dim_contiguous, pow2, slot_dest
from mla_compile.ops.triton._fp8 import FP8_MAX, SCALE_FLOOR, e4m3_codes


@triton.jit
def _index_write_kernel(
    k_ptr, slot_ptr, cache_ptr,
    T, n_slots, block_size,
    s_k, s_cb, s_ct,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1).to(tl.int64)
    ok, dst = slot_dest(slot, cache_ptr, n_slots, block_size, s_cb, s_ct)
    offs = tl.arange(0, BLOCK_D)
    m = ok[:, None] & (offs < D)[None, :]
    x = tl.load(k_ptr + rows[:, None] * s_k + offs[None, :], mask=m, other=0.0)
    if FP8:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(tl.math.div_rn(amax, tl.full([BLOCK_R], FP8_MAX, tl.float32)), SCALE_FLOOR)
        quot = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (BLOCK_R, BLOCK_D)))
        quot = tl.minimum(tl.maximum(quot, -FP8_MAX), FP8_MAX)
        tl.store(dst[:, None] + offs[None, :], e4m3_codes(quot), mask=m)
        bits = scale.to(tl.int32, bitcast=True)
        b = tl.arange(0, 4)
        scale_bytes = ((bits[:, None] >> (8 * b)[None, :]) & 0xFF).to(tl.uint8)  # little-endian float32
        tl.store(dst[:, None] + D + b[None, :], scale_bytes, mask=ok[:, None])
    else:
        tl.store(dst[:, None] + offs[None, :], x.to(cache_ptr.dtype.element_ty), mask=m)


def _launch(k_idx: Tensor, slot_mapping: Tensor, k_idx_cache: Tensor) -> None:
    """Kernel path (the interpreter on CPU tensors too). Mutates ``k_idx_cache``."""
    T, d = k_idx.shape
    if T == 0 or k_idx_cache.numel() == 0:
        return
    if k_idx_cache.stride(-1) != 1:
        raise ValueError(f"mla.write_index_cache (triton): k_idx_cache needs a unit stride in its last dim, got "
                         f"strides {tuple(k_idx_cache.stride())}; allocate it contiguous or use backend='reference'")
    k_idx = last_dim_contiguous(k_idx)
    block_d = pow2(d, 16)
    fp8 = k_idx_cache.dtype == torch.uint8
    block_r = max(1, (2048 if fp8 else 4096) // block_d)  # fp8: 16 keys of 128 (4096 took 236 registers on sm_90)
    wrap_triton(_index_write_kernel)[(triton.cdiv(T, block_r),)](
        k_idx, slot_mapping, k_idx_cache,
        T, k_idx_cache.shape[0] * k_idx_cache.shape[1], k_idx_cache.shape[1],
        k_idx.stride(0), k_idx_cache.stride(0), k_idx_cache.stride(1),
        D=d, BLOCK_R=block_r, BLOCK_D=block_d, FP8=fp8, num_warps=4,
    )


@triton_op("mla::write_index_cache_triton", mutates_args=("k_idx_cache",))
def write_index_cache_triton(k_idx: Tensor, slot_mapping: Tensor, k_idx_cache: Tensor) -> None:
    """Triton ``mla::write_index_cache`` (contract of the ``_ref`` op); non-CUDA or float64 runs the reference."""
    if k_idx_cache.device.type != "cuda" or torch.float64 in (k_idx.dtype, k_idx_cache.dtype):
        torch.ops.mla.write_index_cache_ref(k_idx, slot_mapping, k_idx_cache)
        return
    validate_write(k_idx, slot_mapping, k_idx_cache)
    _launch(k_idx, slot_mapping, k_idx_cache)
