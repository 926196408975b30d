"""``mla::merge_attn_states`` against an exact float64 loop, with empty (-inf) parts holding NaN."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from mla_compile.ops import merge_attn_states, prefill
from .ref64 import (DEVICES, DS_HEADS, DS_RANK, DTYPES, IMPLS, LSE_TOL, NAN, NEG_INF, OUT_TOL, generator,
                    merge_ref64, randn, seeds)


def _call(impl, out_a, lse_a, out_b, lse_b):
    if impl == "raw":
        return torch.ops.mla.merge_attn_states_ref(out_a, lse_a, out_b, lse_b)
    return merge_attn_states(out_a, lse_a, out_b, lse_b)


def _parts(T, H, D, dtype, gen, offset: float, device="cpu"):
    """Two random parts; each (row, head) is both / only a / only b / neither, -inf parts NaN-poisoned."""
    out_a, out_b = (randn(gen, T, H, D, dtype=dtype) for _ in range(2))
    lse_a, lse_b = ((randn(gen, T, H, dtype=torch.float32) * 4 + offset) for _ in range(2))
    kind = torch.randint(0, 4, (T, H), generator=gen)
    a_empty, b_empty = (kind == 1) | (kind == 3), (kind == 2) | (kind == 3)
    lse_a[a_empty], lse_b[b_empty] = NEG_INF, NEG_INF
    out_a[a_empty], out_b[b_empty] = NAN, NAN
    return [x.to(device) for x in (out_a, lse_a, out_b, lse_b)]


def _check(out, lse, ref_out, ref_lse, dtype, shape):
    assert out.shape == shape and out.dtype == dtype and lse.shape == shape[:2] and lse.dtype == torch.float32
    assert_close(out.cpu().double(), ref_out, **OUT_TOL[dtype])
    assert_close(lse.cpu().double(), ref_lse, **LSE_TOL[dtype])
    assert not torch.isnan(out).any(), "NaN of an empty part leaked into the merged output"
    both_empty = torch.isneginf(ref_lse)
    assert torch.equal(out.cpu()[both_empty], torch.zeros_like(out.cpu()[both_empty]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(T=st.integers(0, 9), H=st.integers(1, 4), D=st.sampled_from([8, 16, 40]),
       offset=st.sampled_from([0.0, -60.0, 90.0, 1000.0]), seed=seeds)
def test_merge_matches_loop(device, impl, dtype, T, H, D, offset, seed):
    """Large lse offsets (1000) catch an unshifted exp; the four empty patterns come at random."""
    parts = _parts(T, H, D, dtype, generator(seed), offset, device)
    before = [p.clone() for p in parts]
    ref_out, ref_lse = merge_ref64(*parts)
    out, lse = _call(impl, *parts)
    _check(out, lse, ref_out, ref_lse, dtype, (T, H, D))
    for p, b in zip(parts, before):
        assert torch.equal(p.cpu().nan_to_num(123.0), b.cpu().nan_to_num(123.0)), "merge changed an input"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("a_empty,b_empty", list(itertools.product([False, True], repeat=2)))
def test_merge_each_empty_pattern(impl, a_empty, b_empty):
    gen = generator(21)
    out_a, out_b = randn(gen, 3, 2, 8, dtype=torch.float32), randn(gen, 3, 2, 8, dtype=torch.float32)
    lse_a, lse_b = randn(gen, 3, 2, dtype=torch.float32), randn(gen, 3, 2, dtype=torch.float32)
    if a_empty:
        lse_a.fill_(NEG_INF)
        out_a.fill_(NAN)
    if b_empty:
        lse_b.fill_(NEG_INF)
        out_b.fill_(NAN)
    out, lse = _call(impl, out_a, lse_a, out_b, lse_b)
    if a_empty and b_empty:
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    elif a_empty or b_empty:
        keep_out, keep_lse = (out_b, lse_b) if a_empty else (out_a, lse_a)
        assert_close(out, keep_out, rtol=1e-6, atol=1e-6)
        assert_close(lse, keep_lse, rtol=1e-6, atol=1e-6)
    else:
        _check(out, lse, *merge_ref64(out_a, lse_a, out_b, lse_b), torch.float32, (3, 2, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_of_split_keys_equals_whole(dtype):
    """Attention over keys A + B equals the merge of attention over A and over B (natural-log LSE)."""
    gen = generator(22)
    lens_q, lens_a, lens_b = [3, 2], [4, 2], [3, 5]
    q = randn(gen, 5, 2, 24, dtype=dtype)
    ka, va = randn(gen, 6, 2, 24, dtype=dtype), randn(gen, 6, 2, 16, dtype=dtype)
    kb, vb = randn(gen, 8, 2, 24, dtype=dtype), randn(gen, 8, 2, 16, dtype=dtype)

    def cu(lens):
        return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)

    def cat_per_seq(x, y):
        return torch.cat([x[0:4], y[0:3], x[4:6], y[3:8]])

    whole, whole_lse = prefill(q, cat_per_seq(ka, kb), cat_per_seq(va, vb), cu(lens_q),
                               cu([a + b for a, b in zip(lens_a, lens_b)]), 0.2, causal=False)
    out_a, lse_a = prefill(q, ka, va, cu(lens_q), cu(lens_a), 0.2, causal=False)
    out_b, lse_b = prefill(q, kb, vb, cu(lens_q), cu(lens_b), 0.2, causal=False)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    tol = dict(rtol=1e-6, atol=1e-6)  # lse is float32 in every dtype
    assert_close(out, whole, **tol)
    assert_close(lse, whole_lse, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_deepseek_dims(dtype):
    parts = _parts(7, DS_HEADS, DS_RANK, dtype, generator(23), 3.0)
    _check(*merge_attn_states(*parts), *merge_ref64(*parts), dtype, (7, DS_HEADS, DS_RANK))
