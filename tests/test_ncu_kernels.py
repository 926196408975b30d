"""``benchmarks/ncu_kernels.py --summarize``: the short table read off an ncu ``--csv --page raw`` file (units
converted, the busiest tensor pipe, the largest stall reasons first, ncu's own log lines skipped)."""

from __future__ import annotations

import random

from tests import bench_module


def _module():
    return bench_module.load("ncu_kernels")


def test_summary_of_a_raw_csv(tmp_path):
    rng = random.Random(7)
    ms = rng.uniform(1, 9)
    dram, sm = rng.uniform(10, 90), rng.uniform(10, 90)
    t1, t2 = rng.uniform(1, 40), rng.uniform(41, 80)
    stalls = dict(long_scoreboard=rng.uniform(5, 6), barrier=rng.uniform(3, 4), wait=rng.uniform(1, 2),
                  math_pipe_throttle=rng.uniform(0, 0.5), selected=9.0)
    head = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
            "sm__throughput.avg.pct_of_peak_sustained_elapsed",
            "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",
            "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
            "sm__inst_executed_pipe_tensor_op_gmma.max.pct_of_peak_sustained_active"]
    head += [f"smsp__average_warps_issue_stalled_{k}_per_issue_active.ratio" for k in stalls]
    units = ["", "", "ms", "%", "%", "%", "%", "%"] + ["ratio"] * len(stalls)
    row = ["0", "prefill_gluon_kernel", f"{ms:.4f}", f"{dram:.2f}", f"{sm:.2f}", f"{t1:.2f}", f"{t2:.2f}", "99.9"]  # a .max column: not the average
    row += [f"{v:.3f}" for v in stalls.values()]
    text = "==PROF== Connected to process 1\n" + "\n".join(",".join(f'"{c}"' for c in r) for r in (head, units, row))
    path = tmp_path / "ncu.csv"
    path.write_text(text + "\n")
    out = _module().summarize(str(path)).splitlines()
    assert len(out) == 2 and out[1].startswith("prefill_gluon_kernel")
    fields = out[1].split()
    assert abs(float(fields[1]) - ms * 1e3) < 0.1  # ms -> us
    assert abs(float(fields[2]) - dram) < 0.1 and abs(float(fields[3]) - sm) < 0.1 and abs(float(fields[4]) - t2) < 0.1
    # the three largest stall reasons, largest first; "selected" is not a stall
    assert " ".join(fields[5:]).replace(",", "").split()[::2] == ["long_scoreboard", "barrier", "wait"]


def test_summary_without_kernel_rows(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== nothing profiled\n")
    assert _module().summarize(str(path)).startswith("no kernel rows")
