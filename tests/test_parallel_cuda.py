"""The sharded model on one GPU over NCCL (world size 1, real process groups), captured in CUDA graphs."""

import pytest
import torch

from tests import parallel_workers as w
from tests.dist_helpers import run_ranks

pytest.importorskip("transformers")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_world1_sharded_model_matches_and_replays_in_cuda_graphs():
    (r,) = run_ranks(w.cuda_world1_graphs, 1, timeout=480)
    assert r["backend"] == "nccl" and r["real_group"]
    assert r["eager_err"] < 1e-4, r  # fp32 on the GPU: the sharded (NCCL) and the unsharded model agree
    assert r["graph_breaks"] == {}
    assert r["got_steps"] == r["steps"] and r["steps"] > 40
    assert r["replays"] > 20
    assert r["same_tokens"]
