"""``mla::sparse_decode`` against a float64 loop over the listed slots, against dense decode when every
position is listed, with -1 padding, on bf16/fp32/fp64 and fp8 caches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from mla_compile.ops import decode, decode_fp8, sink_window_indices, sparse_decode
from .ref64 import (DTYPES, F64, IMPLS, LSE_TOL, NAN, OUT_TOL, RANK, ROPE, Paged, assert_bitwise_equal, decode_ref64,
                    fill_paged_cache, generator, paged, randn, seeds)
from .ref_sparse import dequantize64, fill_fp8_cache, sink_window_ref, sparse_decode_ref64

I32 = torch.int32
FP8_RANK = 128  # the fp8 format quantizes groups of 128 latents


def _run(impl, q, cache, indices, scale, rank, squeeze=False):
    if impl == "raw":
        return torch.ops.mla.sparse_decode_ref(q, cache, indices, scale, rank)
    if squeeze:
        out, lse = sparse_decode(q[:, 0], cache, indices[:, 0], scale, kv_lora_rank=rank)
        assert out.dim() == 3 and lse.dim() == 2
        return out.unsqueeze(1), lse.unsqueeze(1)
    return sparse_decode(q, cache, indices, scale, kv_lora_rank=rank)


def _rows(cache: torch.Tensor, rank: int) -> torch.Tensor:
    """Every slot's row in float64 (fp8 rows dequantized field by field)."""
    flat = cache.reshape(-1, cache.shape[-1])
    return dequantize64(flat, rank) if cache.dtype == torch.uint8 else flat.to(F64)


@pytest.mark.parametrize("dtype", DTYPES)
@given(impl=st.sampled_from(IMPLS), fp8=st.booleans(), B=st.integers(1, 3), s_q=st.integers(1, 3),
       heads=st.integers(1, 3), num_blocks=st.integers(1, 4), bs=st.sampled_from([1, 16]), topk=st.integers(1, 12),
       squeeze=st.booleans(), idx_i64=st.booleans(), data=st.data())
def test_sparse_decode_matches_loop(dtype, impl, fp8, B, s_q, heads, num_blocks, bs, topk, squeeze, idx_i64, data):
    """Distinct listed slots in any order, -1 anywhere; unlisted rows are NaN (fp8: 0xFF bytes)."""
    gen = generator(data.draw(seeds))
    rank, rope = (FP8_RANK, ROPE) if fp8 else (RANK, ROPE)
    n_slots = num_blocks * bs
    slots = [[data.draw(st.lists(st.integers(0, n_slots - 1), unique=True, max_size=topk)) for _ in range(s_q)]
             for _ in range(B)]
    padded = [[data.draw(st.permutations(s + [-1] * (topk - len(s)))) for s in row] for row in slots]
    listed = sorted({s for row in slots for r in row for s in r})
    # Only listed slots hold data; a one-sequence layout over them gives the cache builders a map.
    order = data.draw(st.permutations(listed))
    layout = Paged(1, n_slots, (len(order),), (tuple(order),), max(len(order), 1), -1)
    flat = fill_fp8_cache(layout, rank, rope, gen) if fp8 else fill_paged_cache(layout, rank + rope, dtype, gen)
    cache = flat.reshape(num_blocks, bs, -1)
    q = randn(gen, B, s_q, heads, rank + rope, dtype=dtype)
    scale = (rank + rope) ** -0.5
    indices = torch.tensor(padded, dtype=torch.int64 if idx_i64 else I32).reshape(B, s_q, topk)
    ref_out, ref_lse = sparse_decode_ref64(q, _rows(cache, rank), padded, scale, rank)
    before = cache.clone()

    out, lse = _run(impl, q, cache, indices, scale, rank, squeeze and s_q == 1)

    assert out.shape == (B, s_q, heads, rank) and out.dtype == dtype
    assert lse.shape == (B, s_q, heads) and lse.dtype == torch.float32
    assert_close(out.to(F64), ref_out, **OUT_TOL[dtype])
    assert_close(lse.to(F64), ref_lse, **LSE_TOL[dtype])
    empty = torch.isneginf(ref_lse)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))  # all -1: exactly 0 / -inf
    assert not torch.isnan(out).any()
    assert_bitwise_equal(cache, before, "kv_cache (sparse decode must not write it)")


def _all_positions(layout: Paged, shuffle: torch.Generator | None) -> torch.Tensor:
    """``[B, 1, capacity]``: every slot below seq_len (optionally in a random order), -1 padded."""
    rows = sink_window_ref(layout, sink=layout.capacity, window=0)
    if shuffle is not None:
        rows = [[r[i] for i in torch.randperm(len(r), generator=shuffle).tolist()] for r in rows]
    padded = [r + [-1] * (layout.capacity - len(r)) for r in rows]
    return torch.tensor(padded, dtype=I32).reshape(-1, 1, layout.capacity)


@given(layout=paged(min_seqs=1), shuffle=st.booleans(), seed=seeds)
def test_all_positions_equal_dense_decode(layout, shuffle, seed):
    gen = generator(seed)
    cache = fill_paged_cache(layout, RANK + ROPE, torch.float32, gen)
    q = randn(gen, len(layout.seq_lens), 1, 2, RANK + ROPE, dtype=torch.float32)
    indices = _all_positions(layout, gen if shuffle else None)
    dense = decode(q, cache, layout.block_table(), layout.seq_lens_tensor(), 0.1, kv_lora_rank=RANK)
    sparse = sparse_decode(q, cache, indices, 0.1, kv_lora_rank=RANK)
    assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_all_positions_equal_dense_fp8_decode():
    layout = Paged(16, 6, (20, 0, 33), ((4, 1), (), (0, 5, 2)), 3, -1)
    gen = generator(21)
    cache = fill_fp8_cache(layout, FP8_RANK, ROPE, gen)
    q = randn(gen, 3, 1, 2, FP8_RANK + ROPE, dtype=torch.bfloat16)
    dense = decode_fp8(q, cache, layout.block_table(), layout.seq_lens_tensor(), 0.1, kv_lora_rank=FP8_RANK)
    sparse = sparse_decode(q, cache, _all_positions(layout, gen), 0.1, kv_lora_rank=FP8_RANK)
    assert_close(sparse, dense, **OUT_TOL[torch.bfloat16])
    assert torch.isneginf(sparse[1][1]).all()  # the empty sequence


@pytest.mark.parametrize("sink,window", [(2, 5), (4, 40), (0, 3)])
def test_sink_window_selection_equals_restricted_dense_attention(sink, window):
    """End to end: the indexer's slots fed to sparse decode equal a loop over those positions only."""
    layout = Paged(16, 8, (40, 3, 0, 17), ((6, 2, 0), (7,), (), (1, 3)), 3, -1)
    gen = generator(22)
    cache = fill_paged_cache(layout, RANK + ROPE, torch.float64, gen)
    q = randn(gen, 4, 1, 3, RANK + ROPE, dtype=torch.float64)
    indices, _ = sink_window_indices(layout.block_table(), layout.seq_lens_tensor(), block_size=16, sink=sink,
                                     window=window, max_kv=sink + window)
    out, lse = sparse_decode(q, cache, indices[:, None], 0.2, kv_lora_rank=RANK)
    rows = sink_window_ref(layout, sink, window)
    ref_out, ref_lse = sparse_decode_ref64(q, cache.reshape(-1, RANK + ROPE), [[r] for r in rows], 0.2, RANK)
    assert_close(out, ref_out, **OUT_TOL[torch.float64])
    assert_close(lse.double(), ref_lse, **LSE_TOL[torch.float64])
    if sink + window >= 40:  # the window covers every token: dense decode
        dense_out, _ = decode_ref64(q, cache, layout, 0.2, RANK)
        assert_close(out, dense_out, **OUT_TOL[torch.float64])


@pytest.mark.parametrize("impl", IMPLS)
def test_all_invalid_gives_zero_and_neg_inf(impl):
    cache = torch.full((2, 4, RANK + ROPE), NAN)
    q = randn(generator(23), 2, 2, 3, RANK + ROPE, dtype=torch.float32)
    out, lse = _run(impl, q, cache, torch.full((2, 2, 5), -1, dtype=I32), 0.1, RANK)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ------------------------------------------------------------------------------------------- opcheck

@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_opcheck(fp8):
    gen = generator(24)
    rank = FP8_RANK if fp8 else RANK
    layout = Paged(4, 6, (9, 5), ((3, 0, 5), (1, 4)), 3, -1)
    if fp8:
        cache = fill_fp8_cache(layout, rank, ROPE, gen)
    else:
        cache = fill_paged_cache(layout, rank + ROPE, torch.bfloat16, gen)
    indices = torch.tensor([[[12, 0, -1, 3]], [[-1, -1, -1, -1]]], dtype=I32)
    q = randn(gen, 2, 1, 2, rank + ROPE, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.mla.sparse_decode_ref.default, (q, cache, indices, 0.1, rank))


# ------------------------------------------------------------------------------------------- malformed inputs

def _args() -> dict:
    gen = generator(25)
    return dict(q=randn(gen, 2, 1, 2, RANK + ROPE, dtype=torch.float32), kv_cache=randn(gen, 3, 4, RANK + ROPE,
                dtype=torch.float32), indices=torch.tensor([[[0, 5, -1]], [[11, -1, -1]]], dtype=I32), scale=0.1,
                kv_lora_rank=RANK)


S = "mla.sparse_decode: "
BAD = [
    pytest.param(dict(indices=torch.tensor([[[0, 12, -1]], [[11, -1, -1]]], dtype=I32)), ValueError,
                 S + "indices values must lie in \\[0, 12\\)", id="slot-past-end"),
    pytest.param(dict(indices=torch.tensor([[[0, -2, -1]], [[11, -1, -1]]], dtype=I32)), ValueError,
                 S + "indices values must lie", id="slot-negative-not-invalid"),
    pytest.param(dict(indices=torch.zeros(2, 3, dtype=I32)), ValueError, S + "indices must have 3 dims",
                 id="indices-rank"),
    pytest.param(dict(indices=torch.zeros(2, 2, 3, dtype=I32)), ValueError, S + "indices must have shape",
                 id="indices-s_q"),
    pytest.param(dict(indices=torch.zeros(2, 1, 3)), TypeError, S + "indices must have dtype", id="float-indices"),
    pytest.param(dict(kv_cache=torch.zeros(3, 4, 40)), ValueError, S + "kv_cache must have shape", id="cache-dim"),
    pytest.param(dict(kv_cache=torch.zeros(3, 4, RANK + ROPE, dtype=torch.uint8)), ValueError,
                 S + "kv_lora_rank must be a multiple of 128 with an fp8", id="fp8-rank"),
    pytest.param(dict(kv_cache=torch.zeros(3, 4, RANK + ROPE, dtype=I32)), TypeError, S + "kv_cache must have dtype",
                 id="cache-dtype"),
    pytest.param(dict(kv_lora_rank=0), ValueError, S + "kv_lora_rank must be in", id="rank-zero"),
    pytest.param(dict(q=torch.zeros(2, 1, 2, 1, RANK + ROPE)), ValueError, S + "q must have 4 dims", id="q-rank"),
]


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("change,exc,match", BAD)
def test_rejects_malformed(change, exc, match, raw):
    args = {**_args(), **change}
    if raw:
        fn = torch.ops.mla.sparse_decode_ref
    else:
        def fn(q, kv_cache, indices, scale, kv_lora_rank):
            return sparse_decode(q, kv_cache, indices, scale, kv_lora_rank=kv_lora_rank)
    with pytest.raises(exc, match=match):
        fn(**args)
