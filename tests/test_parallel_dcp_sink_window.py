"""Decode context parallelism with sink + window attention, and op-level ``dcp_decode`` with several queries per
sequence (``s_q > 1``, causal).

Model tests run 2 gloo processes (tp=2, dcp=2) against the single-process sink + window model (float32, <= 1e-5);
the op-level tests against a float64 softmax written from the contract.
"""

from types import SimpleNamespace

import pytest
import torch

from mla_compile import ops
from mla_compile.parallel import dcp
from mla_compile.serving.block_manager import sink_window_of
from tests import dcp_sink_workers as w
from tests import parallel_workers as pw
from tests.dist_helpers import run_ranks

TOL = 1e-5


@pytest.mark.parametrize("P,interleave,sink,window", [(2, 1, 2, 5), (2, 4, 3, 6), (3, 2, 0, 4), (4, 4, 5, 1)])
def test_sink_window_slots_of_every_rank_make_the_unsplit_selection(P, interleave, sink, window):
    """Each simulated rank's slots mapped back to sequence positions: every selected position exactly once, on
    its owner, and the union is the unsplit op's selection (identity block tables: slot = position)."""
    bs = 4
    gen = torch.Generator().manual_seed(P * 10 + sink)
    B, T = 3, 40
    query_seq = torch.randint(-1, B, (T,), generator=gen)
    query_pos = torch.randint(0, 47, (T,), generator=gen)
    max_blocks = -(-48 // bs)
    whole = torch.arange(B * max_blocks, dtype=torch.int32).view(B, max_blocks)
    want = ops.sink_window_query_indices(whole, query_seq.int(), query_pos.int(), block_size=bs, sink=sink,
                                         window=window)
    want_pos = torch.where(want >= 0, want - query_seq.clamp(min=0)[:, None] * max_blocks * bs, -1)
    found = [[] for _ in range(T)]
    for rank in range(P):
        # this rank's blocks: a shuffled table of its own, its part of each sequence in the first blocks
        perm = torch.randperm(B * max_blocks, generator=gen)
        table = perm.view(B, max_blocks).int()
        slots = dcp.sink_window_slots(table, query_seq, query_pos, bs, sink, window, P, rank, interleave)
        assert slots.shape == (T, sink + window) and slots.dtype == torch.int32
        for t in range(T):
            for s in slots[t][slots[t] >= 0].tolist():
                col = (table[query_seq[t]] == s // bs).nonzero().item()
                local = torch.tensor(col * bs + s % bs)
                pos = int(dcp.global_position(local, P, rank, interleave))
                assert int(dcp.owner(torch.tensor(pos), P, interleave)) == rank
                found[t].append(pos)
    for t in range(T):
        assert sorted(found[t]) == want_pos[t][want_pos[t] >= 0].tolist(), (t, found[t], want_pos[t])
    assert any(len(f) < int(query_pos[t]) + 1 for t, f in enumerate(found) if query_seq[t] >= 0)  # some cut


def test_engine_keeps_every_block_of_a_dcp_model():
    """A DCP rank's part sits in the first blocks of the shared table: the engine releases nothing there."""
    model = SimpleNamespace(sink_window=(2, 5), parallel_state=SimpleNamespace(config=SimpleNamespace(dcp=2)))
    assert sink_window_of(SimpleNamespace(step_fn=model)) is None
    model.parallel_state.config.dcp = 1  # TP only: every rank holds whole rows, released as without sharding
    assert sink_window_of(SimpleNamespace(step_fn=SimpleNamespace(_orig_mod=model))) == (2, 5)


@pytest.mark.parametrize("kind,interleave,sink,window,query_len,compile_too,dcp_size", [
    ("v2-lite", 1, 2, 5, 1, True, 2), ("v3", 4, 3, 6, 3, False, 2), ("v3", 4, 1, 4, 2, False, 1)],
    ids=["dcp2-v2-lite-compiled", "dcp2-v3-q3", "tp2-v3-q2"])
def test_sharded_sink_window_model_equals_single_process(kind, interleave, sink, window, query_len, compile_too,
                                                         dcp_size):
    pytest.importorskip("transformers")
    results = run_ranks(pw.dcp_multi_token_equals_single, 2, kind, interleave, query_len, compile_too, (sink, window),
                        dcp_size, 1 if compile_too else None, compile_too, timeout=300)  # compiled: one layer
    for r in results:
        assert r["type"] == ("DCPAttention" if dcp_size > 1 else "MLAAttention") and r["finite"], r
        assert r["sink_window"] == (sink, window) and set(r["attn_sink_window"]) == {(sink, window)}, r
        assert r["longest"] > sink + window + 8, r  # tokens fall outside sink and window
        assert r["vs_dense"] > 1e-3, r  # the window matters: a dense model's logits differ
        assert r["err"] <= TOL and r["err_localize"] <= TOL, r
        assert r["rows"] == [15, query_len + 17, 4, 3 * query_len, 3 * query_len], r
        if compile_too:
            assert r["compiled_err"] <= TOL and r["other_err"] <= TOL, r
            assert r["graph_breaks"] == {} and r["recompiled"] == 0, r
            assert any("_c10d_functional.all_gather_into_tensor" in c for c in r["collectives"]), r
            assert r["sparse_decode"], r


# lens 0 (no tokens), 1 and 2 (< s_q: some queries see nothing), 3..4 (interleave 4: rank 1 holds none), longer
@pytest.mark.parametrize("s_q,interleave,given_positions,compile_it", [
    (1, 4, False, False), (3, 4, False, True), (3, 1, True, False)])
def test_dcp2_decode_with_causal_queries_equals_float64_reference(s_q, interleave, given_positions, compile_it):
    lens = [0, 1, 2, 3, 4, 9, 21]
    results = run_ranks(w.dcp_decode_queries, 2, interleave, lens, s_q, given_positions, compile_it)
    for r in results:
        assert r["finite"] and r["inf_match"], r
        assert r["err_out"] < 1e-5 and r["err_lse"] < 1e-5 and r["vs_unsplit"] < 1e-5, r
        assert r["shape"] == [len(lens), s_q, 4, 32], r
        want_empty = [(b, i) for b, n in enumerate(lens) for i in range(s_q) if n - (s_q - 1 - i) <= 0]
        assert [tuple(e) for e in r["empty"]] == want_empty and want_empty, r
        if compile_it:
            assert any("_c10d_functional.all_gather_into_tensor" in o for o in r["ops"]), r["ops"]
            assert any("merge_attn_states" in o for o in r["ops"]), r["ops"]
    split = [results[0]["local_lens"], results[1]["local_lens"]]
    assert [a + b for a, b in zip(*split)] == lens
    if interleave == 4:
        assert split[1][:5] == [0] * 5  # the empty parts


def test_dcp_decode_positions_must_match_the_queries():
    from mla_compile.parallel.groups import Group

    one = Group(None, (0,), 0)
    q = torch.randn(2, 3, 4, 48)
    cache = torch.randn(4, 4, 48)
    table = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"positions must be \[B, s_q\] = \[2, 3\]"):
        dcp.dcp_decode(q, cache, table, lens, 0.1, one, kv_lora_rank=32, positions=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"q must be \[B, H, D\] or \[B, s_q, H, D\]"):
        dcp.dcp_decode(q[0, 0], cache, table, lens, 0.1, one, kv_lora_rank=32)


def test_engine_on_dcp_ranks_with_sink_window_gives_the_unsharded_tokens():
    pytest.importorskip("transformers")
    results = run_ranks(w.dcp_sink_engine_per_rank, 2, 2, 5, timeout=240)
    for r in results:
        assert r["same"] and r["steps"] == r["got_steps"] and r["tokens"] > 10, r
        assert r["longest"] > 2 + 5, r
        assert r["ref_windowed"] == (2, 5) and r["dcp_windowed"] is None, r  # released vs kept blocks


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dcp_sink_window_layers_over_one_rank_on_the_gpu():
    """The DCP sink + window path with the GPU's backends (sparse decode over each rank's slots, the LSE merge),
    eager and compiled by Inductor; float32 on the GPU: <= 1e-4."""
    pytest.importorskip("transformers")
    r = pw.dcp_one_rank("v3", "cuda", 2, "inductor", sink_window=(2, 5))
    assert r["types"] == ["DCPAttention"] and r["longest"] > 2 + 5 + 8, r
    assert r["err"] < 1e-4 and r["compiled_err"] < 1e-4 and r["graph_breaks"] == {}, r
