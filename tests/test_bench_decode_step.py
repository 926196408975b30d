"""CPU smoke test of ``benchmarks/bench_decode_step.py --device cpu --tiny [--kind v3]``: the eager rows of HF
and ours run, agree on the first step's logits, the GPU-only rows say why they were skipped, and both files are
written. ``--kind v3`` is the V3 architecture at tiny dims (q_lora, sigmoid routing with the correction bias in
groups, 1 shared expert): ours runs it through MLAMoE's group-limited top-k and the q_lora attention path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_bench_decode_step_cpu_smoke(tmp_path, kind):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode_step.py"), "--device", "cpu", "--tiny",
           "--kind", kind, "--out", str(tmp_path)]
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
    args = info["args"]
    assert args["kind"] == kind
    if kind == "v3":  # the V3 features the run must exercise
        assert (args["q_lora_rank"], args["experts"], args["topk"], args["n_group"], args["topk_group"],
                args["shared_experts"]) == (128, 16, 4, 4, 2, 1)
    else:
        assert (args["q_lora_rank"], args["experts"], args["shared_experts"]) == (0, 8, 2)
    assert info["hf_cache_bytes_per_token"] == info["ours_cache_bytes_per_token"] == 2 * 576 * 4
    assert info["metadata"]["host_us"] > 0
    text = (tmp_path / "bench_decode_step.txt").read_text()
    assert "HF eager (DynamicCache)" in text and "Goals" in text
    assert f"model: {kind} (tiny): 2 layers (1 dense + 1 MoE), hidden 256, 4 heads, " in text
    assert ("q_lora 128" in text and "sigmoid routing + bias, 4 groups top-2" in text) == (kind == "v3")
    assert text.strip().splitlines()[-1] in proc.stdout


@pytest.mark.slow
def test_bench_decode_step_compiled_row_reports_its_compile_and_takes_moe_config(tmp_path):
    """``--compile --only ours`` on the CPU: the compiled row runs, agrees with eager, and its first call's compile is
    broken down (Dynamo's tracing and the backend inside torch.compile's time, a cache miss of a fresh cache dir,
    the Dynamo cache's miss with ``--dynamo-cache``); ``--moe-config`` and ``--grouped-config`` are reported, and an
    unknown key of either is refused before anything runs."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode_step.py"), "--device", "cpu", "--tiny", "--compile",
           "--only", "ours", "--batches", "1", "--moe-config", "dot_n=16,down_pre_unused=1", "--dynamo-cache",
           "--grouped-config", "down_k=128", "--out", str(tmp_path)]
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--moe-config: unknown key 'down_pre_unused'" in bad.stderr + bad.stdout
    cmd[cmd.index("dot_n=16,down_pre_unused=1")] = "dot_n=16"
    cmd[cmd.index("down_k=128")] = "down_k=128,gate_up_q=2"
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--grouped-config: unknown key 'gate_up_q'" in bad.stderr + bad.stdout
    cmd[cmd.index("down_k=128,gate_up_q=2")] = "down_k=128"
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_decode_step.json").read_text())
    info = data["info"]
    row = next(r for r in data["rows"] if r["impl"] == "ours compiled")
    assert "error" not in row and row["rel_err_vs_ours_eager"] < 1e-4, row
    ph = info["ours_compile_phases"]
    assert 0 < ph["dynamo"] < ph["compile"] and 0 < ph["aot_inductor"] < ph["compile"] <= info["ours_compile_s"]
    assert ph["fx_cache_miss"] >= 1 and ph["fx_cache_hit"] == 0  # the benchmark's fresh cache dir
    assert info["dynamo_cache"] is True and ph["dynamo_cache_hit"] == 0 and ph["graphs_traced"] >= 1
    text = (tmp_path / "bench_decode_step.txt").read_text()
    assert "ours' first compiled call: torch.compile" in text and "MoE kernels dot_n=16,down_k=128" in text
    assert "Dynamo cache 0 / " in text


def test_goals_judge_issue_28s_targets_from_the_rows():
    """``goals`` judges the full-depth step's targets from given rows (no timing here): 3x HF compiled at each batch,
    B=1 <= 2.0 ms, B=256 <= 16 ms, compile <= 30 s, capture <= 10 s; a missing row says so."""
    from types import SimpleNamespace

    from tests import bench_module

    m = bench_module.load("bench_decode_step")
    rows = [("ours graph", 1, 2.1), ("hf compiled", 1, 6.5), ("ours graph", 256, 15.9), ("hf compiled", 256, 40.0),
            ("ours graph", 64, 11.0)]
    m.ROWS[:] = [dict(impl=i, batch=b, ctx=4096, ms=ms) for i, b, ms in rows]
    m.INFO.update(ours_compile_s=31.5, ours_capture_s=0.7)
    text = "\n".join(m.goals(SimpleNamespace(ctx_list=[4096], batch_list=[1, 64, 256], warm_cache=False)))
    assert "over HF compiled (StaticCache) at B=1: 3.10x PASS" in text
    assert "over HF compiled (StaticCache) at B=256: 2.52x MISSED" in text
    assert "over HF compiled (StaticCache) at B=64: n/a (row missing)" in text
    assert "whole step <= 2.0 ms at B=1: 2.100 ms MISSED" in text
    assert "whole step <= 16.0 ms at B=256: 15.900 ms PASS" in text
    assert "compile <= 30 s (cold): 31.5 s (fresh caches) MISSED" in text
    assert "capture of every size <= 10 s: 0.7 s PASS" in text


def test_critical_path_charges_each_kernel_what_its_end_adds(tmp_path):
    """``critical_path`` over a Chrome trace of two equal replays: a kernel adds how far its end passes the latest end
    before it (one running inside another's time adds 0), the increments add up to the span, the mean is taken
    over the replays, and events that do not split into the replays are refused by name."""
    from tests import bench_module

    m = bench_module.load("bench_decode_step")
    one = [("a", 0.0, 10.0), ("b", 8.0, 7.0), ("c", 9.0, 3.0), ("d", 15.0, 5.0), ("a", 21.0, 2.0)]
    events = [dict(ph="X", cat="kernel", name=n, ts=t + base, dur=d * scale)
              for base, scale in ((1000.0, 1.0), (5000.0, 2.0)) for n, t, d in one]
    span, per_name = m.critical_path(events, 2)
    # replay 1, ends a 10, b 15, c 12, d 20, a 23: a 10 + 3, b 5, c 0, d 5 (span 23); replay 2 (durations
    # doubled), ends a 20, b 22, c 15, d 25, a 25: a 20 + 0 (ends with d), b 2, c 0, d 3 (span 25)
    assert span == (23 + 25) / 2
    assert per_name["a"] == ((13 + 20) / 2, 2.0) and per_name["b"] == ((5 + 2) / 2, 1.0)
    assert per_name["c"] == (0.0, 1.0) and per_name["d"] == ((5 + 3) / 2, 1.0)
    assert sum(us for us, _ in per_name.values()) == span
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events + [dict(ph="X", cat="cpu_op", name="host", ts=0, dur=1)]}))
    text = m.critical_path_text(str(trace), 2, 2)
    assert text.splitlines()[0].startswith("critical path of one replay: 24.0 us (5 GPU ops; 12.00 us a layer")
    assert text.splitlines()[2].split() == ["16.5", "8.25", "68.8%", "2", "a"]
    with pytest.raises(ValueError, match="do not split into 3 equal replays"):
        m.critical_path(events, 3)
