"""``benchmarks/bench_fusions.py`` on CPU: its dims are DeepSeek's (the config presets), and a bad
``--dims`` fails before any GPU work. Its timings run on the GPU (BENCHMARKS.md)."""

from __future__ import annotations

import sys

import pytest

from tests import bench_module


def test_dims_are_deepseeks():
    from mla_compile.models.config import PRESETS

    m = bench_module.load("bench_fusions")
    for name, preset in (("v2-lite", PRESETS["deepseek-v2-lite"]), ("v3", PRESETS["deepseek-v3"])):
        d = m.DIMS[name]
        assert (d["H"], d["V"], d["hidden"]) == (preset.num_heads, preset.v_head_dim, preset.hidden_size)
        assert (d["E"], d["k"]) == (preset.n_routed_experts, preset.num_experts_per_tok)
        q_width = preset.q_lora_rank or preset.num_heads * preset.qk_head_dim
        assert d["first"] == (q_width, preset.kv_lora_rank + preset.qk_rope_head_dim)
        assert m.DC == preset.kv_lora_rank and m.DR == preset.qk_rope_head_dim


def test_bad_dims_fail_first(monkeypatch, tmp_path):
    m = bench_module.load("bench_fusions")
    monkeypatch.setattr(sys, "argv", ["bench_fusions.py", "--out", str(tmp_path), "--dims", "v9"])
    with pytest.raises(SystemExit):
        m.main()
    assert not any(tmp_path.iterdir())
