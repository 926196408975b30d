"""``mla::decode`` against a per-sequence float64 loop over a NaN-poisoned paged cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from mla_compile.ops import decode
from .ref64 import (DEVICES, DS_HEADS, DS_RANK, DS_ROPE, DTYPES, IMPLS, LSE_TOL, OUT_TOL, RANK, ROPE, Paged,
                   assert_bitwise_equal, decode_ref64, fill_paged_cache, generator, paged, randn, seeds)


def _run(impl: str, q, cache, block_table, seq_lens, scale, rank, squeeze: bool):
    """Call the op; with ``squeeze`` (s_q = 1 only) the public function gets a 3-D q."""
    if impl == "raw":
        return torch.ops.mla.decode_ref(q, cache, block_table, seq_lens, scale, rank)
    if squeeze:
        out, lse = decode(q[:, 0], cache, block_table, seq_lens, scale, kv_lora_rank=rank)
        assert out.dim() == 3 and lse.dim() == 2
        return out.unsqueeze(1), lse.unsqueeze(1)
    return decode(q, cache, block_table, seq_lens, scale, kv_lora_rank=rank)


def _check(layout: Paged, dtype, device, impl, s_q, heads, rank, rope, seed, idx_dtype=torch.int32,
           squeeze=False):
    gen = generator(seed)
    dim = rank + rope
    cache = fill_paged_cache(layout, dim, dtype, gen).to(device)
    B = len(layout.seq_lens)
    q = randn(gen, B, s_q, heads, dim, dtype=dtype, device=device)
    scale = dim ** -0.5
    ref_out, ref_lse = decode_ref64(q, cache, layout, scale, rank)
    before = cache.clone()

    out, lse = _run(impl, q, cache, layout.block_table(idx_dtype, device), layout.seq_lens_tensor(device=device),
                    scale, rank, squeeze)

    assert out.shape == (B, s_q, heads, rank) and out.dtype == dtype
    assert lse.shape == (B, s_q, heads) and lse.dtype == torch.float32
    assert_close(out.cpu().to(torch.float64), ref_out, **OUT_TOL[dtype])
    assert_close(lse.cpu().to(torch.float64), ref_lse, **LSE_TOL[dtype])
    # A query that sees no row is exactly 0 / -inf; nothing NaN leaks from the poisoned rows.
    empty = torch.isneginf(ref_lse)
    assert torch.equal(out.cpu()[empty], torch.zeros_like(out.cpu()[empty]))
    assert not torch.isnan(out).any()
    assert_bitwise_equal(cache, before, "kv_cache (decode must not write it)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(layout=paged(min_seqs=1), s_q=st.integers(1, 3), heads=st.integers(1, 4), squeeze=st.booleans(),
       idx_i64=st.booleans(), seed=seeds)
def test_decode_matches_loop(device, impl, dtype, layout, s_q, heads, squeeze, idx_i64, seed):
    _check(layout, dtype, device, impl, s_q, heads, RANK, ROPE, seed,
           idx_dtype=torch.int64 if idx_i64 else torch.int32, squeeze=squeeze and s_q == 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_speculative_causal_rule(impl):
    """s_q = 3 over 2 rows: query 0 sees nothing, query 1 row 0 only, query 2 both (docstring rule)."""
    layout = Paged(16, 2, (2,), ((1,),), 1, -1)
    gen = generator(3)
    cache = fill_paged_cache(layout, RANK + ROPE, torch.float64, gen)
    q = randn(gen, 1, 3, 2, RANK + ROPE, dtype=torch.float64)
    out, lse = _run(impl, q, cache, layout.block_table(), layout.seq_lens_tensor(), 0.3, RANK, False)
    assert torch.isneginf(lse[0, 0]).all() and torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    row0 = cache[1, 0]
    # One visible row: softmax weight 1, so out is that row's value and lse its natural-log score.
    assert_close(out[0, 1], row0[:RANK].expand(2, RANK), rtol=1e-12, atol=1e-12)
    assert_close(lse[0, 1].double(), (q[0, 1] @ row0) * 0.3, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(lse[0, 2]).all()


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_deepseek_dims(dtype, s_q):
    """DeepSeek's 512 + 64 rows and 16 heads, block size 64, shuffled blocks, one empty sequence."""
    perm = tuple(torch.randperm(6, generator=generator(5)).tolist())
    layout = Paged(64, 6, (70, 0, 129), (perm[:2], (), perm[2:5]), 3, -1)
    tol = OUT_TOL[dtype] if dtype != torch.float32 else dict(rtol=2e-5, atol=2e-5)
    gen = generator(6)
    dim = DS_RANK + DS_ROPE
    cache = fill_paged_cache(layout, dim, dtype, gen)
    q = randn(gen, 3, s_q, DS_HEADS, dim, dtype=dtype)
    scale = 192 ** -0.5
    ref_out, ref_lse = decode_ref64(q, cache, layout, scale, DS_RANK)
    out, lse = decode(q, cache, layout.block_table(), layout.seq_lens_tensor(), scale, kv_lora_rank=DS_RANK)
    assert_close(out.double(), ref_out, **tol)
    assert_close(lse.double(), ref_lse, **LSE_TOL[dtype])
