"""``mla::sparse_decode``: absorbed MLA decode restricted to a list of physical cache slots per query.

Contract: query ``q[b, i]`` (``q [B, s_q, H, D]``, the absorbed query ``[q_nope @ W_UK | q_pe]``) attends
over the cache rows at the slots ``indices[b, i, :]`` (``[B, s_q, topk]`` int32, slot = block *
block_size + offset into ``kv_cache [num_blocks, block_size, ...]``, -1 = invalid, skipped; any order).
The values are the first ``kv_lora_rank`` columns of each row. This equals dense attention restricted
to the listed positions (FlashMLA's sparse decode contract). A slot listed twice counts twice, so
indexers emit each slot once. The cache is bf16/fp16/fp32/fp64 ``[NB, BS, D]`` or the uint8 fp8
format of ``mla_compile.ops.fp8_cache`` (``[NB, BS, fp8_row_bytes(kv_lora_rank, D - kv_lora_rank)]``,
dequantized as read). Returns ``out [B, s_q, H, kv_lora_rank]`` (q's dtype) and ``lse [B, s_q, H]``
(float32, natural log). A query whose slots are all -1 gets ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._fp8_format import FP8_GROUP, fp8_row_bytes
from mla_compile.ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_range, check_same_device, check_tensor,
                                     data_checks_enabled)
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, SM90, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops._paged import attend
from mla_compile.ops.fp8_cache import dequantize_fp8_rows

OP = declare_op("sparse_decode", "mla.sparse_decode", cache=True)


def validate(q: Tensor, kv_cache: Tensor, indices: Tensor, kv_lora_rank: int) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode."""
    check_tensor(OP, "q", q, ndim=4, dtypes=FLOAT_DTYPES, expected="[B, s_q, H, kv_lora_rank + rope_dim]")
    B, s_q, H, D = q.shape
    if not 0 < kv_lora_rank <= D:
        raise ValueError(f"{OP}: kv_lora_rank must be in (0, {D}] (the value width inside a cache row), "
                         f"got {kv_lora_rank}")
    check_tensor(OP, "kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES + (torch.uint8,),
                 expected=f"[num_blocks, block_size, {D}] float, or uint8 fp8 rows")
    if kv_cache.dtype == torch.uint8:
        if kv_lora_rank % FP8_GROUP:
            raise ValueError(f"{OP}: kv_lora_rank must be a multiple of {FP8_GROUP} with an fp8 (uint8) kv_cache, "
                             f"got {kv_lora_rank}")
        W = fp8_row_bytes(kv_lora_rank, D - kv_lora_rank)
        check_tensor(OP, "kv_cache", kv_cache, shape=(None, None, W),
                     expected=f"[num_blocks, block_size, {W}] uint8 fp8 rows for {kv_lora_rank} + {D - kv_lora_rank}")
    else:
        check_tensor(OP, "kv_cache", kv_cache, shape=(None, None, D),
                     expected=f"[num_blocks, block_size, {D}] (the last dim must equal q's)")
    check_tensor(OP, "indices", indices, ndim=3, dtypes=INDEX_DTYPES, shape=(B, s_q, None),
                 expected="[B, s_q, topk] int32 physical slots")
    check_same_device(OP, q=q, kv_cache=kv_cache, indices=indices)
    if data_checks_enabled(indices):
        check_range(OP, "indices", indices, 0, kv_cache.shape[0] * kv_cache.shape[1], ignore=-1,
                    what="physical slots block * block_size + offset < num_blocks * block_size, or -1")


@torch.library.custom_op("mla::sparse_decode_ref", mutates_args=(), tags=LAYOUT_TAGS)
def sparse_decode_ref(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float,
                      kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device, float32 or float64 math): gather the listed rows, mask -1, softmax."""
    validate(q, kv_cache, indices, kv_lora_rank)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    visible = indices >= 0
    slots = torch.where(visible, indices.long(), 0)
    rows = kv_cache.reshape(-1, kv_cache.shape[2])[slots]  # [B, s_q, topk, W]
    rows = torch.cat(dequantize_fp8_rows(rows, kv_lora_rank), -1) if kv_cache.dtype == torch.uint8 else rows
    rows = torch.where(visible[..., None], rows.to(acc), 0)  # unwritten rows may hold NaN
    return attend(q, rows, visible, scale, kv_lora_rank)


@sparse_decode_ref.register_fake
def _(q, kv_cache, indices, scale, kv_lora_rank):
    validate(q, kv_cache, indices, kv_lora_rank)
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, kv_lora_rank), q.new_empty(B, s_q, H, dtype=torch.float32)


declare(OP, "reference", torch.ops.mla.sparse_decode_ref, rank=100, devices=("any",), dtypes=FLOATS,
        cache_dtypes=FLOATS + (torch.uint8,), gpu_tested=True, note="plain torch, the numerical ground truth")


def sparse_decode(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float, *, kv_lora_rank: int = 512,
                  backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Sparse absorbed decode; see the module docstring for the contract.

    ``q`` is ``[B, s_q, H, D]`` with ``indices [B, s_q, topk]``, or ``[B, H, D]`` with ``indices [B, topk]``
    (s_q = 1; then ``out`` is ``[B, H, kv_lora_rank]`` and ``lse`` is ``[B, H]``).
    """
    squeeze = q.dim() == 3
    q4, idx = (q.unsqueeze(1), indices.unsqueeze(1)) if squeeze else (q, indices)
    impl = resolve(OP, q.device, backend, dtype=q4.dtype, cache=kv_cache,
                   shape=lambda: (q4.shape[2], (kv_lora_rank, q4.shape[3] - kv_lora_rank), q4.shape[1]))
    out, lse = impl.fn(q4, kv_cache, idx, scale, kv_lora_rank)
    return (out.squeeze(1), lse.squeeze(1)) if squeeze else (out, lse)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.sparse_decode  # noqa: F401  (registers mla::sparse_decode_triton)
    return torch.ops.mla.sparse_decode_triton(q, kv_cache, indices, scale, kv_lora_rank)


declare(OP, "triton", _triton, rank=10, available=_triton_available, dtypes=FLOATS,
        cache_dtypes=FLOATS + (torch.uint8,), package="triton", gpu_tested=True,
        kernels=("sparse_decode_triton", "_sparse_split_kernel"), note="ours; bf16/fp16/fp32 or fp8 cache")


def _gluon64(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.sparse_decode_gluon64  # noqa: F401  (registers mla::sparse_decode_gluon64)
    return torch.ops.mla.sparse_decode_gluon64(q, kv_cache, indices, scale, kv_lora_rank)


# GPU-tested on the H200 (BENCHMARKS run 132); "auto" takes it where the timing table says it is fastest
declare(OP, "gluon64", _gluon64, rank=40, available=_triton_available, dtypes=(torch.bfloat16,),
        cache_dtypes=(torch.uint8, torch.bfloat16), stride_align=16, head_dims=((512, 64),), min_capability=SM90,
        max_capability=SM90, package="triton", gpu_tested=True,
        kernels=("sparse_decode_gluon64=gluon64 (opaque kernel)", "sparse_decode_gluon64_kernel"),
        note="ours (Gluon, sm_90: 64 heads a program, listed rows gathered with 16-byte loads (fp8: dequantized "
             "to bf16 in shared memory; bf16: cp.async), wgmma); bf16 q, fp8 or bf16 cache, 512 + 64")
