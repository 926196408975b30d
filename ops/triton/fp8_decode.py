"""Triton ``mla::decode_fp8``: split-KV decode reading the 656-byte DeepSeek fp8 cache directly (the
kernel is ``ops/triton/fp8_decode_kernel.py``, launched through ``decode._launch``): e4m3 codes go to the
dots exactly, the group scales weight scores and P per key row, so the cache is read once at 57% of the
bf16 bytes."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from mla_compile.ops.fp8_cache import validate_decode
from mla_compile.ops.triton.decode import _launch


def _check_alignment(kv_cache: Tensor) -> None:
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) % 4 or kv_cache.stride(1) % 4:
        raise ValueError(f"mla.decode_fp8 (triton): kv_cache needs a unit stride in its last dim and row/block "
                         f"strides that keep the fp32 scales 4-byte aligned, got strides {tuple(kv_cache.stride())}; "
                         f"allocate it contiguous or use backend='reference'")


def launch_fp8(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
               kv_lora_rank: int, config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Kernel path (the interpreter on CPU tensors too); ``config`` as in ``decode._launch``."""
    _check_alignment(kv_cache)
    if kv_lora_rank > 4 * 128:
        raise ValueError(f"mla.decode_fp8 (triton): the kernel holds at most 4 scale groups (kv_lora_rank <= 512), "
                         f"got kv_lora_rank={kv_lora_rank}; use backend='reference'")
    return _launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, config=config, fp8=True)


@triton_op("mla::decode_fp8_triton", mutates_args=())
def decode_fp8_triton(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                      kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Triton ``mla::decode_fp8`` (same contract as ``mla::decode_fp8_ref``); non-CUDA or float64 runs the reference."""
    if q.device.type != "cuda" or q.dtype == torch.float64:
        return torch.ops.mla.decode_fp8_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    return launch_fp8(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
