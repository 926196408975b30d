"""FlashMLA (PyPI ``sgl-flash-mla``, import ``flash_mla``) as a ``mla::decode`` backend: ``"flashmla"``.

Call contract (the one measured on the H200, see ``shared/device/anchors.py``):
``meta, _ = flash_mla.get_mla_metadata()`` then
``out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta,
softmax_scale=s, causal=..., use_legacy=True)`` with ``q [B, s_q, H, 576]`` bf16, ``k_cache
[blocks, 64, 1, 576]``, int32 ``block_table``/``cache_seqlens``; ``out [B, s_q, H, 512]``,
``lse [B, H, s_q]`` float32, natural log. ``use_legacy=True`` selects the Hopper (sm90) kernels.

Dense bf16, block size 64, kv_lora_rank 512 + rope 64 only. The split-KV schedule depends on the
values of ``cache_seqlens``, so a fresh ``meta`` is made on every call and FlashMLA computes the
schedule on the GPU inside the call: nothing is read on the host, and a captured graph recomputes
it on every replay with the new lengths. (Sharing one schedule across the layers of a step, kept in
persistent buffers by the metadata builder, is a later optimisation.) At our boundary the LSE goes
``[B, H, s_q] -> [B, s_q, H]`` and queries that see no row get ``out = 0``, ``lse = -inf``.

Dense fp8 and sparse (index-list) decode are not wired yet. Not run on a GPU yet: the CPU contract
tests (a fake ``flash_mla`` module) cover the call; ``tests/ops/adapters`` has the CUDA tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._dispatch import register_impl
from mla_compile.ops.adapters._common import (check_dtype, check_value, finish_decode, importable,
                                              require_capability)
from mla_compile.ops.decode import OP, validate
from mla_compile.ops.decode import fake as decode_fake

BACKEND = "flashmla"
MODULE = "flash_mla"
BLOCK_SIZE = 64
DTYPES = (torch.bfloat16,)


def flashmla_decode_core(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                         kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """The adapter on any tensors (CPU with a fake ``flash_mla`` in tests).

    Returns ``(out [B, s_q, H, Dc], lse [B, s_q, H])`` under our contract.
    """
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    check_dtype(OP, BACKEND, "q", q, DTYPES)
    check_dtype(OP, BACKEND, "kv_cache", kv_cache, DTYPES)
    check_value(OP, BACKEND, "block_size (kv_cache.shape[1])", kv_cache.shape[1], (BLOCK_SIZE,))
    check_value(OP, BACKEND, "kv_lora_rank", kv_lora_rank, (512,))
    check_value(OP, BACKEND, "head dim (q.shape[-1])", q.shape[-1], (576,))
    import flash_mla

    s_q = q.shape[1]
    meta, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, kv_cache.unsqueeze(2), block_table.to(torch.int32), seq_lens.to(torch.int32), kv_lora_rank, meta,
        softmax_scale=scale, causal=s_q > 1, use_legacy=True)
    return finish_decode(out, lse.transpose(1, 2), seq_lens)


@torch.library.custom_op("mla::decode_flashmla", mutates_args=())
def decode_flashmla(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                    kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode`` through FlashMLA's Hopper kernels (same contract as ``mla::decode_ref``)."""
    require_capability(OP, BACKEND, q.device, (9, 0), (9, 0))
    return flashmla_decode_core(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


decode_flashmla.register_fake(decode_fake)


def available() -> bool:
    """Whether ``flash_mla`` is installed (found without importing it)."""
    return importable(MODULE)


register_impl(OP, BACKEND, torch.ops.mla.decode_flashmla, devices=("cuda",), available=available)
