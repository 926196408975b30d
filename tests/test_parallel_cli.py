"""``torchrun --nproc-per-node 2 -m mla_compile.app.cli demo --tp 2 ...``: every rank's tokens equal HF eager."""

import os
import subprocess
import sys

import pytest

from tests.dist_helpers import free_port

pytest.importorskip("transformers")


@pytest.mark.parametrize("flags", [["--tp", "2", "--ep", "2"], ["--tp", "2", "--dp-attention", "2", "--model", "v3"],
                                   ["--tp", "2", "--dcp", "2", "--block-size", "4"]])
def test_torchrun_demo_two_processes(flags, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "mla_compile.app.cli", "demo", *flags, "--max-new-tokens", "3", "--prompts", "3", "--no-compile"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 of 2" in proc.stdout and "tokens match HF eager: yes" in proc.stdout
    assert proc.stdout.count("mla-compile demo:") == 1  # rank 0 reports, rank 1 stays quiet


def test_demo_rejects_a_layout_that_does_not_divide(capsys):
    from mla_compile.app.cli import main

    assert main(["demo", "--tp", "2", "--ep", "3"]) == 2
    assert "ep=3 does not divide tp=2" in capsys.readouterr().err
