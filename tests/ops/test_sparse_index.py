"""Sparse-MLA indexers against Python loops: sink + window slots and their CSR form, the V3.2 lightning
indexer (causality, ties, -1 padding), the index-key cache write, and a sparse decode step under
``torch.compile(fullgraph=True, dynamic=True)``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from mla_compile import ops
from mla_compile.ops import lightning_index, sink_window_indices, to_csr, write_index_cache
from .ref64 import IMPLS, NAN, Paged, assert_bitwise_equal, fill_paged_cache, generator, paged, randn, seeds
from .ref_sparse import fill_fp8_cache, lightning_ref, sink_window_ref

I32 = torch.int32


# ------------------------------------------------------------------------------------------- sink + window

def _window(impl, layout: Paged, sink, window, max_kv, idx_dtype=I32):
    table, lens = layout.block_table(idx_dtype), layout.seq_lens_tensor(idx_dtype)
    if impl == "raw":
        return torch.ops.mla.sink_window_indices_ref(table, lens, layout.block_size, sink, window, max_kv)
    return sink_window_indices(table, lens, block_size=layout.block_size, sink=sink, window=window, max_kv=max_kv)


def _check_window(impl, layout, sink, window, spare, idx_dtype=I32):
    max_kv = sink + window + spare
    indices, counts = _window(impl, layout, sink, window, max_kv, idx_dtype)
    expected = sink_window_ref(layout, sink, window)
    assert indices.dtype == I32 and counts.dtype == I32 and indices.shape == (len(layout.seq_lens), max_kv)
    assert counts.tolist() == [len(e) for e in expected]
    assert indices.tolist() == [e + [-1] * (max_kv - len(e)) for e in expected]
    return indices, counts


@given(impl=st.sampled_from(IMPLS), layout=paged(min_seqs=0, max_seqs=4), sink=st.integers(0, 20),
       window=st.integers(0, 70), spare=st.integers(0, 5), idx_i64=st.booleans())
def test_sink_window_matches_loop(impl, layout, sink, window, spare, idx_i64):
    """Random paged batches: shuffled block ids, garbage past the used blocks, lengths 0 and across edges."""
    _check_window(impl, layout, sink, window, spare, torch.int64 if idx_i64 else I32)


# Block size 4; sequence 0 uses blocks (5, 2, 7), the rest of the table is garbage that must not be read.
CASES = [
    pytest.param(10, 2, 3, id="disjoint"),
    pytest.param(6, 4, 3, id="overlap"),
    pytest.param(7, 4, 3, id="touching"),
    pytest.param(3, 4, 3, id="L-below-sink"),
    pytest.param(0, 4, 3, id="L-zero"),
    pytest.param(12, 4, 0, id="window-zero"),
    pytest.param(12, 0, 5, id="sink-zero"),
    pytest.param(12, 0, 0, id="nothing"),
    pytest.param(12, 8, 8, id="everything-once"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("L,sink,window", CASES)
def test_sink_window_edges(impl, L, sink, window):
    layout = Paged(4, 9, (L,), ((5, 2, 7)[:-(-L // 4)],), 4, 99)
    indices, counts = _check_window(impl, layout, sink, window, spare=1)
    # each position at most once, in position order
    row = [s for s in indices[0].tolist() if s != -1]
    assert len(row) == len(set(row)) == min(L, sink + window)


@given(layout=paged(min_seqs=0, max_seqs=4), sink=st.integers(0, 6), window=st.integers(0, 20), spare=st.integers(0, 3))
def test_to_csr_packs_rows_in_order(layout, sink, window, spare):
    indices, counts = _window("public", layout, sink, window, sink + window + spare)
    indptr, flat = to_csr(indices, counts)
    rows = sink_window_ref(layout, sink, window)
    packed = [s for r in rows for s in r]
    assert indptr.dtype == I32 and flat.dtype == I32
    assert indptr.tolist() == [0] + torch.tensor([len(r) for r in rows], dtype=torch.long).cumsum(0).tolist()
    assert flat.shape == (indices.numel(),)  # fixed capacity, never data-dependent
    assert flat.tolist() == packed + [-1] * (indices.numel() - len(packed))


# ------------------------------------------------------------------------------------------- lightning indexer

def _ints(gen: torch.Generator, *shape: int, low: int = -2, high: int = 3, dtype=torch.float32) -> torch.Tensor:
    """Small integers: every score is exact in float32 and float64, so ties are real and comparable."""
    return torch.randint(low, high, shape, generator=gen).to(dtype)


def _lightning_case(layout: Paged, data, dtype, heads: int = 3, dim: int = 8):
    gen = generator(data.draw(seeds))
    B = len(layout.seq_lens)
    T = data.draw(st.integers(1, 6))
    query_seq, query_pos = [], []
    for _ in range(T):
        b = data.draw(st.integers(-1, B - 1))
        n = layout.seq_lens[b] if b >= 0 else 0
        # usually a real position (< seq_len); sometimes past it, where seq_len still bounds what is visible
        pos = data.draw(st.integers(0, max(n - 1, 0)) | st.integers(0, layout.capacity - 1)) if b >= 0 else 0
        query_seq.append(b)
        query_pos.append(pos)
    cache = fill_paged_cache(layout, dim, torch.float32, gen)  # NaN outside the written rows
    written = ~torch.isnan(cache)
    cache = torch.where(written, _ints(gen, *cache.shape), cache).to(dtype)
    q_idx, weights = _ints(gen, T, heads, dim, dtype=dtype), _ints(gen, T, heads, low=-1, high=3, dtype=dtype) / 2
    return q_idx, weights, cache, query_seq, query_pos


def _lightning(impl, q_idx, weights, cache, layout, query_seq, query_pos, topk):
    args = (q_idx, weights, cache, layout.block_table(), layout.seq_lens_tensor(), torch.tensor(query_seq, dtype=I32),
            torch.tensor(query_pos, dtype=I32))
    if impl == "raw":
        return torch.ops.mla.lightning_index_ref(*args, topk)
    return lightning_index(*args, topk=topk)


@given(impl=st.sampled_from(IMPLS), layout=paged(min_seqs=1), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       topk=st.integers(1, 40), data=st.data())
def test_lightning_index_matches_loop(impl, layout, dtype, topk, data):
    q_idx, weights, cache, query_seq, query_pos = _lightning_case(layout, data, dtype)
    got = _lightning(impl, q_idx, weights, cache, layout, query_seq, query_pos, topk)
    assert got.dtype == I32 and got.shape == (len(query_seq), topk)
    assert got.tolist() == lightning_ref(q_idx, weights, cache, layout, query_seq, query_pos, topk)


@pytest.mark.parametrize("impl", IMPLS)
def test_lightning_index_is_causal_and_pads(impl):
    """Future positions are never picked even when they would score highest; fewer visible than topk -> -1."""
    layout = Paged(4, 3, (10,), ((2, 0, 1),), 3, -1)
    dim = 4
    cache = torch.zeros(3, 4, dim)
    for p in range(10):
        blk, off = layout.where(0, p)
        cache[blk, off] = float(p + 1)  # later positions score higher
    q_idx, weights = torch.ones(2, 1, dim), torch.ones(2, 1)
    got = _lightning(impl, q_idx, weights, cache, layout, [0, 0], [2, 9], topk=5)
    slot = [layout.where(0, p)[0] * 4 + layout.where(0, p)[1] for p in range(10)]
    assert got[0].tolist() == [slot[2], slot[1], slot[0], -1, -1]  # sees positions 0..2 only
    assert got[1].tolist() == [slot[9], slot[8], slot[7], slot[6], slot[5]]


@pytest.mark.parametrize("impl", IMPLS)
def test_lightning_index_ties_by_position_and_padding_tokens(impl):
    layout = Paged(2, 5, (5, 3), ((3, 1, 0), (2, 4)), 3, 77)
    cache = torch.ones(5, 2, 4)  # every key equal: all scores tie
    q_idx, weights = torch.ones(3, 2, 4), torch.ones(3, 2)
    got = _lightning(impl, q_idx, weights, cache, layout, [0, -1, 1], [4, 0, 1], topk=4)
    assert got[0].tolist() == [6, 7, 2, 3]  # positions 0, 1, 2, 3 of sequence 0: blocks 3, 3, 1, 1
    assert got[1].tolist() == [-1] * 4  # a padding token (query_seq -1)
    assert got[2].tolist() == [4, 5, -1, -1]  # positions 0, 1 of sequence 1


# ------------------------------------------------------------------------------------------- index-key cache write

@given(impl=st.sampled_from(IMPLS), bs=st.sampled_from([1, 16]), data=st.data(), seed=seeds)
def test_write_index_cache_matches_loop(impl, bs, data, seed):
    gen = generator(seed)
    num_blocks = data.draw(st.integers(1, 4))
    valid = data.draw(st.lists(st.integers(0, num_blocks * bs - 1), unique=True, max_size=10))
    slots = data.draw(st.permutations(valid + [-1] * data.draw(st.integers(0, 3))))
    k_idx = randn(gen, len(slots), 8, dtype=torch.float32)
    cache = randn(gen, num_blocks, bs, 8, dtype=torch.bfloat16)
    cache[0, 0] = NAN
    expected = cache.clone()
    for t, s in enumerate(slots):
        if s != -1:
            expected[s // bs, s % bs] = k_idx[t].to(torch.bfloat16)
    slot_mapping = torch.tensor(slots, dtype=I32)
    if impl == "raw":
        assert torch.ops.mla.write_index_cache_ref(k_idx, slot_mapping, cache) is None
    else:
        assert write_index_cache(k_idx, slot_mapping, cache) is None
    assert_bitwise_equal(cache, expected, "index-key cache after write")


# ------------------------------------------------------------------------------------------- torch.compile

def _sparse_step(q, kv8, table, seq_lens, latent, k_pe, slots, k_idx, k_idx_cache, q_idx, weights, qseq, qpos):
    """One V3.2-style decode step: both cache writes, both indexers, CSR, sparse and dense fp8 decode."""
    ops.write_latent_cache_fp8(latent, k_pe, slots, kv8)
    ops.write_index_cache(k_idx, slots, k_idx_cache)
    top = ops.lightning_index(q_idx, weights, k_idx_cache, table, seq_lens, qseq, qpos, topk=6)
    window, counts = ops.sink_window_indices(table, seq_lens, block_size=4, sink=2, window=3, max_kv=6)
    indptr, flat = ops.to_csr(window, counts)
    out_top, lse_top = ops.sparse_decode(q, kv8, top[:, None], 0.2, kv_lora_rank=128)
    out_win, lse_win = ops.sparse_decode(q, kv8, window[:, None], 0.2, kv_lora_rank=128)
    out_all, lse_all = ops.decode_fp8(q, kv8, table, seq_lens, 0.2, kv_lora_rank=128)
    return out_top, lse_top, out_win, lse_win, out_all, lse_all, indptr, flat


def _step_inputs(B: int, seed: int):
    gen = generator(seed)
    bs, mb, d = 4, 4, 8
    nb = B * mb + 2
    table = torch.randperm(nb, generator=gen)[:B * mb].reshape(B, mb).to(I32)
    seq_lens = torch.randint(1, mb * bs + 1, (B,), generator=gen).to(I32)
    kv8 = fill_fp8_cache(Paged(bs, nb, tuple(seq_lens.tolist()), tuple(tuple(r) for r in table.tolist()), mb, -1),
                         128, 16, gen)
    last = seq_lens.long() - 1  # this step's token is the last of each sequence
    slots = (table.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs).to(I32)
    k_idx_cache = randn(gen, nb, bs, d, dtype=torch.float32)
    f32 = torch.float32
    return (randn(gen, B, 1, 2, 144, dtype=f32), kv8, table, seq_lens, randn(gen, B, 128, dtype=f32),
            randn(gen, B, 16, dtype=f32), slots, randn(gen, B, d, dtype=f32), k_idx_cache,
            randn(gen, B, 2, d, dtype=f32), randn(gen, B, 2, dtype=f32), torch.arange(B, dtype=I32), last.to(I32))


def test_sparse_step_compiles_fullgraph_dynamic_and_matches_eager(fresh_dynamo):
    compiled = torch.compile(_sparse_step, fullgraph=True, dynamic=True)
    for B in (3, 5):
        args = _step_inputs(B, seed=B)
        eager_args = [a.clone() for a in args]
        want = _sparse_step(*eager_args)
        got = compiled(*args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert_bitwise_equal(args[1], eager_args[1], "fp8 cache written under compile")
        assert_bitwise_equal(args[8], eager_args[8], "index-key cache written under compile")
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1  # batch 3 and 5 share one dynamic graph


# ------------------------------------------------------------------------------------------- opcheck

def _opcheck_cases():
    gen = generator(11)
    table = torch.randperm(6, generator=gen).to(I32).reshape(2, 3)
    lens = torch.tensor([9, 0], dtype=I32)
    k_cache = randn(gen, 6, 4, 8, dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 17], dtype=I32)
    return [
        (torch.ops.mla.sink_window_indices_ref.default, (table, lens, 4, 2, 3, 7)),
        (torch.ops.mla.lightning_index_ref.default,
         (randn(gen, 3, 2, 8, dtype=torch.float32), randn(gen, 3, 2, dtype=torch.float32), k_cache, table, lens,
          torch.tensor([0, -1, 0], dtype=I32), torch.tensor([8, 0, 3], dtype=I32), 5)),
        (torch.ops.mla.write_index_cache_ref.default, (randn(gen, 3, 8, dtype=torch.float32), slots, k_cache.clone())),
    ]


@pytest.mark.parametrize("case", range(3), ids=["sink-window", "lightning", "write-index"])
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


# ------------------------------------------------------------------------------------------- malformed inputs

LAYOUT = Paged(4, 6, (9, 2), ((4, 1, 0), (5,)), 3, -1)


def _args(kind: str) -> dict:
    gen = generator(12)
    table, lens = LAYOUT.block_table(), LAYOUT.seq_lens_tensor()
    if kind == "window":
        return dict(block_table=table, seq_lens=lens, block_size=4, sink=2, window=3, max_kv=5)
    cache = randn(gen, 6, 4, 8, dtype=torch.bfloat16)
    if kind == "lightning":
        return dict(q_idx=randn(gen, 2, 3, 8, dtype=torch.float32), weights=randn(gen, 2, 3, dtype=torch.float32),
                    k_idx_cache=cache, block_table=table, seq_lens=lens, query_seq=torch.tensor([1, 0], dtype=I32),
                    query_pos=torch.tensor([1, 8], dtype=I32), topk=4)
    return dict(k_idx=randn(gen, 3, 8, dtype=torch.float32), slot_mapping=torch.tensor([0, -1, 23], dtype=I32),
                k_idx_cache=cache)


SW, LI, WI = "mla.sink_window_indices: ", "mla.lightning_index: ", "mla.write_index_cache: "
BAD = [
    pytest.param("window", dict(max_kv=4), ValueError, SW + "max_kv must be >= sink \\+ window = 5", id="sw-max-kv"),
    pytest.param("window", dict(sink=-1), ValueError, SW + "sink and window must be >= 0", id="sw-negative-sink"),
    pytest.param("window", dict(block_size=0), ValueError, SW + "block_size must be positive", id="sw-block-size"),
    pytest.param("window", dict(seq_lens=torch.tensor([9, 2, 1], dtype=I32)), ValueError,
                 SW + "seq_lens must have shape", id="sw-seq-lens-batch"),
    pytest.param("window", dict(seq_lens=torch.tensor([13, 2], dtype=I32)), ValueError, SW + "seq_lens values must lie",
                 id="sw-seq-len-past-table"),
    pytest.param("window", dict(block_table=torch.tensor([[4, -1, 0], [5, -1, -1]], dtype=I32)), ValueError,
                 SW + "block_table values must lie", id="sw-negative-used-block"),
    pytest.param("window", dict(block_table=LAYOUT.block_table().float()), TypeError,
                 SW + "block_table must have dtype", id="sw-float-table"),
    pytest.param("lightning", dict(weights=torch.ones(2, 2)), ValueError, LI + "weights must have shape",
                 id="li-weights"),
    pytest.param("lightning", dict(k_idx_cache=torch.ones(6, 4, 16)), ValueError, LI + "k_idx_cache must have shape",
                 id="li-key-dim"),
    pytest.param("lightning", dict(query_seq=torch.tensor([2, 0], dtype=I32)), ValueError,
                 LI + "query_seq values must lie", id="li-query-seq-past-batch"),
    pytest.param("lightning", dict(query_pos=torch.tensor([12, 0], dtype=I32)), ValueError,
                 LI + "query_pos values must lie", id="li-query-pos-past-table"),
    pytest.param("lightning", dict(query_pos=torch.tensor([1.0, 8.0])), TypeError, LI + "query_pos must have dtype",
                 id="li-float-pos"),
    pytest.param("lightning", dict(topk=0), ValueError, LI + "topk must be positive", id="li-topk"),
    pytest.param("lightning", dict(block_table=torch.tensor([[4, 9, 0], [5, -1, -1]], dtype=I32)), ValueError,
                 LI + "block_table values must lie", id="li-block-past-end"),
    pytest.param("write", dict(k_idx_cache=torch.ones(6, 4, 4)), ValueError, WI + "k_idx_cache must have shape",
                 id="wi-dim"),
    pytest.param("write", dict(slot_mapping=torch.tensor([0, -1, 24], dtype=I32)), ValueError,
                 WI + "slot_mapping values must lie", id="wi-slot-past-end"),
    pytest.param("write", dict(k_idx=torch.ones(3, 8, dtype=I32)), TypeError, WI + "k_idx must have dtype",
                 id="wi-dtype"),
]
RAW = {"window": torch.ops.mla.sink_window_indices_ref, "lightning": torch.ops.mla.lightning_index_ref,
       "write": torch.ops.mla.write_index_cache_ref}
PUBLIC = {"window": lambda block_table, seq_lens, **kw: sink_window_indices(block_table, seq_lens, **kw),
          "lightning": lambda topk, **rest: lightning_index(**rest, topk=topk), "write": write_index_cache}


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("kind,change,exc,match", BAD)
def test_rejects_malformed(kind, change, exc, match, raw):
    args = {**_args(kind), **change}
    before = args["k_idx_cache"].clone() if kind == "write" else None
    with pytest.raises(exc, match=match):
        (RAW if raw else PUBLIC)[kind](**args)
    if before is not None:
        assert_bitwise_equal(args["k_idx_cache"], before, "k_idx_cache after a rejected call")


# ------------------------------------------------------------------------------------------- shared selection

@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_select_topk_equals_stable_sort(seed, compiled, fresh_dynamo):
    """``select_topk`` (topk on int64 keys for float32 scores; what every lightning_index implementation
    uses) picks exactly what a stable descending sort of the float64 scores picks: ties by position,
    -0.0 tied with 0.0, -inf last; also under torch.compile(fullgraph=True, dynamic=True)."""
    from mla_compile.ops.sparse_index import select_topk

    gen = generator(seed)
    T, L = 7, 50 + seed
    scores = torch.randint(-3, 4, (T, L), generator=gen).float() / 2  # many ties
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    scores[torch.rand(T, L, generator=gen) < 0.3] = float("-inf")
    scores[0, :5] = torch.tensor([1e30, -1e-40, 1e-40, float("-inf"), -1e30])  # extremes and subnormals
    scores[1] = float("-inf")
    fn = torch.compile(select_topk, fullgraph=True, dynamic=True) if compiled else select_topk
    for topk in (1, 20, L, L + 5):
        want = torch.sort(scores.double(), dim=-1, descending=True, stable=True).indices[:, :topk]
        assert torch.equal(fn(scores, topk), want), topk
        assert torch.equal(select_topk(scores.double(), topk), want)
