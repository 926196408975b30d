"""``mla::write_latent_cache`` against a per-token float64 loop; untouched rows must keep their bits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mla_compile
from mla_compile.ops import write_latent_cache
from .ref64 import (BLOCK_SIZES, DEVICES, DS_ROPE, DS_RANK, DTYPES, IMPLS, NAN, RANK, ROPE, assert_bitwise_equal,
                   generator, randn, seeds, write_ref64)


@st.composite
def slot_mappings(draw) -> tuple[int, int, list[int]]:
    """(block_size, num_blocks, slots): distinct slots in shuffled order with -1 padding mixed in."""
    bs = draw(st.sampled_from(BLOCK_SIZES))
    num_blocks = draw(st.integers(1, 6))
    valid = draw(st.lists(st.integers(0, num_blocks * bs - 1), unique=True, max_size=24))
    slots = valid + [-1] * draw(st.integers(0, 4))
    return bs, num_blocks, list(draw(st.permutations(slots)))


def _call(impl: str, latent, k_pe, slot_mapping, cache) -> None:
    if impl == "raw":
        assert torch.ops.mla.write_latent_cache_ref(latent, k_pe, slot_mapping, cache) is None
    else:
        assert write_latent_cache(latent, k_pe, slot_mapping, cache) is None


def _half_poisoned_cache(num_blocks: int, bs: int, dim: int, dtype: torch.dtype, gen: torch.Generator):
    """Random rows with about half of them NaN, so both kinds of untouched row are checked."""
    cache = randn(gen, num_blocks, bs, dim, dtype=dtype)
    nan_rows = torch.rand(num_blocks, bs, generator=gen) < 0.5
    cache[nan_rows] = NAN
    return cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(case=slot_mappings(), src_f32=st.booleans(), slot_i64=st.booleans(), seed=seeds)
def test_write_matches_loop(device, impl, dtype, case, src_f32, slot_i64, seed):
    bs, num_blocks, slots = case
    gen = generator(seed)
    src_dtype = torch.float32 if src_f32 else dtype
    T = len(slots)
    latent = randn(gen, T, RANK, dtype=src_dtype, device=device)
    k_pe = randn(gen, T, ROPE, dtype=src_dtype, device=device)
    cache = _half_poisoned_cache(num_blocks, bs, RANK + ROPE, dtype, gen).to(device)
    expected = write_ref64(cache, latent, k_pe, slots)
    slot_mapping = torch.tensor(slots, dtype=torch.int64 if slot_i64 else torch.int32, device=device)
    latent_before, k_pe_before = latent.clone(), k_pe.clone()

    _call(impl, latent, k_pe, slot_mapping, cache)

    # Written rows are exact casts and every other row (padding slots write nothing) keeps its bits.
    assert_bitwise_equal(cache, expected, "cache after write")
    assert_bitwise_equal(latent, latent_before, "latent (an input)")
    assert_bitwise_equal(k_pe, k_pe_before, "k_pe (an input)")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_all_padding_writes_nothing(impl, dtype):
    gen = generator(0)
    cache = _half_poisoned_cache(3, 16, RANK + ROPE, dtype, gen)
    cache[0, 0] = NAN  # the row a sync-free implementation is most tempted to touch
    before = cache.clone()
    slots = torch.full((5,), -1, dtype=torch.int32)
    _call(impl, randn(gen, 5, RANK, dtype=dtype), randn(gen, 5, ROPE, dtype=dtype), slots, cache)
    assert_bitwise_equal(cache, before, "cache after an all-padding write")


@pytest.mark.parametrize("impl", IMPLS)
def test_write_empty_batch(impl):
    cache = torch.full((2, 16, RANK + ROPE), NAN)
    before = cache.clone()
    _call(impl, torch.empty(0, RANK), torch.empty(0, ROPE), torch.empty(0, dtype=torch.int32), cache)
    assert_bitwise_equal(cache, before, "cache after an empty write")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_deepseek_dims(dtype):
    """Real DeepSeek rows (512 + 64) into an allocated NaN cache, block size 64, shuffled slots."""
    gen = generator(1)
    config = mla_compile.preset("deepseek-v3")
    cache = mla_compile.allocate_latent_cache(4, 64, config, dtype=dtype, fill=NAN)
    slots = torch.randperm(4 * 64, generator=gen)[:37].tolist()
    slots[3] = slots[20] = -1
    latent = randn(gen, 37, DS_RANK, dtype=dtype)
    k_pe = randn(gen, 37, DS_ROPE, dtype=dtype)
    expected = write_ref64(cache, latent, k_pe, slots)
    write_latent_cache(latent, k_pe, torch.tensor(slots, dtype=torch.int32), cache)
    assert_bitwise_equal(cache, expected, "cache after write")
    assert int(torch.isnan(cache).all(dim=-1).sum()) == 4 * 64 - 35  # exactly the 35 real rows are written
