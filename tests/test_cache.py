"""Latent cache memory math (bytes per token, compression, capacity) and allocation."""

from __future__ import annotations

import pytest
import torch

from mla_compile import CacheLayout, MLAConfig, allocate_latent_cache, fp8_row_bytes, preset

V3 = preset("deepseek-v3")


def test_bf16_row_is_1152_bytes_per_layer():
    layout = CacheLayout(V3, "bf16")
    assert layout.bytes_per_token_per_layer == (512 + 64) * 2 == 1152
    assert layout.bytes_per_token == 1152 * 61


def test_fp8_row_is_656_bytes_per_layer():
    # 512 e4m3 latents + 4 fp32 scales (one per 128) + 64 bf16 rope values
    assert fp8_row_bytes() == 512 + 4 * 4 + 64 * 2 == 656
    assert CacheLayout(V3, "fp8").bytes_per_token_per_layer == 656
    assert CacheLayout(preset("deepseek-v2-lite"), "fp8").bytes_per_token == 656 * 27


def test_fp32_row():
    assert CacheLayout(V3, "fp32").bytes_per_token_per_layer == 576 * 4


def test_fp8_needs_whole_scale_groups():
    with pytest.raises(ValueError, match="kv_lora_rank must be a multiple of 128"):
        fp8_row_bytes(500, 64)
    with pytest.raises(ValueError, match="kv_lora_rank must be a multiple of 128"):
        CacheLayout(V3.replace(kv_lora_rank=96), "fp8").bytes_per_token_per_layer


def test_compression_ratio_against_hf_mha_cache():
    # HF keeps per-head keys of qk_head_dim (128 + 64) and values of v_head_dim (128), bf16.
    mha_per_layer = 128 * (192 + 128) * 2
    layout = CacheLayout(V3, "bf16")
    assert layout.mha_bytes_per_token == 61 * mha_per_layer
    assert layout.compression_ratio == pytest.approx(mha_per_layer / 1152, rel=1e-12)
    assert CacheLayout(V3, "fp8").compression_ratio == pytest.approx(mha_per_layer / 656, rel=1e-12)
    # Fewer heads, less to compress: V2-Lite has 16.
    lite = CacheLayout(preset("deepseek-v2-lite"), "bf16")
    assert lite.compression_ratio == pytest.approx(16 * 320 * 2 / 1152, rel=1e-12)


def test_capacity_and_blocks():
    layout = CacheLayout(V3, "bf16")
    per_token = 1152 * 61
    assert layout.capacity_tokens(0) == 0
    assert layout.capacity_tokens(per_token - 1) == 0
    assert layout.capacity_tokens(10 * per_token + 5) == 10
    gib80 = 80 * 2**30
    assert layout.capacity_tokens(gib80) == gib80 // per_token
    assert layout.num_blocks(gib80, 64) == (gib80 // per_token) // 64
    assert layout.num_blocks(63 * per_token, 64) == 0  # only whole blocks count
    assert layout.num_blocks(64 * per_token, 64) == 1
    assert CacheLayout(V3, "fp8").capacity_tokens(gib80) == gib80 // (656 * 61)


@pytest.mark.parametrize("call,match", [
    (lambda l: l.capacity_tokens(-1), "memory_bytes must be >= 0"),
    (lambda l: l.num_blocks(2**30, 0), "block_size must be positive"),
    (lambda l: l.num_blocks(-5, 16), "memory_bytes must be >= 0"),
])
def test_capacity_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(CacheLayout(V3))


def test_unknown_cache_dtype():
    with pytest.raises(ValueError, match="cache_dtype must be 'bf16', 'fp32' or 'fp8', got 'int4'"):
        CacheLayout(V3, "int4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_allocate_shape_dtype_fill(dtype):
    cache = allocate_latent_cache(3, 16, V3, dtype=dtype)
    assert cache.shape == (3, 16, 576) and cache.dtype == dtype and cache.device.type == "cpu"
    assert torch.equal(cache, torch.zeros_like(cache))
    poisoned = allocate_latent_cache(2, 64, V3, dtype=dtype, fill=float("nan"))
    assert poisoned.shape == (2, 64, 576) and torch.isnan(poisoned).all()


def test_allocate_default_is_bf16_and_uses_config_dims():
    small = MLAConfig(hidden_size=64, num_heads=2, kv_lora_rank=32, qk_rope_head_dim=16)
    cache = allocate_latent_cache(1, 1, small, fill=2.5)
    assert cache.shape == (1, 1, 48) and cache.dtype == torch.bfloat16 and bool((cache == 2.5).all())


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(num_blocks=0, block_size=16), ValueError, "num_blocks and block_size must be positive, got 0 and 16"),
    (dict(num_blocks=4, block_size=-1), ValueError, "num_blocks and block_size must be positive, got 4 and -1"),
    (dict(num_blocks=4, block_size=16, dtype=torch.int32), TypeError, "dtype must be a floating dtype"),
])
def test_allocate_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        allocate_latent_cache(config=V3, **kwargs)



def test_parallel_layout_reports_the_duplicated_latent():
    from mla_compile.parallel import ParallelConfig

    row = CacheLayout(V3, "bf16").bytes_per_token
    tp8 = CacheLayout(V3, "bf16", ParallelConfig(tp=8))
    assert tp8.copies == 8 and tp8.bytes_per_token_per_rank == row  # every TP rank holds the whole row
    dcp8 = CacheLayout(V3, "bf16", ParallelConfig(tp=8, dcp=8))
    assert dcp8.copies == 1 and dcp8.bytes_per_token_per_rank == row / 8
    dp8 = CacheLayout(V3, "fp8", ParallelConfig(tp=8, dp_attention=8))
    assert dp8.copies == 1 and dp8.bytes_per_token_per_rank == 656 * 61  # own requests, whole rows, no copy
    assert CacheLayout(V3).copies == 1
