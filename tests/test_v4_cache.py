"""V4 cache arithmetic against hand-computed numbers and against what allocate_cache allocates."""

from __future__ import annotations

import pytest
import torch

from mla_compile.models.v4_cache import CSA, HCA, SLIDING, V4_FLASH, V4CacheLayout, V4Dims


def test_v4_flash_numbers():
    assert V4_FLASH.layer_types.count(SLIDING) == 2
    assert V4_FLASH.layer_types.count(CSA) == 21 and V4_FLASH.layer_types.count(HCA) == 20
    lay = V4CacheLayout(V4_FLASH)
    assert lay.bytes_per_token(CSA) == (512 + 128) * 2 / 4 == 320
    assert lay.bytes_per_token(HCA) == 512 * 2 / 128 == 8
    assert lay.bytes_per_token(SLIDING) == 0
    assert lay.model_bytes_per_token == 21 * 320 + 20 * 8  # 6880 bytes per token of context
    ctx = 1 << 20
    window = 128 * 512 * 2
    csa = window + 2 * 8 * 1024 * 2 + 2 * 8 * 256 * 2 + (ctx // 4) * 1280
    hca = window + 2 * 128 * 512 * 2 + (ctx // 128) * 1024
    assert lay.sequence_bytes(ctx) == 2 * window + 21 * csa + 20 * hca
    assert 6.7 < lay.sequence_bytes(ctx) / 2**30 < 6.8  # ~6.73 GiB for a 1M-token sequence in bf16
    assert "all layers" in lay.table()
    with pytest.raises(ValueError, match="cache_dtype"):
        V4CacheLayout(V4_FLASH, "fp8")


def test_layout_matches_allocated_tensors():
    pytest.importorskip("transformers")
    from mla_compile.models.model import patch
    from mla_compile.app.v4_toy import toy_v4_model

    model = patch(toy_v4_model(0))
    lay = V4CacheLayout(V4Dims.from_hf(model.config), "fp32")
    model.allocate_cache(num_blocks=4, block_size=4, num_entry_blocks=3, max_seqs=1)
    for attn in model.attn:
        t = attn.layer_type
        row = attn.kv_cache[0, 0].numel() * 4
        assert lay.fixed_bytes(SLIDING) == model.config.sliding_window * row
        state = sum(x[0].numel() * 4 for pair in attn.state.values() for x in pair)
        assert lay.fixed_bytes(t) - lay.fixed_bytes(SLIDING) == state
        if t != SLIDING:
            entry = attn.comp_cache[0, 0].numel() * 4
            entry += attn.index_cache[0, 0].numel() * 4 if attn.index_cache is not None else 0
            assert lay.entry_bytes(t) == entry


def test_cli_plan_v4_flash(capsys):
    from mla_compile.app.cli import main

    assert main(["plan", "--model", "v4-flash", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    assert "131,072 tokens" in out and "compressed_sparse_attention        21" in out
    lay = V4CacheLayout(V4_FLASH)
    assert f"{lay.sequence_bytes(131072) / 2**30:.3f}" in out.splitlines()[-1]
    assert main(["plan", "--model", "v4-flash", "--kv-cache", "fp8"]) == 2
