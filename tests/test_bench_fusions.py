"""``benchmarks/bench_fusions.py`` on CPU: its dims are DeepSeek's (the config presets), a bad ``--dims`` fails
before any GPU work, and the decode + absorb_out section builds its inputs and rows (the ops by their references).
Its timings run on the GPU (BENCHMARKS.md)."""

from __future__ import annotations

import sys

import pytest
import torch

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


@pytest.mark.parametrize("batch,quick", [(1, False), (8, True)])
def test_decode_absorb_rows_run_on_cpu(batch, quick, monkeypatch):
    """The decode + absorb_out section's inputs and rows on the CPU, its timing harness replaced by one call of each
    row and every op by its reference: one sequence and a padding one with the ``ABSORB`` sweep (each setting given
    back after), or ``batch`` sequences; every row's output equals the unfused pair's, and ``ABSORB`` ends as it began."""
    from types import SimpleNamespace

    from mla_compile import ops
    from mla_compile.ops.triton import decode_absorb

    m = bench_module.load("bench_fusions")
    rows = []

    def attempt(group, label, fn, *args, **kwargs):
        rows.append((group, label, fn()))

    monkeypatch.setattr(m, "DEV", "cpu")
    monkeypatch.setattr(m, "bk", SimpleNamespace(_rotation=lambda nbytes, cap=32: 2, attempt=attempt))
    ref = {name: getattr(ops, name) for name in ("decode", "skinny_absorb_out", "decode_absorb_out")}
    monkeypatch.setattr(m, "ops", SimpleNamespace(**{
        name: (lambda f: lambda *a, backend=None, **k: f(*a, backend="reference", **k))(f) for name, f in ref.items()}))
    before = dict(decode_absorb.ABSORB)
    m.decode_absorb_case("v2-lite", m.DIMS["v2-lite"], quick, ctx=128, batch=batch)
    assert decode_absorb.ABSORB == before
    labels = [label for _, label, _ in rows]
    assert labels[:3] == ["decode gluon + skinny_absorb_out", "decode_absorb_out gluon (ours)",
                          "decode_absorb_out triton (ours)"]
    assert len(labels) == (3 if quick else 10) and all(f"B={batch}" in group for group, _, _ in rows)
    want = rows[0][2]
    for _, label, outs in rows:
        assert len(outs) == 2 and all(o.shape == (max(batch, 2), 16 * 128) for o in outs), label
        assert all(torch.equal(o, w) for o, w in zip(outs, want)), label
