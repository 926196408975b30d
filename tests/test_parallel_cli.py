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


def test_torchrun_generate_v4_dp_attention_ep_two_processes(tmp_path):
    """``torchrun ... generate --tp 2 --dp-attention 2 --ep 2`` on a tiny DeepSeek-V4 checkpoint: each rank reads its
    experts, both serve the prompt in lockstep, rank 0 prints the text the single-process model generates; the same
    with the heads split (``--tp 2 --ep 2``); ``--tp 2`` alone is refused by name."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers has no DeepseekV4ForCausalLM")
    import torch

    from mla_compile.app.textgen import generate_text
    from mla_compile.app.v4_toy import toy_v4_model
    from tests.checkpoints import write_tokenizer

    root = tmp_path / "v4"
    toy_v4_model(23, vocab_size=304).save_pretrained(str(root))
    write_tokenizer(root)
    want = generate_text(root, "hello there", max_new_tokens=6, dtype=torch.float32, compile=False, stream=None,
                         block_size=4, temperature=1.0, seed=5).text
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "mla_compile.app.cli", "generate", "--model", str(root), "--prompt", "hello there", "--tp", "2",
           "--dp-attention", "2", "--ep", "2", "--no-compile", "--dtype", "float32", "--block-size", "4",
           "--max-new-tokens", "6", "--temperature", "1.0", "--seed", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout == want + "\n" and want  # rank 0's text alone: rank 1 prints nothing
    assert proc.stderr.count("tokens/s") == 1
    assert "rank 0 of 2: ParallelConfig(tp=2, dp_attention=2, dcp=1, ep=2)" in proc.stderr
    # the heads split over both ranks (--tp 2 --ep 2: one attention group): the same text
    i = cmd.index("--dp-attention")
    tp = cmd[:i] + cmd[i + 2:]
    proc = subprocess.run(tp, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout == want + "\n"
    assert "rank 0 of 2: ParallelConfig(tp=2, dp_attention=1, dcp=1, ep=2)" in proc.stderr
    # a layout V4 does not shard (experts split within): the ranks stop with the error named, no traceback. One rank
    # or both print it: once one exits, torchrun ends the other, which may not have reached the check yet (every
    # rank's refusal is tested in-process: tests/test_parallel_v4.py)
    bad = cmd[:i] + cmd[i + 4:]  # --tp 2 alone: no --dp-attention 2 --ep 2
    assert "--ep" not in bad and "--tp" in bad
    proc = subprocess.run(bad, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode != 0 and proc.stderr.count("generate: error: DeepSeek-V4 shards its routed experts") in (1, 2)
    assert "NotImplementedError" not in proc.stderr  # reported, not raised (torchrun then reports the exit codes)


def test_torchrun_generate_v3_fp8_tensor_parallel_two_processes(tmp_path):
    """``torchrun ... generate --tp 2 --ep 2`` on a tiny fp8 DeepSeek-V3 checkpoint: rank 0 prints the text the
    single-process model samples (seeded; the toy's greedy tokens fall outside the test tokenizer's text)."""
    import torch

    from mla_compile.app.textgen import generate_text
    from tests.checkpoints import write_checkpoint

    root = tmp_path / "v3"
    write_checkpoint(root, "v3", "fp8", seed=3)
    want = generate_text(root, "the quick brown fox", max_new_tokens=5, dtype=torch.float32, compile=False,
                         stream=None, temperature=1.0, seed=5).text
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "mla_compile.app.cli", "generate", "--model", str(root), "--prompt", "the quick brown fox", "--tp",
           "2", "--ep", "2", "--no-compile", "--dtype", "float32", "--max-new-tokens", "5", "--temperature", "1.0",
           "--seed", "5"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout == want + "\n" and want
    assert "rank 0 of 2: ParallelConfig(tp=2, dp_attention=1, dcp=1, ep=2)" in proc.stderr
