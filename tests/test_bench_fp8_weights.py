"""CPU smoke test of ``benchmarks/bench_fp8_weights.py --tiny --device cpu``: every linear shape and backend row
is measured with its error against float64, both checkpoints are written and loaded, the fp8 model holds fewer
weight bytes than the bf16 one and computes the same logits, the CUDA-graph rows say why they were skipped."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("bf16 torch.mm", "fp8 triton", "fp8 triton act_quant", "fp8 scaled-mm act_quant", "fp8 reference",
         "fp8 autotune", "fp8 autotune act_quant")
PROJS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "expert gate_up", "expert down")


@pytest.mark.slow
def test_bench_fp8_weights_cpu_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_fp8_weights.py"), "--tiny", "--device", "cpu",
           "--ms", "1,16", "--batches", "1,3", "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "out" / "bench_fp8_weights.json").read_text())
    assert set(data) == {"info", "ceilings", "linear", "decode", "skipped"}
    assert all(math.isfinite(data["ceilings"][k]) and data["ceilings"][k] > 0 for k in ("copy_gbs", "mm_tflops"))

    rows = {(r["proj"], r["M"], r["impl"]): r for r in data["linear"]}
    assert set(rows) == {(p, m, i) for p in PROJS for m in (1, 16) for i in IMPLS}
    for key, r in rows.items():
        assert "error" not in r, (key, r)
        for field in ("us", "eager_us", "gbs", "tflops", "err", "err_real"):
            assert math.isfinite(r[field]) and r[field] >= 0, (key, field, r)
        assert r["us"] > 0 and r["gbs"] > 0
        # float32 math, bf16 output: within a few bf16 roundings of the float64 product of the row's contract
        assert r["err"] < 1e-2, (key, r)
        if r["impl"].startswith("fp8 autotune"):  # CPU: no candidates, the compiled call runs the static default
            assert r["autotune_winner"] == "no autotune record", r
        if "act_quant" in r["impl"]:  # the activation's e4m3 rounding shows against the unrounded product
            assert r["err_real"] > 3 * r["err"], (key, r)
        else:
            assert r["err_real"] == r["err"]

    models = data["decode"]["models"]
    assert set(models) == {"fp8", "bf16"}
    fp8, bf16 = models["fp8"], models["bf16"]
    assert fp8["fp8_modules"] == ["FP8BlockLinear", "FP8Experts"] and bf16["fp8_modules"] == []
    assert 0 < fp8["total_bytes"] < bf16["total_bytes"]
    assert 0 < fp8["routed_expert_bytes"] < bf16["routed_expert_bytes"]
    for m in (fp8, bf16):  # 16 routed experts in the tiny slice: the projection scales them by 16
        assert m["projected_256_experts_bytes"] == m["total_bytes"] + 15 * m["routed_expert_bytes"]
    ck = data["info"]["checkpoint"]
    assert 0 < ck["fp8_bytes"] < ck["bf16_bytes"]
    cells = {(r["weights"], r["impl"], r["batch"]): r for r in data["decode"]["rows"]}
    assert set(cells) == {(w, i, b) for w in ("fp8", "bf16") for i in ("eager", "graph") for b in (1, 3)}
    for b in (1, 3):
        for w in ("fp8", "bf16"):
            r = cells[(w, "eager", b)]
            assert "error" not in r and math.isfinite(r["ms"]) and r["ms"] > 0 and r["tok_s"] > 0, r
            assert cells[(w, "graph", b)]["skipped"] == "needs CUDA"
        # float32 on CPU, and the bf16 checkpoint holds the fp8 weights exactly: the same logits
        assert cells[("bf16", "eager", b)]["logits_rel_err_fp8_vs_bf16"] < 1e-4
    assert not list((tmp_path / "ckpt").iterdir())  # the temporary checkpoints are removed
    text = (tmp_path / "out" / "bench_fp8_weights.txt").read_text()
    assert "== short table" in text and "expert gate_up" in text
    assert text.strip().splitlines()[-1] in proc.stdout


@pytest.mark.cuda
@pytest.mark.slow
def test_bench_fp8_weights_cuda_tiny(tmp_path):
    """Toy dims on the GPU: every backend (triton, scaled-mm) times through CUDA graphs, and both models decode
    eagerly and through compiled + captured steps with the same logits."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_fp8_weights.py"), "--tiny", "--device", "cuda",
           "--out", str(tmp_path / "out"), "--ckpt-dir", str(tmp_path / "ckpt"), "--budget-s", "600"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "out" / "bench_fp8_weights.json").read_text())
    assert not data["skipped"], data["skipped"]
    for r in data["linear"]:
        assert "error" not in r and r["us"] > 0 and r["err"] < 1e-2, r
    assert len(data["linear"]) == len(PROJS) * 2 * len(IMPLS)
    for r in data["linear"]:  # the compiled autotune rows name the candidate the lowering emitted
        if r["impl"].startswith("fp8 autotune"):
            assert r["autotune_winner"].endswith(("(triton)", "(scaled-mm)")), r
    assert data["decode"]["models"]["fp8"]["fp8_linear_backend"] == "triton"
    rows = data["decode"]["rows"]
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        assert "error" not in r and "skipped" not in r and r["ms"] > 0, r
        if r["weights"] == "bf16":  # the same weights: bf16 roundings (and a near-tie routing flip) at most; a
            assert r["logits_rel_err_fp8_vs_bf16"] < 0.25, r  # wrong weight or layout gives about 1
