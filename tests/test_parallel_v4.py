"""DeepSeek-V4 sharded on 2 gloo processes (``mla_compile.parallel.v4``: data-parallel attention or the heads split
over the ranks, with expert parallelism): each rank's logits on its requests equal the single-process model's (float32,
<= 1e-5), eager, regional and compiled, float / fp8 / fp4 experts (through ``patch`` and ``from_pretrained(parallel=)``,
which reads only the rank's experts and heads); each rank keeps half the routed experts (and heads); the layouts V4
does not shard yet are refused by name. On GPUs (``cuda``):
over NCCL at world size 1 (and 2 where two GPUs are present), compiled by Inductor and replayed in a CUDA graph."""

import pytest
import torch

from tests import parallel_workers as w
from tests.dist_helpers import run_ranks

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

TOL = 1e-5


# each case checks the eager model too (the worker's "err"), so no eager-only case
@pytest.mark.parametrize("compile_backend,regional", [("aot_eager", False), ("aot_eager", True)])
def test_v4_dp_attention_ep2_each_rank_equals_single_process(compile_backend, regional):
    results = run_ranks(w.v4_sharded_equals_single, 2, 2, compile_backend, regional, timeout=300)
    for r in results:
        assert r["finite"] and r["err"] <= TOL, r
        assert r["all_parallel"] and r["local_experts"] * 2 == r["experts"], r
        assert not r["split_attention"] and r["shapes"] == r["full_shapes"], r  # every rank all the heads
        assert r["compiled_err"] <= TOL and r["graph_breaks"] == {}, r


def test_v4_attention_tp2_ep2_equals_single_process():
    """``ParallelConfig(tp=2, ep=2)``: the heads split over both ranks (one attention group, the same requests), the
    output projection's partial sums all-reduced; the logits equal the single-process model's."""
    results = run_ranks(w.v4_sharded_equals_single, 2, 1, "aot_eager", True, timeout=300)  # eager, then regional
    for r in results:
        assert r["finite"] and r["err"] <= TOL, r
        assert r["all_parallel"] and r["split_attention"] and r["local_experts"] * 2 == r["experts"], r
        assert r["heads"] == [r["all_heads"] // 2] * len(r["heads"]), r
        assert r["o_groups"] == [r["all_groups"] // 2] * len(r["o_groups"]), r
        (qb, ob, oa, sinks), (qb_full, ob_full, oa_full, sinks_full) = r["shapes"], r["full_shapes"]
        assert qb == (qb_full[0] // 2, qb_full[1]) and ob == (ob_full[0], ob_full[1] // 2), r
        assert oa == (oa_full[0] // 2, oa_full[1]) and sinks == (sinks_full[0] // 2,), r
        assert r["compiled_err"] <= TOL and r["graph_breaks"] == {}, r


@pytest.mark.parametrize("kind", ["fp8", "fp4", "float", "stacked"])
def test_v4_checkpoint_dp_attention_ep2_reads_only_own_experts_and_equals_single_process(kind, tmp_path):
    """``from_pretrained(parallel=)``: each rank reads only its experts' tensors (DeepSeek's per-expert keys; a slice
    of transformers' stacked float experts) and its logits equal the single-process model's."""
    if getattr(torch, "float8_e8m0fnu", None) is None:
        pytest.skip("torch without float8_e8m0fnu")
    results = run_ranks(w.v4_dp_ep_quantized_equals_single, 2, kind, str(tmp_path), timeout=300)
    for r in results:
        assert r["finite"] and r["err"] <= TOL, r
        assert r["quantized"] and r["local_experts"] * 2 == r["experts"], r
        if kind == "stacked":
            assert r["experts_read"] == [] and r["stacked_reads"] and set(r["stacked_reads"]) == {"slice"}, r
        else:
            assert r["experts_read"] == list(range(r["first"], r["first"] + r["local_experts"])), r
    assert sorted(r["first"] for r in results) == [0, results[0]["local_experts"]]


def test_v4_fp8_checkpoint_attention_tp2_equals_single_process(tmp_path):
    """``from_pretrained(parallel=ParallelConfig(tp=2, ep=2))`` of an fp8 checkpoint: ``q_b_proj``, the grouped
    ``o_a_proj`` and ``o_b_proj`` stay fp8, each rank with its half of the heads and their block scales."""
    if getattr(torch, "float8_e8m0fnu", None) is None:
        pytest.skip("torch without float8_e8m0fnu")
    results = run_ranks(w.v4_dp_ep_quantized_equals_single, 2, "fp8", str(tmp_path), True, timeout=300)
    for r in results:
        assert r["finite"] and r["err"] <= TOL and r["quantized"], r
        assert r["attn_types"] == ["FP8BlockLinear", "FP8GroupedLinear"] and r["heads"] * 2 == r["all_heads"], r
        assert r["experts_read"] == list(range(r["first"], r["first"] + r["local_experts"])), r


def test_v4_meta_model_sharded_from_a_state_dict_equals_single_process():
    results = run_ranks(w.v4_sharded_from_meta, 2, timeout=300)
    for r in results:
        assert r["err"] <= TOL and r["meta_left"] == [], r
        assert r["local_experts"] * 2 == r["experts"], r


def _check_device(results):
    for r in results:
        assert r["backend"] == "nccl" and r["real_group"], r
        assert max(r["eager_err"], r["compiled_err"], r["replay_err"], r["eager_last_err"]) < 1e-4, r
        assert r["graph_breaks"] == {}, r


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_v4_nccl_world1_matches_compiles_and_replays_in_a_cuda_graph():
    _check_device(run_ranks(w.v4_dp_ep_on_device, 1, timeout=480, fresh=True))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (a multi-GPU machine)")
@pytest.mark.parametrize("attn_tp", [False, True], ids=["dp_attention", "attention_tp"])
def test_v4_nccl_ep2_on_two_gpus(attn_tp):
    _check_device(run_ranks(w.v4_dp_ep_on_device, 2, attn_tp, timeout=480, fresh=True))


def test_v4_other_layouts_are_refused():
    from mla_compile.app.v4_toy import toy_v4_config, toy_v4_model
    from mla_compile.models.model import patch
    from mla_compile.parallel import ParallelConfig
    from mla_compile.parallel.groups import Group, ParallelState

    group = Group(None, (0, 1), 0)  # never reaches a collective: refused before
    for conf in (ParallelConfig(tp=2), ParallelConfig(tp=2, dp_attention=2), ParallelConfig(tp=2, ep=2, dcp=2)):
        state = ParallelState(conf, 0, 2, torch.device("cpu"), *([group] * 6))
        with pytest.raises(NotImplementedError, match="routed experts whole over every rank"):
            patch(toy_v4_model(0), parallel=state)
    state = ParallelState(ParallelConfig(tp=2, ep=2), 0, 2, torch.device("cpu"), *([group] * 6))
    for overrides, name in (({"o_groups": 1}, "o_groups=1"), ({"num_attention_heads": 3, "o_groups": 1},
                                                              "num_attention_heads=3")):
        with pytest.raises(ValueError, match=f"{name} does not split over the attention group's 2 ranks"):
            patch(toy_v4_model(0, **overrides), parallel=state)
    import transformers

    state = ParallelState(ParallelConfig(tp=2, dp_attention=2, ep=2), 0, 2, torch.device("cpu"), *([group] * 6))
    with torch.device("meta"):
        empty = transformers.DeepseekV4ForCausalLM(toy_v4_config())
    with pytest.raises(ValueError, match="meta device: pass weights="):
        patch(empty, parallel=state)
