"""CPU smoke test of ``benchmarks/bench_parallel.py``: ``torchrun --nproc-per-node 2`` over gloo at tiny V3 dims, every
mode (TP, DP attention + EP, TP + DCP) at batches 1 and 3, eager; each (mode, batch) row has a finite positive time
and first-step logits equal to the world-1 unsharded model built from the same seeds (float32). Also the DCP cache
layout the benchmark fills and the launcher's flag stripping."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_parallel.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_parallel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_parallel_two_cpu_ranks_every_mode_matches_world1(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT),
           "--device", "cpu", "--tiny", "--batches", "1,3", "--modes", "tp,dp_ep,tp_dcp", "--out", str(tmp_path),
           "--timeout-s", "120"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_parallel.json").read_text())
    assert len(data["runs"]) == 1
    info, rows = data["runs"][0]["info"], data["runs"][0]["rows"]
    assert info["world_size"] == 2 and info["step"] == "eager"
    assert info["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    got = {(r["mode"], r["batch"]): r for r in rows}
    assert set(got) == {(m, b) for m in ("tp", "dp_ep", "tp_dcp") for b in (1, 3)}
    for (mode, b), r in got.items():
        assert "error" not in r and "skipped" not in r, r
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["tok_s"] > 0, r
        assert r["rel_err_vs_world1"] < 1e-4, r  # float32: the sharded step computes the unsharded one
        assert r["rows_per_rank"] == ((b + 1) // 2 if mode == "dp_ep" else b)
    assert got[("dp_ep", 1)]["parallel"] == "tp=2 dp_attention=2 ep=2"
    assert got[("tp_dcp", 3)]["parallel"] == "tp=2 dcp=2"
    text = (tmp_path / "bench_parallel.txt").read_text()
    assert "dp_ep (tp=2 dp_attention=2 ep=2)" in text and "rel. error" in text


def test_dcp_part_puts_each_rank_s_tokens_at_their_local_positions():
    bp = _module()
    bs, nb, n_seq, d, dcp = 4, 5, 3, 6, 2
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(n_seq * nb, bs, d, generator=gen)
    tables = torch.randperm(n_seq * nb, generator=gen).view(n_seq, nb)
    for rank in range(dcp):
        part = bp.dcp_part(latents, tables, dcp, rank)
        for i in range(n_seq):
            whole = latents[tables[i]].reshape(-1, d)
            local = part[tables[i]].reshape(-1, d)
            for t in range(nb * bs):  # token t of sequence i: on rank (t // bs) % dcp, at its local position
                if (t // bs) % dcp == rank:
                    lp = (t // (bs * dcp)) * bs + t % bs
                    assert torch.equal(local[lp], whole[t]), (rank, i, t)


def test_launcher_strips_the_flags_it_sets_per_world_size():
    bp = _module()
    argv = ["--out", "o", "--tp", "1,2", "--budget-s=500", "--modes", "tp,dp_ep", "--batches", "1,64"]
    assert bp.strip_flags(argv, ("--tp", "--budget-s", "--modes")) == ["--out", "o", "--batches", "1,64"]
