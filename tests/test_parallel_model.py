"""Sharded models on 2 gloo processes equal the single-process patched model (float32, <= 1e-5).

Each test spawns 2 CPU processes (tests/dist_helpers.py) that run a bodies in tests/parallel_workers.py:
prefill, chunked prefill over a prefix-cached context mixed with a decode, and decode steps, over a
NaN-filled cache; V2-Lite- and V3-shaped toys (the compiled cases with one MoE layer, the others with a dense
layer and a MoE layer).
"""

import pytest

from mla_compile.app import toy
from tests import parallel_workers as w
from tests.dist_helpers import run_ranks

pytest.importorskip("transformers")
TOL = 1e-5


def _check_equal(results, full_heads=4, max_fraction=0.6):
    for r in results:
        assert r["finite"]
        assert r["err"] <= TOL, r
        # each rank keeps only its shard: half the heads of kv_b_proj / o_proj, well under the full model
        assert r["kv_b"] == [full_heads // 2 * 256, 512] and r["o_proj"] == [256, full_heads // 2 * 128]
        assert r["params"] < max_fraction * r["full_params"]


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_tp2_equals_single_process(kind):
    # v2-lite with a vocabulary of 1021 (prime): the last vocab shard is zero-padded, the padding dropped
    vocab = 1021 if kind == "v2-lite" else 1024
    results = run_ranks(w.sharded_equals_single, 2, kind, dict(tp=2), "all_to_all", False, dict(vocab_size=vocab))
    _check_equal(results)
    for r in results:
        assert r["vocab_shard"] == -(-vocab // 2) and r["logits_width"] == vocab
    experts = 8 if kind == "v2-lite" else 16
    for r in results:  # ep == 1: every expert on every rank, half its intermediate width (64 -> 32, gate and up)
        assert r["experts"] == [experts, 64, 256]


@pytest.mark.parametrize("kind,dispatch", [("v2-lite", "all_to_all"), ("v3", "all_to_all"), ("v3", "all_reduce")])
def test_ep2_equals_single_process(kind, dispatch):
    results = run_ranks(w.sharded_equals_single, 2, kind, dict(tp=2, ep=2), dispatch, False)
    _check_equal(results)
    experts = 8 if kind == "v2-lite" else 16
    for r in results:  # ep == tp: half the experts, whole
        assert r["experts"] == [experts // 2, 128, 256]


@pytest.mark.parametrize("kind,pconf", [("v2-lite", dict(tp=2)), ("v3", dict(tp=2, ep=2))])
def test_compiled_fullgraph_with_collectives_in_the_graph(kind, pconf):
    # one MoE layer (w.ONE_MOE_LAYER): the collectives of attention, experts and lm_head at half the tracing time
    results = run_ranks(w.sharded_equals_single, 2, kind, pconf, "all_to_all", True, w.ONE_MOE_LAYER, timeout=240)
    for r in results:
        assert r["compiled_err"] <= TOL and r["other_batch_err"] <= TOL, r
        assert r["graph_breaks"] == {}
        assert r["recompiled"] == 0  # other batch sizes and lengths reuse the graphs
        want = {"_c10d_functional.all_reduce.default", "_c10d_functional.all_gather_into_tensor.default",
                "_c10d_functional.wait_tensor.default"}
        if pconf.get("ep", 1) > 1:
            want.add("_c10d_functional.all_to_all_single.default")
        assert want <= set(r["collectives"]), r["collectives"]


@pytest.mark.parametrize("kind,pconf", [("v3", dict(tp=2, ep=2))])
def test_regional_compile_of_a_sharded_model_equals_single_process(kind, pconf):
    """``patch(..., parallel=state, regional_compile=True)``: each layer's two compile regions hold its collectives
    (the attention's ``o_proj`` reduce, the experts' all-to-all and reduce); compiled fullgraph, the logits equal the
    single-process model's, no graph break or recompile, and the last MoE layer calls the one before's regions
    (torch 2.11 keeps the first MoE layer's first region, after the dense layer, as a subgraph of its own)."""
    overrides = dict(num_hidden_layers=4, first_k_dense_replace=1)
    results = run_ranks(w.sharded_equals_single, 2, kind, pconf, "all_to_all", True, overrides, True, timeout=300)
    for r in results:
        assert r["err"] <= TOL and r["compiled_err"] <= TOL and r["other_batch_err"] <= TOL, r
        assert r["graph_breaks"] == {} and r["recompiled"] == 0, r
        calls = r["region_calls"]
        assert len(calls) >= 2 * 4 - 1, calls  # two regions a layer (Dynamo may inline a region called once)
        assert calls[-2:] == calls[-4:-2], calls  # the last two MoE layers call the same pair of subgraphs
        want = {"_c10d_functional.all_reduce.default", "_c10d_functional.all_to_all_single.default",
                "_c10d_functional.wait_tensor.default"}
        assert want <= set(r["collectives"]), r["collectives"]


def test_meta_model_sharded_from_a_state_dict():
    results = run_ranks(w.sharded_from_meta, 2, "v3", dict(tp=2, ep=2))
    for r in results:
        assert r["meta_left"] == []
        assert r["err"] <= TOL


@pytest.mark.skipif(not toy.has_sparse_kinds(), reason="needs transformers with DeepseekV32ForCausalLM")
def test_sparse_v32_tp2_ep2_equals_single_process():
    # the lightning indexer is replicated (same top-k slots on every rank), the heads split
    results = run_ranks(w.sharded_equals_single, 2, "v3.2", dict(tp=2, ep=2), "all_to_all", False)
    _check_equal(results, max_fraction=0.65)


@pytest.mark.parametrize("kind,pconf,compile_too,regional", [("v3", dict(tp=2, dp_attention=2), False, False),
                                                             ("v2-lite", dict(tp=2, dp_attention=2, ep=2), True, False),
                                                             ("v2-lite", dict(tp=2, dp_attention=2, ep=2), True, True)])
def test_dp_attention2_each_group_equals_single_process_on_its_requests(kind, pconf, compile_too, regional):
    """``regional``: the model patched with ``regional_compile=True`` (its gathers inside the MLP regions)."""
    overrides = w.ONE_MOE_LAYER if compile_too else None  # compiled: one layer, as above
    if regional:
        overrides = dict(num_hidden_layers=2, first_k_dense_replace=1)  # the dense and the MoE layer's regions
    results = run_ranks(w.dp_attention_equals_single, 2, kind, pconf, compile_too, overrides, regional, timeout=240)
    for r in results:
        assert r["err"] <= TOL, r
        assert r["heads"] == 4 and r["copies"] == 1  # all heads per rank, own cache: no duplicated latent
        if compile_too:
            assert r["compiled_err"] <= TOL and r["graph_breaks"] == {}, r


@pytest.mark.parametrize("kind,interleave,compile_too,kv_cache", [("v3", 4, False, "bf16"), ("v2-lite", 1, True, "bf16"),
                                                                  ("v3", 2, False, "fp8")])
def test_dcp2_model_equals_single_process_with_each_token_cached_once(kind, interleave, compile_too, kv_cache):
    overrides = w.ONE_MOE_LAYER if compile_too else None  # compiled: one layer, as above
    results = run_ranks(w.dcp_model_equals_single, 2, kind, interleave, compile_too, kv_cache, overrides, timeout=240)
    for r in results:
        assert r["type"] == "DCPAttention" and r["finite"]
        assert r["err"] <= TOL and r["ctx_err"] <= TOL, r
        assert r["ctx_rows"] == [4]  # the 8-token cached prefix: 4 context rows on each rank
        if compile_too:
            assert r["compiled_err"] <= TOL and r["compiled_ctx_err"] <= TOL and r["graph_breaks"] == {}, r
    # prompts of 3, 13 and 6 tokens, then 3 decode steps: 31 rows, each written on exactly one rank
    assert results[0]["rows_written"] + results[1]["rows_written"] == 31
    assert min(r["rows_written"] for r in results) >= 12


def test_plan_dcp_step_plans_this_ranks_part_and_refuses_short_block_lists():
    from mla_compile.models.metadata import SeqChunk
    from mla_compile.parallel.dcp import plan_dcp_step

    # context 0..8 and new tokens 8, 9 of a sequence: rank 1 holds 4..7 as context and no new token
    for rank, ctx_rows, slots in ((0, 4, [24, 25]), (1, 4, [-1, -1])):  # local positions 4, 5: block 6
        step = plan_dcp_step([], [SeqChunk([5, 6], [1, 2], 8)], 4, 2, rank)
        assert int(step.meta.prefill.context.rows.sum()) == ctx_rows
        assert step.meta.slot_mapping.tolist()[:2] == slots
    with pytest.raises(ValueError, match="holds 2 blocks"):  # 12 tokens, rank 0 holds 0-3 and 8-11
        plan_dcp_step([], [SeqChunk([0], list(range(12)))], 4, 2, 0)
    step = plan_dcp_step([], [SeqChunk([5, 6], list(range(12)))], 4, 2, 0)
    assert step.meta.slot_mapping.tolist() == [20, 21, 22, 23, -1, -1, -1, -1, 24, 25, 26, 27]


def test_tp4_ep2_four_processes_equals_single_process():
    # tp=4 x ep=2: one head per rank, 8 of 16 experts per EP rank, each expert split 2 ways (moe_tp=2)
    results = run_ranks(w.sharded_equals_single, 4, "v3", dict(tp=4, ep=2), "all_to_all", False, timeout=240)
    for r in results:
        assert r["err"] <= TOL, r
        assert r["kv_b"] == [256, 512] and r["experts"] == [8, 64, 256]
        assert r["params"] < 0.4 * r["full_params"]


def test_engine_on_every_rank_gives_the_unsharded_tokens():
    results = run_ranks(w.engine_per_rank, 2, dict(tp=2, ep=2), timeout=180)
    for r in results:
        assert r["same"] and r["steps"] == r["got_steps"] and r["tokens"] > 20, r


@pytest.mark.parametrize("kind,pconf", [("v2-lite", dict(tp=2)), ("v3", dict(tp=2, ep=2))])
def test_from_pretrained_reads_each_rank_s_shard_of_a_checkpoint(tmp_path, kind, pconf):
    """A float checkpoint on disk, loaded with parallel=: each rank reads the slices it keeps (stacked experts
    assembled from the per-expert tensors) and the logits equal the single-process load."""
    from tests.checkpoints import write_checkpoint

    write_checkpoint(tmp_path, kind, "bf16", seed=4)
    results = run_ranks(w.from_pretrained_sharded, 2, str(tmp_path), pconf, timeout=180)
    for r in results:
        assert r["meta_left"] == [] and r["err"] <= TOL, r
        assert r["params"] < 0.7 * r["full_params"]
