"""CPU smoke test of ``benchmarks/bench_decode_step.py --device cpu --tiny``: the eager rows of HF and ours
run, agree on the first step's logits, the GPU-only rows say why they were skipped, and both files are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_decode_step_cpu_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode_step.py"), "--device", "cpu", "--tiny",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_decode_step.json").read_text())
    rows = {(r["impl"], r["batch"]): r for r in data["rows"]}
    assert set(rows) == {(impl, b) for impl in ("hf eager", "hf compiled", "ours eager", "ours compiled", "ours graph")
                         for b in (1, 4)}
    for impl in ("hf eager", "ours eager"):
        for b in (1, 4):
            r = rows[(impl, b)]
            assert "error" not in r, r
            assert r["ms"] > 0 and r["tok_s"] > 0 and len(r["times_ms"]) == 3
    for b in (1, 4):  # float32, same weights and context latents: HF and ours compute the same step
        assert rows[("hf eager", b)]["rel_err_vs_ours_eager"] < 1e-4
        assert rows[("ours graph", b)]["skipped"] == "cpu"
        assert rows[("hf compiled", b)]["skipped"] == "cpu"
        assert rows[("ours compiled", b)]["skipped"] == "no --compile"
    info = data["info"]
    assert info["hf_cache_bytes_per_token"] == info["ours_cache_bytes_per_token"] == 2 * 576 * 4
    assert info["metadata"]["host_us"] > 0
    text = (tmp_path / "bench_decode_step.txt").read_text()
    assert "HF eager (DynamicCache)" in text and "Goals" in text
    assert text.strip().splitlines()[-1] in proc.stdout
