"""CPU smoke test of ``benchmarks/bench_sink_window.py --device cpu --tiny``: dense and sink + window rows, eager
and compiled, both files written, and the windowed cache holds only the sink and window blocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_sink_window_cpu_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_sink_window.py"), "--device", "cpu", "--tiny",
           "--ctx", "200", "--batches", "2", "--iters", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_sink_window.json").read_text())
    rows = {(r["kind"], r["impl"]): r for r in data["rows"]}
    assert set(rows) == {(k, i) for k in ("dense", "sink_window") for i in ("eager", "compiled")}
    assert all(r["ms"] > 0 and "error" not in r for r in rows.values())
    # ctx 200, block 16: dense holds 13 blocks; sink 4 + window 32 read block 0 and positions 169..200 (10..12)
    assert rows["dense", "eager"]["blocks_per_seq"] == 13 and rows["sink_window", "eager"]["blocks_per_seq"] == 4
    assert "MiB/seq" in (tmp_path / "bench_sink_window.txt").read_text()
