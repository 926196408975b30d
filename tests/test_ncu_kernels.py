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


def test_source_summary_ranks_instructions_by_stall_samples(tmp_path):
    """``--source``: the instructions with the most warp stall samples first, each with its share of all samples
    and its largest stall reasons, then the samples summed per opcode (a predicate is not the opcode)."""
    rng = random.Random(11)
    rows = [("0x0010", "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24", 0),
            ("0x0020", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR40+0x387f0], R154", 0),
            ("0x0030", "@!P1 LDG.E R23, desc[UR42][R22.64]", 0),
            ("0x0040", "MUFU.EX2 R26, R26", 0)]
    samples = [rng.randint(10, 99) for _ in rows]
    samples[2] = 1000 + rng.randint(0, 99)  # the LDG stalls most
    long_sb = [rng.randint(0, 9) for _ in rows]
    long_sb[2] = samples[2] - 5
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
            "stall_long_sb", "stall_barrier"]
    # ncu's file: its log lines, the kernel's name line, then the header and a row per instruction
    lines = ["==PROF== report", '"Kernel Name","decode_gluon_seesaw_kernel",', ",".join(f'"{c}"' for c in head)]
    for (addr, sass, _), n, lsb in zip(rows, samples, long_sb):
        lines.append(",".join(f'"{c}"' for c in (addr, sass, n, n // 2, lsb, n - lsb)))
    path = tmp_path / "src.csv"
    path.write_text("\n".join(lines) + "\n")
    out = _module().source_summary(str(path)).splitlines()
    assert out[1].split()[0] == "0x0030" and "LDG.E" in out[1]
    share = float(out[1].split()[1].rstrip("%"))
    assert abs(share - 100 * samples[2] / sum(samples)) < 0.1
    assert "stall_long_sb" in out[1].split("%", 1)[1].split("LDG")[0]  # its largest reason named
    assert [ln.split()[0] for ln in out[1:5]] == [rows[i][0] for i in sorted(range(4), key=lambda i: -samples[i])]
    per_op = out[-1]
    assert per_op.startswith("samples per opcode: LDG.E ")  # "@!P1" is the predicate, not the opcode


def test_moe_cases_make_valid_calls():
    """The ``fp4moe`` / ``moe256`` cases' operands pass their ops' checks: small dims through the reference backends
    on the CPU give ``[T, H]`` finite outputs that depend on the routing."""
    import torch

    mod = _module()
    fp4 = mod._fp4_experts(3, "cpu", E=8, H=256, I=128, k=2, backend="reference")()
    bf16 = mod._bf16_experts(5, "cpu", E=8, H=64, I=32, k=2, shared=2, backend="reference")()
    assert fp4.shape == (3, 256) and bf16.shape == (5, 64)
    assert torch.isfinite(fp4).all() and torch.isfinite(bf16).all() and fp4.abs().sum() > 0 and bf16.abs().sum() > 0
    weights, ids = mod._routing(5, 8, 2, "cpu", 0)
    assert ids.shape == (5, 2) and (ids[:, 0] != ids[:, 1]).all() and weights.dtype == torch.float32
