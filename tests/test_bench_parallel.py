"""CPU smoke test of ``benchmarks/bench_parallel.py``: ``torchrun --nproc-per-node 2`` over gloo at tiny V3 dims, every
mode (TP, DP attention + EP, TP + DCP) at batches 1 and 3, eager; each (mode, batch) row has a finite positive time
and first-step logits equal to the world-1 unsharded model built from the same seeds (float32). Also the DCP cache
layout the benchmark fills and the launcher's flag stripping."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import bench_module

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_parallel.py"


def _module():
    return bench_module.load("bench_parallel")


def test_bench_parallel_two_cpu_ranks_every_mode_matches_world1(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONFAULTHANDLER"] = "1"  # a rank's native crash prints its threads' Python stacks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT),
           "--device", "cpu", "--tiny", "--batches", "1,3", "--modes", "tp,dp_ep,tp_dcp", "--out", str(tmp_path),
           "--timeout-s", "120"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-12000:]
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


def test_merge_tables_cuda_figures_of_every_world_size(tmp_path):
    """The GPU-only parts of the table (replay time, collectives' share, memory fit, the paper plan) from
    synthetic per-world results: the numbers follow from the figures given."""
    bp = _module()
    gib = 2 ** 30

    def run(world, mode, free_gib, per_tok):
        rows = [dict(mode=mode, world=world, ctx=4096, batch=b, rows_per_rank=b // (world if mode == "dp_ep" else 1),
                     parallel=f"tp={world}", ms=2.0 * b, tok_s=500.0, replay_ms=1.5 * b, comm_us=300.0 * b,
                     kernel_us=1400.0 * b, comm_share=0.2, step_extra_bytes=0, rel_err_vs_world1=1e-3)
                for b in (8, 64)]
        info = dict(world_size=world, fit_ctx=32768, fit_frac=0.5, layers=4, device="GPU", gpus_visible=8,
                    modes={mode: dict(free_bytes_after_weights=free_gib * gib, cache_bytes_per_token_per_rank=per_tok,
                                      weight_bytes_per_rank=10 * gib, build_s=1.0, compile_capture_s=2.0,
                                      compiled_graphs=1, graph_breaks={},
                                      paper_v3_fp8=dict(batch=136, weight_gib=89.4, cache_gib=36.0))})
        (tmp_path / f"bench_parallel_w{world}.json").write_text(__import__("json").dumps({"info": info, "rows": rows}))

    run(1, "tp", 64, 4608)  # 32768 tokens x 4608 B = 144 MiB a sequence; half of 64 GiB holds 227
    run(8, "dp_ep", 64, 4608)  # each of 8 ranks its own 227
    text = bp.merge(str(tmp_path))
    assert "tp W=1: 227 (cache only" in text and "dp_ep W=8: 1816 (cache only" in text
    assert "fp8 weights 136" in text and "20% comm" in text
    assert "collectives 2400 us of 11200 us kernel time" in text  # B=8: 300 and 1400 us per token row
    data = json.loads((tmp_path / "bench_parallel.json").read_text())
    assert [r["info"]["world_size"] for r in data["runs"]] == [1, 8]
