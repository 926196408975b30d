"""``mla::write_latent_cache``: scatter new latent rows into the paged latent cache.

Contract: ``latent [T, Dc]`` and ``k_pe [T, Dr]`` go to ``kv_cache[slot // block_size, slot % block_size]``
as ``[latent | k_pe]`` (cast to the cache dtype) for every token whose ``slot_mapping [T]`` entry is not
-1 (padding, skipped). The cache is mutated in place and nothing is returned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import FLOAT_DTYPES, INDEX_DTYPES, check_range, check_same_device, check_tensor, data_checks_enabled
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve
from mla_compile.ops._paged import scatter_rows

OP = declare_op("cache_write", "mla.write_latent_cache", env="if_present")


def validate(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor, op: str = OP) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode. Raises before any write.
    ``op`` names the op in the errors (the fused write reuses these checks)."""
    check_tensor(op, "latent", latent, ndim=2, dtypes=FLOAT_DTYPES, expected="[T, kv_lora_rank]")
    T, Dc = latent.shape
    check_tensor(op, "k_pe", k_pe, ndim=2, dtypes=FLOAT_DTYPES, shape=(T, None), expected="[T, rope_dim]")
    check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, shape=(T,), expected="[T] int32/int64")
    check_tensor(op, "kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES,
                 shape=(None, None, Dc + k_pe.shape[1]), expected=f"[num_blocks, block_size, {Dc}+{k_pe.shape[1]}]")
    check_same_device(op, latent=latent, k_pe=k_pe, slot_mapping=slot_mapping, kv_cache=kv_cache)
    if data_checks_enabled(slot_mapping):
        check_range(op, "slot_mapping", slot_mapping, 0, kv_cache.shape[0] * kv_cache.shape[1], ignore=-1,
                    what="num_blocks * block_size, or -1 for padding")


@torch.library.custom_op("mla::write_latent_cache_ref", mutates_args=("kv_cache",), tags=LAYOUT_TAGS)
def write_latent_cache_ref(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor) -> None:
    """Reference (plain torch, any device): ``index_put_`` of ``[latent | k_pe]`` rows at valid slots."""
    validate(latent, k_pe, slot_mapping, kv_cache)
    scatter_rows(kv_cache, slot_mapping, torch.cat([latent, k_pe], dim=-1).to(kv_cache.dtype))


@write_latent_cache_ref.register_fake
def _(latent, k_pe, slot_mapping, kv_cache):
    validate(latent, k_pe, slot_mapping, kv_cache)
    return None


declare(OP, "reference", torch.ops.mla.write_latent_cache_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch")


def write_latent_cache(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor, *,
                       backend: str | None = None) -> None:
    """Write ``latent [T, Dc]`` and ``k_pe [T, Dr]`` into ``kv_cache [NB, BS, Dc+Dr]`` at ``slot_mapping [T]``.

    Slot -1 marks padding and is skipped. Mutates ``kv_cache``; returns None.
    """
    resolve(OP, kv_cache.device, backend, dtype=kv_cache.dtype).fn(latent, k_pe, slot_mapping, kv_cache)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor) -> None:
    import mla_compile.ops.triton.cache_write  # noqa: F401  (registers mla::write_latent_cache_triton)
    torch.ops.mla.write_latent_cache_triton(latent, k_pe, slot_mapping, kv_cache)


declare(OP, "triton", _triton, rank=10, available=_triton_available, dtypes=FLOATS, package="triton", gpu_tested=True,
        kernels=("write_latent_cache_triton", "_cache_write_kernel"), note="ours")
