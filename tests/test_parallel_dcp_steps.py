"""Decode context parallelism on the steps beyond one-query decode: chunked prefill over cached context,
multi-token decode (``query_len > 1``, causal within the new tokens) and sparse (V3.2) top-k selection.

Model tests run 2 gloo processes (tp=2, dcp=2) against the single-process patched model (float32, <= 1e-5),
planned per rank (``plan_dcp_step``) and localized from a global plan (``localize``, the demo engine's path).
Compiled cases run one-layer toys (tracing time grows with the layers; the eager cases run two).
"""

import importlib.util
import os

import pytest
import torch

from mla_compile.app import toy
from mla_compile.models.metadata import SeqChunk, plan_step
from mla_compile.ops.sparse_index import select_topk
from mla_compile.parallel import dcp
from mla_compile.parallel.groups import Group
from tests import parallel_workers as w
from tests.dist_helpers import run_ranks

TOL = 1e-5
ONE = Group(None, (0,), 0)  # a group of one: merge_topk then merges the candidates it is given


SPARSE = pytest.mark.skipif(not toy.has_sparse_kinds(), reason="needs transformers with DeepseekV32ForCausalLM")


@pytest.mark.parametrize("kind,interleave,query_len,compile_too,regional", [
    ("v3", 4, 3, False, False), ("v2-lite", 1, 2, True, False), pytest.param("v3.2", 2, 2, True, False, marks=SPARSE),
    ("v2-lite", 1, 2, True, True), pytest.param("v3.2", 2, 2, False, True, marks=SPARSE)])
def test_dcp2_context_and_multi_token_decode_equal_single_process(kind, interleave, query_len, compile_too, regional):
    """``regional``: the DCP model patched with ``regional_compile=True`` (each layer's split-cache attention, its
    query gather and LSE merge inside its second region), eager and (``compile_too``) compiled."""
    pytest.importorskip("transformers")
    # compiled: a one-layer toy (Dynamo's tracing time grows with the layers); the two-layer one runs in the v3 case
    layers = 1 if compile_too and not regional else None
    results = run_ranks(w.dcp_multi_token_equals_single, 2, kind, interleave, query_len, compile_too, None, None,
                        layers, False, regional, timeout=300)
    for r in results:
        assert r["type"] == "DCPAttention" and r["finite"], r
        assert r["err"] <= TOL and r["err_localize"] <= TOL, r
        # every token's logits of: 9 + 6 prompt tokens; q decode + 10 + 7 chunked; 4; three q-token decodes twice
        assert r["rows"] == [15, query_len + 17, 4, 3 * query_len, 3 * query_len], r
        if kind == "v3.2":
            assert r["indexer"] == "DCPIndexer" and r["topk"] < r["longest"] - 8, r  # top-k cuts real contexts
        if compile_too:
            assert r["compiled_err"] <= TOL, r
            assert r["graph_breaks"] == {}, r
            assert any("_c10d_functional.all_gather_into_tensor" in c for c in r["collectives"]), r


def _split_candidates(scores, P, interleave, topk):
    """Each simulated rank's own top-k (``select_topk`` over its tokens), as (scores, positions) side by side."""
    T, L = scores.shape
    pos = torch.arange(L)
    out_s, out_p = [], []
    for rank in range(P):
        mine = pos[dcp.owner(pos, P, interleave) == rank]
        local = scores[:, mine]
        order = select_topk(local, topk)
        s, p = local.gather(1, order), dcp.global_position(order, P, rank, interleave)
        assert torch.equal(p, mine[order])  # global_position inverts local_position
        pad = topk - order.shape[1]
        out_s.append(torch.cat([s, s.new_full((T, pad), float("-inf"))], 1))
        out_p.append(torch.cat([p, p.new_zeros(T, pad)], 1))
    return torch.cat(out_s, 1), torch.cat(out_p, 1)


@pytest.mark.parametrize("P,interleave,topk", [(2, 1, 5), (2, 4, 8), (3, 2, 7), (4, 4, 40)])
def test_merge_topk_of_each_part_s_top_k_is_the_whole_top_k(P, interleave, topk):
    gen = torch.Generator().manual_seed(P * 100 + topk)
    T, L = 64, 37
    # few distinct values (zeros and -0.0 among them: relu scores tie at 0) so ties cross the cut often
    scores = torch.randint(-2, 3, (T, L), generator=gen).float() * 0.5
    scores[torch.rand(T, L, generator=gen) < 0.1] = -0.0
    limit = torch.randint(0, L + 1, (T,), generator=gen)  # causal limits, some rows empty
    scores = scores.masked_fill(torch.arange(L)[None, :] >= limit[:, None], float("-inf"))
    want = select_topk(scores, topk)
    want = torch.where(scores.gather(1, want).isneginf(), -1, want)
    cand_s, cand_p = _split_candidates(scores, P, interleave, topk)
    got_s, got_p = dcp.merge_topk(cand_s, cand_p, topk, ONE)
    k = want.shape[1]
    assert torch.equal(got_p[:, :k], want), (got_p, want)
    assert bool((got_p[:, k:] == -1).all())
    assert torch.equal(got_s[:, :k], torch.where(want >= 0, scores.gather(1, want.clamp(min=0)), float("-inf")))


@pytest.mark.parametrize("rank,interleave", [(0, 4), (1, 4), (1, 1), (0, 2)])
def test_localize_context_covers_this_rank_s_part_of_each_context(rank, interleave):
    bs, blocks = 4, [[7, 3, 9, 1, 4], [2, 8, 10], [5, 0, 6, 11]]
    prefill = [SeqChunk(blocks[0], [1, 2, 3], 13), SeqChunk(blocks[2], [4], 9), SeqChunk(blocks[1], [5, 6], 0)]
    decode = [SeqChunk(blocks[1], [7, 8], 6)]
    glob = plan_step(decode, prefill, bs, query_len=2, context_chunk_tokens=5)
    got = dcp.localize(glob.meta, glob.positions, bs, 2, rank, interleave)
    ctx = got.prefill.context
    assert torch.equal(ctx.rows, glob.meta.prefill.context.rows)  # host sizes: the global (upper) bounds
    for i, c in enumerate(prefill):
        want = dcp.local_seq_lens(torch.tensor([c.start]), 2, rank, interleave).item()
        covered = []
        for s in range(ctx.num_slices):
            n = int(ctx.cu_seqlens[s, i + 1] - ctx.cu_seqlens[s, i])
            covered += list(range(int(ctx.starts[s, i]), int(ctx.starts[s, i]) + n))
            assert n <= int(ctx.rows[s])
        assert covered == list(range(want)), (i, covered, want)  # local positions 0..part-1, each once
    plan = dcp.plan_dcp_step(decode, prefill, bs, 2, rank, interleave=interleave, query_len=2,
                             context_chunk_tokens=5).meta
    assert got.slot_mapping.tolist() == plan.slot_mapping.tolist()
    assert got.decode.seq_lens.tolist() == plan.decode.seq_lens.tolist()


@pytest.mark.parametrize("kind", ["v3", pytest.param("v3.2", marks=SPARSE)])
def test_dcp_layers_over_one_rank_equal_the_model(kind):
    pytest.importorskip("transformers")
    r = w.dcp_one_rank(kind, "cpu", 2, "eager", overrides=w.ONE_MOE_LAYER)  # every layer is replaced alike
    assert r["types"] == ["DCPAttention"] and r["indexers"] == (["DCPIndexer"] if kind == "v3.2" else []), r
    assert r["err"] <= TOL and r["compiled_err"] <= TOL and r["graph_breaks"] == {}, r


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["v3", "v3.2"])
def test_dcp_layers_over_one_rank_on_the_gpu(kind):
    """The DCP paths with the GPU's backends (multi-token decode as one-query rows, the sparse candidates'
    merge), eager and compiled by Inductor; float32 on the GPU: <= 1e-4."""
    pytest.importorskip("transformers")
    if kind == "v3.2" and not toy.has_sparse_kinds():
        pytest.skip("needs transformers with DeepseekV32ForCausalLM")
    r = w.dcp_one_rank(kind, "cuda", 2, "inductor")
    assert r["err"] < 1e-4 and r["compiled_err"] < 1e-4 and r["graph_breaks"] == {}, r


@pytest.mark.parametrize("kind", ["v3", pytest.param("v3.2", marks=SPARSE)])
def test_engine_on_dcp_ranks_with_chunked_prefill_gives_the_unsharded_tokens(kind):
    pytest.importorskip("transformers")
    results = run_ranks(w.dcp_engine_per_rank, 2, kind, timeout=240)
    for r in results:
        assert r["same"] and r["steps"] == r["got_steps"] and r["tokens"] > 10, r
        assert r["context_steps"] >= 2, r  # prompts longer than the token budget: chunks over cached context


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                    reason="needs TRITON_INTERPRET=1 and an importable triton (tests/conftest.py sets it without a GPU)")
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_scores_with_query_limits_equal_the_reference(fp8):
    """The split-cache indexer's scores (each query's limit in a rank's part) by the Triton kernel, under the
    interpreter, against the reference: limits 0 (nothing here), padding tokens, a NaN-poisoned cache."""
    from mla_compile.ops.fp8_index import quantize_fp8_index
    from mla_compile.ops.sparse_index import lightning_scores_ref, triton_scores

    gen = torch.Generator().manual_seed(3 + fp8)
    B, M, bs, Hi, d, T = 3, 3, 16, 4, 32, 10
    keys = torch.randn(B * M * bs, d, generator=gen)
    cache = quantize_fp8_index(keys) if fp8 else keys.clone()
    cache = cache.view(B * M, bs, -1)
    cache[-1] = float("nan") if not fp8 else 255  # the block of the unused table entries: never read
    used = torch.randperm(B * M - 1, generator=gen)[:6].tolist()
    table = torch.tensor([used[:3], [used[3], 8, 8], [used[4], used[5], 8]], dtype=torch.int32)
    seq_lens = torch.tensor([40, 7, 30], dtype=torch.int32)  # 3, 1 and 2 blocks of 16
    query_seq = torch.tensor([0, 0, 1, 1, 2, 2, 2, -1, 0, 1])
    limit = torch.tensor([40, 0, 7, 3, 30, 1, 0, 5, 17, 7])
    q, w = torch.randn(T, Hi, d, generator=gen), torch.randn(T, Hi, generator=gen)
    want = lightning_scores_ref(q, w, cache, table, seq_lens, query_seq, limit)
    got = triton_scores(q, w, cache, table, seq_lens, query_seq, limit)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert int((~torch.isneginf(want)).sum()) == 40 + 7 + 3 + 30 + 1 + 17 + 7  # padding and limit-0 rows: none
    fin = ~torch.isneginf(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)
