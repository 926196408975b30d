"""``mla::prefill`` against a per-token float64 loop: ragged, causal bottom-right, NaN-poisoned padding."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from mla_compile.ops import prefill
from .ref64 import (DEVICES, DS_HEADS, DTYPES, IMPLS, LSE_TOL, NAN, OUT_TOL, generator, prefill_ref64, randn,
                   seeds)

QK, V = 24, 16  # small stand-ins for DeepSeek's 192 / 128


@st.composite
def ragged(draw) -> tuple[list[int], list[int], int, int]:
    """(lens_q, lens_k, pad_q, pad_k) with len_k >= len_q per sequence; zero-length sequences allowed."""
    n = draw(st.integers(0, 3))
    lens_q = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    lens_k = [lq + draw(st.one_of(st.just(0), st.integers(0, 12))) for lq in lens_q]
    return lens_q, lens_k, draw(st.integers(0, 3)), draw(st.integers(0, 3))


def _cu(lens: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=dtype, device=device)


def _inputs(lens_q, lens_k, pad_q, pad_k, heads, qk, v_dim, dtype, gen, device):
    """Random q/k/v whose padding rows (past cu_seqlens[-1]) are NaN: no op may read them."""
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = randn(gen, Tq + pad_q, heads, qk, dtype=dtype)
    k = randn(gen, Tk + pad_k, heads, qk, dtype=dtype)
    v = randn(gen, Tk + pad_k, heads, v_dim, dtype=dtype)
    q[Tq:], k[Tk:], v[Tk:] = NAN, NAN, NAN
    return q.to(device), k.to(device), v.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@given(case=ragged(), heads=st.integers(1, 3), cu_i64=st.booleans(), seed=seeds)
def test_prefill_matches_loop(device, impl, causal, dtype, case, heads, cu_i64, seed):
    lens_q, lens_k, pad_q, pad_k = case
    gen = generator(seed)
    q, k, v = _inputs(lens_q, lens_k, pad_q, pad_k, heads, QK, V, dtype, gen, device)
    idx = torch.int64 if cu_i64 else torch.int32
    cu_q, cu_k = _cu(lens_q, idx, device), _cu(lens_k, idx, device)
    scale = QK ** -0.5
    ref_out, ref_lse = prefill_ref64(q, k, v, lens_q, lens_k, scale, causal)

    if impl == "raw":
        out, lse = torch.ops.mla.prefill_ref(q, k, v, cu_q, cu_k, scale, causal)
    else:
        out, lse = prefill(q, k, v, cu_q, cu_k, scale, causal=causal)

    T = q.shape[0]
    assert out.shape == (T, heads, V) and out.dtype == dtype
    assert lse.shape == (T, heads) and lse.dtype == torch.float32
    assert_close(out.cpu().double(), ref_out, **OUT_TOL[dtype])
    assert_close(lse.cpu().double(), ref_lse, **LSE_TOL[dtype])
    # Padding rows: exactly 0 and -inf, and no NaN of theirs reaches a real row.
    pad = slice(sum(lens_q), T)
    assert torch.equal(out[pad].cpu(), torch.zeros_like(out[pad].cpu()))
    assert torch.isneginf(lse[pad]).all()
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_causal_is_bottom_right(impl):
    """len_q 2, len_k 3: query 0 sees keys 0..1, query 1 sees 0..2 (not top-left's 0 and 0..1)."""
    gen = generator(11)
    q, k, v = (randn(gen, n, 1, d, dtype=torch.float64) for n, d in ((2, QK), (3, QK), (3, V)))
    cu_q, cu_k = _cu([2], torch.int32, "cpu"), _cu([3], torch.int32, "cpu")
    run = torch.ops.mla.prefill_ref if impl == "raw" else (lambda *a: prefill(*a[:-1], causal=a[-1]))
    out, _ = run(q, k, v, cu_q, cu_k, 0.2, True)
    full, _ = run(q[1:], k, v, _cu([1], torch.int32, "cpu"), cu_k, 0.2, False)
    two, _ = run(q[:1], k[:2], v[:2], _cu([1], torch.int32, "cpu"), _cu([2], torch.int32, "cpu"), 0.2, False)
    assert_close(out[1], full[0], rtol=1e-12, atol=1e-12)
    assert_close(out[0], two[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_deepseek_dims(dtype):
    """qk 192 / v 128, 16 heads, two sequences with context (len_k > len_q) and one empty, padded."""
    lens_q, lens_k = [5, 0, 7], [9, 0, 7]
    gen = generator(12)
    q, k, v = _inputs(lens_q, lens_k, 2, 1, DS_HEADS, 192, 128, dtype, gen, "cpu")
    ref_out, ref_lse = prefill_ref64(q, k, v, lens_q, lens_k, 192 ** -0.5, True)
    out, lse = prefill(q, k, v, _cu(lens_q, torch.int32, "cpu"), _cu(lens_k, torch.int32, "cpu"), 192 ** -0.5)
    assert_close(out.double(), ref_out, **OUT_TOL[dtype])
    assert_close(lse.double(), ref_lse, **LSE_TOL[dtype])
