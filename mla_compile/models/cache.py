"""Paged latent KV-cache layout, memory math and allocation.

A bf16 cache row is ``[latent (kv_lora_rank) | k_pe (qk_rope_head_dim)]``: 576 values, 1152 bytes for
DeepSeek. The fp8 DeepSeek format stores 512 e4m3 latents, one fp32 scale per 128 latents and the 64
rope values in bf16: 656 bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mla_compile.models.config import MLAConfig
from mla_compile.parallel.config import ParallelConfig
from mla_compile.ops._fp8_format import FP8_GROUP, fp8_index_row_bytes, fp8_row_bytes  # noqa: F401  (re-exported)

FP8_POISON = 0xFF  # the fill byte of a NaN-filled fp8 cache: e4m3 0xFF and an all-ones float32 are NaN

@dataclass(frozen=True)
class CacheLayout:
    """Bytes per token for one layer and for the whole model, and the compression versus MHA."""

    config: MLAConfig
    cache_dtype: str = "bf16"  # "bf16", "fp32" or "fp8" (the 656-byte DeepSeek format)
    parallel: ParallelConfig | None = None  # a sharded model's layout: see copies / bytes_per_token_per_rank

    def __post_init__(self) -> None:
        if self.cache_dtype not in ("bf16", "fp32", "fp8"):
            raise ValueError(f"cache_dtype must be 'bf16', 'fp32' or 'fp8', got {self.cache_dtype!r}")

    @property
    def copies(self) -> int:
        """Ranks that store each latent row: the latent has no head dim, so every rank of an attention group
        holds the whole row (``attn_tp`` copies) unless DCP splits the tokens ``dcp`` ways: ``attn_tp // dcp``
        (1 without ``parallel``)."""
        p = self.parallel
        return 1 if p is None else p.attn_tp // p.dcp

    @property
    def bytes_per_token_per_rank(self) -> float:
        """Cache bytes one token of a sequence costs each rank of its attention group, all layers
        (``bytes_per_token / dcp``; the whole row without DCP)."""
        return self.bytes_per_token / (1 if self.parallel is None else self.parallel.dcp)

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Latent cache bytes of one token in one layer."""
        c = self.config
        if self.cache_dtype == "fp8":
            return fp8_row_bytes(c.kv_lora_rank, c.qk_rope_head_dim)
        return c.latent_dim * (2 if self.cache_dtype == "bf16" else 4)

    @property
    def bytes_per_token(self) -> int:
        """Latent cache bytes of one token across all layers."""
        return self.bytes_per_token_per_layer * self.config.num_layers

    @property
    def mha_bytes_per_token(self) -> int:
        """What a dense per-head K/V cache (bf16, as HF keeps it) would take per token, all layers."""
        c = self.config
        return c.num_layers * c.num_heads * (c.qk_head_dim + c.v_head_dim) * 2

    @property
    def compression_ratio(self) -> float:
        """MHA-equivalent bytes over latent bytes (71x for DeepSeek-V3 in bf16: K 192 + V 128 per head vs 576)."""
        return self.mha_bytes_per_token / self.bytes_per_token

    def capacity_tokens(self, memory_bytes: int) -> int:
        """Tokens that fit in ``memory_bytes`` of cache across all layers."""
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
        return memory_bytes // self.bytes_per_token

    def num_blocks(self, memory_bytes: int, block_size: int) -> int:
        """Whole cache blocks of ``block_size`` tokens that fit in ``memory_bytes``."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return self.capacity_tokens(memory_bytes) // block_size


def allocate_latent_cache(num_blocks: int, block_size: int, config: MLAConfig, *,
                          dtype: torch.dtype | str = torch.bfloat16, device: torch.device | str = "cpu",
                          fill: float = 0.0) -> torch.Tensor:
    """One layer's paged latent cache ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` of a
    float ``dtype``, or with ``dtype="fp8"`` the 656-byte DeepSeek fp8 rows ``uint8 [num_blocks,
    block_size, fp8_row_bytes(kv_lora_rank, rope)]`` (``mla_compile.ops.fp8_cache``).

    Tests pass ``fill=float("nan")`` so that any read of a row that was never written shows up (an fp8
    cache takes 0 or NaN: all bytes 0, or all bytes 0xFF, which reads back as NaN).
    """
    return _paged_cache("latent", num_blocks, block_size, dtype, device, fill, config.latent_dim,
                        lambda: fp8_row_bytes(config.kv_lora_rank, config.qk_rope_head_dim))


def allocate_index_cache(num_blocks: int, block_size: int, config: MLAConfig, *,
                         dtype: torch.dtype | str = torch.bfloat16, device: torch.device | str = "cpu",
                         fill: float = 0.0) -> torch.Tensor:
    """One V3.2 layer's paged index-key cache (the lightning indexer's keys; same blocks and slots as the
    latent cache): ``[num_blocks, block_size, index_head_dim]`` of a float ``dtype``, or with
    ``dtype="fp8"`` the fp8 index format ``uint8 [num_blocks, block_size, index_head_dim + 4]``
    (132 bytes per token for 128 dims; see ``mla_compile.ops.fp8_index``).

    ``fill`` is a value for a float cache; an fp8 cache takes 0 (all bytes 0: keys read back as 0) or
    NaN (all bytes 0xFF: keys read back as NaN, so a read of an unwritten row shows up).
    """
    if not config.is_sparse:
        raise ValueError("allocate_index_cache needs a sparse (V3.2) config with index_head_dim set")
    return _paged_cache("index", num_blocks, block_size, dtype, device, fill, config.index_head_dim,
                        lambda: fp8_index_row_bytes(config.index_head_dim))


def _paged_cache(kind: str, num_blocks: int, block_size: int, dtype: torch.dtype | str, device, fill: float,
                 width: int, fp8_width: Callable[[], int]) -> torch.Tensor:
    """``[num_blocks, block_size, width]`` of a float ``dtype`` filled with ``fill``, or with ``dtype="fp8"``
    ``uint8 [num_blocks, block_size, fp8_width()]`` of bytes 0 (``fill`` 0) or 0xFF (``fill`` NaN); the fp8
    width is asked for only then (it checks the dims the fp8 format needs)."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
    if isinstance(dtype, str):
        if dtype != "fp8":
            raise ValueError(f"dtype must be 'fp8' or a floating torch dtype, got {dtype!r}")
        if fill == 0:
            byte = 0
        elif fill != fill:  # NaN
            byte = FP8_POISON
        else:
            raise ValueError(f"fill of an fp8 {kind} cache must be 0 or NaN (a byte pattern, not a value), got {fill}")
        return torch.full((num_blocks, block_size, fp8_width()), byte, dtype=torch.uint8, device=device)
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype (bf16/fp16/fp32) or 'fp8', got {dtype}")
    return torch.full((num_blocks, block_size, width), fill, dtype=dtype, device=device)
