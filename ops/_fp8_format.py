"""Facts of the DeepSeek fp8 latent format (656 bytes per token for 512/64), shared by ops and core."""

from __future__ import annotations

FP8_GROUP = 128  # latent values per fp32 scale in the DeepSeek fp8 format


def fp8_row_bytes(kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
    """Bytes of one token in the DeepSeek fp8 latent format (656 for 512/64)."""
    if kv_lora_rank % FP8_GROUP:
        raise ValueError(f"kv_lora_rank must be a multiple of {FP8_GROUP} for the fp8 format, got {kv_lora_rank}")
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_GROUP) + 2 * rope_dim


FP8_INDEX_SCALE_BYTES = 4  # one float32 scale per index key (token)


def fp8_index_row_bytes(index_head_dim: int = 128) -> int:
    """Bytes of one token's index key in the fp8 index format: d e4m3 values + one float32 scale (132 for 128)."""
    if index_head_dim <= 0:
        raise ValueError(f"index_head_dim must be positive, got {index_head_dim}")
    return index_head_dim + FP8_INDEX_SCALE_BYTES
