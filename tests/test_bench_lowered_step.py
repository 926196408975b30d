"""CPU smoke test of ``benchmarks/bench_lowered_step.py --device cpu --tiny``: both models compile and run
(uncaptured on CPU), their logits agree, B's fusion passes fire once per layer, and both files are written.
One run, with the fp8 latent cache (its quantizing write fusion and the absorb pair); the bf16 cache's write
fusion firing is ``tests/lowerings/test_passes.py``'s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_lowered_step_cpu_smoke(tmp_path):
    kv_cache = "fp8"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_lowered_step.py"), "--device", "cpu", "--tiny",
           "--iters", "2", "--kv-cache", kv_cache, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_lowered_step.json").read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 4]
    for r in data["rows"]:
        assert r["a_ms"] > 0 and r["b_ms"] > 0
        assert r["logits_rel_err"] < 1e-4  # float32, the same weights, context and reference kernels
    write = "fuse_kv_write_fp8" if kv_cache == "fp8" else "fuse_kv_write"
    assert data["info"]["passes_fired"] == {write: 2, "fuse_absorb_q": 2, "fuse_absorb_out": 2}  # 2 layers
    text = (tmp_path / "bench_lowered_step.txt").read_text()
    assert f"{kv_cache} latent cache" in text and text.strip().splitlines()[-1] in proc.stdout
