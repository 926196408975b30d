"""mla_compile.parallel.init: process groups, world-size checks, and errors (not hangs) on missing or dead peers."""

import pytest
import torch

from mla_compile.parallel import ParallelConfig, init
from tests import dist_helpers
from tests import parallel_workers as w
from tests.dist_helpers import run_ranks


def test_world_size_mismatch_is_named_before_any_rendezvous():
    with pytest.raises(ValueError, match=r"world size 2 does not match the ParallelConfig: tp=4"):
        init(ParallelConfig(tp=4), rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"rank must lie in \[0, 2\)"):
        init(ParallelConfig(tp=2), rank=2, world_size=2)


def test_missing_rank_asks_for_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        init(ParallelConfig(tp=2))
    with pytest.raises(TypeError, match="ParallelConfig"):
        init({"tp": 2})


def test_missing_rendezvous_address_is_named(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        init(ParallelConfig(tp=2), rank=0, world_size=2)


def test_launched_world_of_other_size_errors_on_every_rank():
    msgs = run_ranks(w.mismatch, 2)
    assert all(m and "world size 2 does not match" in m and "tp=4" in m for m in msgs)


def test_missing_peer_times_out_at_init():
    (r,) = run_ranks(w.lonely, 1, 2.0, timeout=60, fresh=True)
    assert r is not None, "init returned without its peer"
    # no wall-clock bound here: were the 2 s timeout not applied, torch's default (minutes) would outlast
    # run_ranks' 60 s deadline, which fails the test with TimeoutError
    assert "1/2" in r["error"] or "Timed out" in r["error"] or "timeout" in r["error"].lower()


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_dead_or_hung_peer_errors_instead_of_hanging(how):
    results = run_ranks(w.dead_peer, 2, 3.0, how, expect_dead=(1,), timeout=60)
    r = results[0]
    assert r is not None, "the collective returned without its peer"  # and within run_ranks' deadline
    assert "Connection" in r["error"] or "Timed out" in r["error"] or "closed" in r["error"], r


@pytest.mark.parametrize("init_makes_default", [False, True])
def test_destroy_ends_only_the_groups_init_made(init_makes_default, tmp_path):
    # fresh processes: the pool's workers hold a default group of their own
    want = ({"made_default": True, "sum": [3.0] * 3, "ended": True} if init_makes_default else
            {"sub_made": True, "sub_gone": True, "default_kept": True, "sum": [3.0] * 3})
    for r in run_ranks(w.destroy_owns_what_init_made, 2, str(tmp_path / "store"), init_makes_default, timeout=120,
                       fresh=True):
        assert r == want, r


def test_pool_runs_a_call_again_when_a_worker_dies_of_a_signal(tmp_path):
    # tests/dist_helpers.py: a worker's native crash (here rank 0's abort on the first try) reruns the call once on
    # new workers, with a warning; a crash on the second try too fails the call
    with pytest.warns(UserWarning, match=r"exit codes .*-6.* running it again on new workers"):
        assert run_ranks(w.crash_first, 2, str(tmp_path / "once"), False, timeout=60) == [(0, [3.0, 3.0]),
                                                                                          (1, [3.0, 3.0])]
    with pytest.warns(UserWarning, match="running it again"), pytest.raises(RuntimeError, match=r"exit codes .*-6"):
        run_ranks(w.crash_first, 2, str(tmp_path / "always"), True, timeout=60)


def test_pool_call_past_its_deadline_prints_the_hung_ranks_stacks_and_the_others_errors(capfd):
    # tests/dist_helpers.py: before killing the pool, a call past its deadline has every live worker print its
    # threads' Python stacks (SIGUSR1, faulthandler) and names the errors other ranks sent meanwhile
    dist_helpers._close_pools()
    assert run_ranks(w.hang_rank0, 2, False) == [0, 1]  # a pool spawned here (writing to this test's stderr), up
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 5 s .*errors: .*rank 1 gave up"):
        run_ranks(w.hang_rank0, 2, True, timeout=5)
    assert "in hang_rank0" in capfd.readouterr().err
    assert 2 not in dist_helpers._POOLS  # killed: the next call starts a new pool


def test_pool_workers_keep_the_subgroups_calls_destroy():
    # tests/dist_helpers.py: destroying gloo groups in a long-lived process crashes it natively after some cycles,
    # so a pool worker keeps every subgroup until it exits; the groups and the default group still work
    for r in run_ranks(w.subgroup_kept, 2):
        assert r == {"kept": True, "sums": ([3.0, 3.0], [7.0, 7.0])}, r


def test_eager_collectives_over_gloo_are_settled_tensors_with_the_right_values():
    # parallel/layers.py: eagerly over gloo the layers call c10d's synchronous collectives (torch's gloo corrupts
    # the heap now and then with functional collectives in flight), so results are plain tensors, already there
    xs = [torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(100 + r)).transpose(1, 2).double()
          for r in range(2)]
    want = {"reduce": xs[0] + xs[1], "gather0": torch.cat(xs, 0), "gather_last": torch.cat(xs, -1)}
    for rank, res in enumerate(run_ranks(w.eager_layer_collectives, 2)):
        assert {k: name for k, (name, _) in res.items()} == dict.fromkeys(res, "Tensor"), res
        for k, v in want.items():
            torch.testing.assert_close(res[k][1].double(), v, rtol=1e-6, atol=1e-6)
        blocks = [x.bfloat16()[2 * rank: 2 * rank + 2] for x in xs]  # rank q's block for this rank, in rank order
        assert torch.equal(res["to_all"][1], torch.cat(blocks, 0))


def test_groups_follow_the_rank_layout():
    # tp=2 with ep=2: one attention group of both ranks, EP over both, each expert whole (moe_tp groups of one)
    results = run_ranks(w.groups_layout, 2, dict(tp=2, ep=2, dcp=2))
    for rank, g in enumerate(results):
        assert g["tp"] == ([0, 1], rank) and g["attn"] == ([0, 1], rank) and g["dcp"] == ([0, 1], rank)
        assert g["ep"] == ([0, 1], rank) and g["moe_tp"] == ([rank], 0)
        assert g["real"] == {"tp": True, "attn": True, "dcp": True, "ep": True, "moe_tp": False}
        assert g["sum"] == 3.0  # a collective over the attention group: 1 + 2
