"""CPU tests of ``benchmarks/bench_v4_decode.py --device cpu --tiny``: our eager and compiled rows run, the
CUDA-graph row says why it was skipped, both files are written; HF's rows decode the same step over the
context copied into HF's cache (float32 logits equal to ours), and the budget guard skips an HF row with
its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
HAS_V4 = hasattr(transformers, "DeepseekV4ForCausalLM")


def run_decode(out: Path, *args: str) -> dict:
    """Run the decode benchmark at tiny dims on CPU (one timed iteration); its JSON."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_v4_decode.py"), "--device", "cpu", "--tiny",
           "--iters", "1", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "bench_v4_decode.json").read_text())


@pytest.mark.slow
@pytest.mark.skipif(not HAS_V4, reason="no DeepseekV4ForCausalLM")
def test_bench_v4_decode_cpu_smoke(tmp_path):
    """Every row (the default ``--impls``) at ctx 47 (a CSA and an HCA window close at the step): ours eager and
    compiled run, the graph row says why not; 'hf eager' and 'hf compiled' (torch.compile(hf), aot_eager on
    CPU) give ours' float32 logits, no graph is compiled while the same step repeats, the real consecutive
    steps report theirs; the closing table compares ours compiled with HF compiled."""
    data = run_decode(tmp_path, "--ctx", "47", "--batches", "2", "--hf-next-steps", "2")
    rows = {r["impl"]: r for r in data["rows"]}
    assert set(rows) == {"ours eager", "ours compiled", "ours graph", "hf eager", "hf compiled"}
    assert rows["ours eager"]["ms"] > 0 and rows["ours compiled"]["ms"] > 0
    assert rows["ours graph"]["skipped"] == "needs CUDA"
    for impl in ("hf eager", "hf compiled"):
        assert rows[impl]["ms"] > 0 and rows[impl]["rel_err_vs_ours_eager"] < 1e-5, rows[impl]
    hc = rows["hf compiled"]
    assert hc["graphs_first_call"] >= 1 and hc["graphs_while_timing"] == 0, hc
    assert len(hc["next_steps_s"]) == len(hc["next_steps_graphs"]) == 2
    assert data["info"]["bytes_per_seq_1m"] > 0
    text = (tmp_path / "bench_v4_decode.txt").read_text()
    assert "per sequence at 1M tokens" in text
    last = text.splitlines()[-1].split()  # B, ctx, ours compiled, ours graph, HF eager, HF compiled, speedups
    assert last[:2] == ["2", "47"] and last[3] == "-" and last[-3].endswith("x") and last[-1].endswith("x"), last


@pytest.mark.skipif(not HAS_V4, reason="no DeepseekV4ForCausalLM")
@pytest.mark.parametrize("weights", ["fp8", "fp4"])
def test_bench_v4_decode_release_weight_formats(tmp_path, weights):
    """``--weights fp8|fp4``: the projections and experts in V4-Flash's release formats (random codes); our eager and
    compiled rows run with finite logits; HF's rows are refused with them."""
    data = run_decode(tmp_path, "--ctx", "43", "--batches", "2", "--impls", "ours eager,ours compiled",
                      "--weights", weights)
    rows = {r["impl"]: r for r in data["rows"]}
    assert rows["ours eager"]["ms"] > 0 and rows["ours eager"]["finite"] and rows["ours compiled"]["ms"] > 0, rows
    assert data["info"]["weights"] == weights and data["info"]["quantized_bytes"] > 0
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_v4_decode.py"), "--device", "cpu", "--tiny", "--out",
           str(tmp_path / "hf"), "--weights", weights, "--impls", "hf eager"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "HF's model runs float weights only" in proc.stderr


@pytest.mark.skipif(not HAS_V4, reason="no DeepseekV4ForCausalLM")
def test_bench_v4_decode_regional_compile_flag(tmp_path):
    """``--regional-compile`` patches the model with ``regional_compile=True``: its compiled row runs (one graph for
    the step) and the run's arguments record the flag."""
    data = run_decode(tmp_path, "--ctx", "43", "--batches", "2", "--impls", "ours eager,ours compiled",
                      "--regional-compile")
    rows = {r["impl"]: r for r in data["rows"]}
    assert rows["ours eager"]["ms"] > 0 and rows["ours compiled"]["ms"] > 0, rows
    assert data["info"]["args"]["regional_compile"] is True


# Tiny dims: window 8, CSA rate 4 (top-8 of ctx / 4 entries: sparse from ctx 36), HCA rate 16. ctx 40: no window
# closes at the step; 43: a CSA window closes (its overlap state is read); 47: CSA and HCA windows close.
@pytest.mark.skipif(not HAS_V4, reason="no DeepseekV4ForCausalLM")
def test_bench_v4_decode_hf_eager_same_logits_and_budget_guard(tmp_path):
    """'hf eager' decodes the step ours does, over the context copied into HF's DynamicCache: float32 logits
    equal to ours eager; 'hf compiled' is skipped by the budget guard (its first call guessed at 1e6 s)."""
    data = run_decode(tmp_path, "--ctx", "40,43,47", "--batches", "3", "--impls", "ours eager,hf eager,hf compiled",
                      "--hf-compile-guess-s", "1e6", "--budget-s", "1e5")
    hf = [r for r in data["rows"] if r["impl"] == "hf eager"]
    assert sorted((r["ctx"], r["batch"]) for r in hf) == [(40, 3), (43, 3), (47, 3)]
    for r in hf:
        assert r["ms"] > 0 and r["rel_err_vs_ours_eager"] < 1e-5, r
        assert r["rel_err_row_median"] <= r["rel_err_row_max"] < 1e-5, r  # every row, not only the batch's norm
    skipped = [r for r in data["rows"] if r["impl"] == "hf compiled"]
    assert len(skipped) == 3 and all(r["skipped"].startswith("time budget: ~1000000 s needed") for r in skipped)
    text = (tmp_path / "bench_v4_decode.txt").read_text()
    assert "HF compiled" in text and "transformers" in text and "row median" in text


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


def test_row_errors_are_per_sequence():
    """``row_errors``: the median and max over rows of ||out_b - ref_b|| / ||ref_b||, against float64; one bad
    row moves the max, not the median."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_v4_decode import row_errors

    import torch

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 300, generator=gen, dtype=torch.float64)
    out = ref + 1e-3 * torch.randn(5, 300, generator=gen, dtype=torch.float64) * torch.arange(1, 6).view(5, 1)
    out[3] += ref[3]  # one row off by 100 %
    want = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).sort().values
    got = row_errors(out.float(), ref.float())
    assert got["rel_err_row_median"] == pytest.approx(float(want[2]), rel=1e-4)
    assert got["rel_err_row_max"] == pytest.approx(float(want[-1]), rel=1e-4) and want[-1] > 0.9


@pytest.mark.skipif(not HAS_V4, reason="no DeepseekV4ForCausalLM")
@pytest.mark.parametrize("mode", ["tp", "dp"])
def test_bench_v4_decode_parallel_under_torchrun(tmp_path, mode):
    """``torchrun --nproc-per-node 2 ... --parallel tp|dp`` on CPU (gloo): the slice sharded over 2 ranks, each row the
    slowest rank's time with every rank's in ``ms_ranks``; under dp a global batch the ranks do not split is skipped
    with the reason; rank 0 alone writes the files."""
    import os

    from tests.dist_helpers import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "benchmarks" / "bench_v4_decode.py"), "--device", "cpu", "--tiny", "--iters", "1",
           "--out", str(tmp_path), "--parallel", mode, "--impls", "ours eager", "--ctx", "47", "--batches", "2,3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_v4_decode.json").read_text())
    assert data["info"]["parallel"] == mode and data["info"]["world_size"] == 2
    rows = {r["batch"]: r for r in data["rows"]}
    assert len(rows[2]["ms_ranks"]) == 2 and rows[2]["ms"] == max(rows[2]["ms_ranks"]) > 0
    if mode == "dp":
        assert rows[3]["skipped"] == "batch 3 does not split over 2 data-parallel ranks"
    else:
        assert rows[3]["ms"] == max(rows[3]["ms_ranks"]) > 0
    assert proc.stdout.count("V4 decode step (") == 1  # rank 0's table only
