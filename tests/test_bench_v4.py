"""CPU smoke test of ``benchmarks/bench_v4_decode.py --device cpu --tiny``: eager and compiled rows run, the
CUDA-graph row says why it was skipped, and both files are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(transformers, "DeepseekV4ForCausalLM"), reason="no DeepseekV4ForCausalLM")
def test_bench_v4_decode_cpu_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_v4_decode.py"), "--device", "cpu", "--tiny",
           "--ctx", "40", "--batches", "2", "--iters", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_v4_decode.json").read_text())
    rows = {r["impl"]: r for r in data["rows"]}
    assert set(rows) == {"ours eager", "ours compiled", "ours graph"}
    assert rows["ours eager"]["ms"] > 0 and rows["ours compiled"]["ms"] > 0
    assert rows["ours graph"]["skipped"] == "needs CUDA"
    assert data["info"]["bytes_per_seq_1m"] > 0
    assert "per sequence at 1M tokens" in (tmp_path / "bench_v4_decode.txt").read_text()


def test_bench_v4_attention_cpu_smoke(tmp_path):
    """``--attention``: one row per layer kind, batch and context (the reference on CPU), lists as configured."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_v4_decode.py"), "--attention", "--device", "cpu", "--tiny",
           "--ctx", "40", "--batches", "2", "--iters", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_v4_attention.json").read_text())
    rows = {r["kind"]: r for r in data["rows"]}
    assert set(rows) == {"sliding", "CSA", "HCA"} and all(r["ms"] > 0 for r in rows.values())
    # tiny dims: window 8; CSA top-8 of 41 // 4 = 10 entries; HCA all 41 // 16 = 2 entries
    assert (rows["sliding"]["slots"], rows["CSA"]["slots"], rows["HCA"]["slots"]) == (8, 16, 10)
    assert "v4_attention per call" in (tmp_path / "bench_v4_attention.txt").read_text()
