"""``mla::gather_latent_cache`` against a per-token loop: ranges from mid-block, padding rows zeroed."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_compile.ops import gather_latent_cache
from .ref64 import (DEVICES, DS_RANK, DS_ROPE, DTYPES, IMPLS, NAN, RANK, ROPE, Paged, assert_bitwise_equal,
                    fill_paged_cache, gather_ref64, generator, paged, seeds)


@st.composite
def ranges(draw, layout: Paged) -> tuple[list[int], list[int]]:
    """(starts, lengths) inside each sequence's written tokens; starts fall anywhere, mid-block too."""
    starts, lengths = [], []
    for n_tok in layout.seq_lens:
        start = draw(st.integers(0, n_tok))
        starts.append(start)
        lengths.append(draw(st.integers(0, n_tok - start)))
    return starts, lengths


def _call(impl, cache, block_table, cu, starts, out):
    if impl == "raw":
        assert torch.ops.mla.gather_latent_cache_ref(cache, block_table, cu, starts, out) is None
    else:
        assert gather_latent_cache(cache, block_table, cu, starts, out) is None


def _check(impl, layout, cache, starts, lengths, pad, out_dtype, idx_dtype=torch.int32, device="cpu"):
    rows = sum(lengths) + pad
    expected = gather_ref64(cache, layout, starts, lengths, rows, out_dtype)
    out = torch.full((rows, cache.shape[-1]), NAN, dtype=out_dtype, device=device)  # poisoned workspace
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=idx_dtype, device=device)
    before = cache.clone()

    _call(impl, cache, layout.block_table(idx_dtype, device), cu, torch.tensor(starts, dtype=idx_dtype,
                                                                                device=device), out)

    # A gather is a copy: exact, padding rows exactly 0, and the cache is untouched.
    assert_bitwise_equal(out, expected, "workspace after gather")
    assert_bitwise_equal(cache, before, "kv_cache (gather must not write it)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data(), layout=paged(), pad=st.integers(0, 5), out_f32=st.booleans(), idx_i64=st.booleans(),
       seed=seeds)
def test_gather_matches_loop(device, impl, dtype, data, layout, pad, out_f32, idx_i64, seed):
    starts, lengths = data.draw(ranges(layout))
    cache = fill_paged_cache(layout, RANK + ROPE, dtype, generator(seed)).to(device)
    _check(impl, layout, cache, starts, lengths, pad, torch.float32 if out_f32 else dtype,
           torch.int64 if idx_i64 else torch.int32, device)


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_mid_block_start(impl):
    """Tokens 13..40 of a block-16 sequence: they start 13 rows into its first block and span three."""
    layout = Paged(16, 5, (41,), ((4, 0, 2),), 3, -1)
    cache = fill_paged_cache(layout, RANK + ROPE, torch.float32, generator(31))
    _check(impl, layout, cache, [13], [28], 3, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_deepseek_dims(dtype):
    perm = tuple(torch.randperm(7, generator=generator(32)).tolist())
    layout = Paged(64, 7, (150, 64, 0), (perm[:3], perm[3:4], ()), 3, -1)
    cache = fill_paged_cache(layout, DS_RANK + DS_ROPE, dtype, generator(33))
    _check("public", layout, cache, [70, 1, 0], [80, 63, 0], 4, dtype)
