"""The sharded model over NCCL on GPUs, captured in CUDA graphs: world size 1 (real single-rank process groups)
on one GPU, and TP=2 x EP=2 where two GPUs are present."""

import pytest
import torch

from tests import parallel_workers as w
from tests.dist_helpers import run_ranks

pytest.importorskip("transformers")


def _check(results):
    for r in results:
        assert r["backend"] == "nccl" and r["real_group"]
        assert r["eager_err"] < 1e-4, r  # fp32 on the GPU: the sharded (NCCL) and the unsharded model agree
        assert r["graph_breaks"] == {}
        assert r["got_steps"] == r["steps"] and r["steps"] > 40
        assert r["replays"] > 20
        assert r["same_tokens"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_world1_sharded_model_matches_and_replays_in_cuda_graphs():
    _check(run_ranks(w.cuda_graphs, 1, dict(tp=1), timeout=480, fresh=True))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (a multi-GPU machine)")
def test_nccl_tp2_ep2_on_two_gpus_matches_and_replays_in_cuda_graphs():
    _check(run_ranks(w.cuda_graphs, 2, dict(tp=2, ep=2), timeout=480, fresh=True))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("world,pconf", [(1, dict(tp=1)), (2, dict(tp=2, ep=2))])
def test_nccl_quantized_checkpoint_sharded_load_matches_single_process(tmp_path, fmt, world, pconf):
    """fp8 / fp4-expert checkpoints through from_pretrained(parallel=) on GPUs: the fp8 / fp4 ops' CUDA kernels
    (grouped experts) over this rank's shards, eager and compiled fullgraph, against the single-process load."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    from tests.checkpoints import write_checkpoint

    write_checkpoint(tmp_path, "v3", fmt, seed=4)
    for r in run_ranks(w.quantized_checkpoint_on_device, world, str(tmp_path), pconf, timeout=480, fresh=True):
        assert r["backend"] == "nccl" and r["real_group"] and r["device"].startswith("cuda"), r
        assert r["err"] < 1e-4 and r["compiled_err"] < 1e-4, r
        assert r["same_tokens"] and r["graph_breaks"] == {}, r
