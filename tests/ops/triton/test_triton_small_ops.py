"""CUDA: the Triton merge, cache-write and gather kernels against the reference ops."""

from __future__ import annotations

import math

import pytest
import torch

import mla_compile  # noqa: F401
import _triton_test_util as util
from _triton_test_util import NAN, assert_attention_close, cu_from_lens, paged_cache, poison_allocator
from mla_compile.ops import gather_latent_cache, merge_attn_states, write_latent_cache

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _call(public, launch, *args):
    if util.DEVICE == "cuda":
        return public(*args, backend="triton")
    return launch(*args)


@pytest.mark.parametrize("dtype,T,H,D", [(torch.bfloat16, 1000, 128, 512), (torch.float32, 33, 16, 128),
                                         (torch.float16, 5, 3, 40)])
def test_merge(dtype, T, H, D):
    from mla_compile.ops.triton.merge import _launch

    gen = torch.Generator().manual_seed(T)
    oa, ob = (torch.randn(T, H, D, generator=gen).to(util.DEVICE, dtype) for _ in range(2))
    la, lb = (torch.randn(T, H, generator=gen).to(util.DEVICE) * 4 for _ in range(2))
    pick = torch.rand(T, H, generator=gen).to(util.DEVICE)
    la[pick < 0.1] = float("-inf")
    oa[pick < 0.1] = NAN  # an empty part may hold anything
    lb[(pick > 0.05) & (pick < 0.15)] = float("-inf")
    ob[(pick > 0.05) & (pick < 0.15)] = NAN
    poison_allocator()
    out, lse = _call(merge_attn_states, _launch, oa, la, ob, lb)
    ref, ref_lse = torch.ops.mla.merge_attn_states_ref(oa.double(), la, ob.double(), lb)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_attention_close(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("cache_dtype,row_dtype,bs", [(torch.bfloat16, torch.bfloat16, 64),
                                                      (torch.bfloat16, torch.float32, 16),
                                                      (torch.float32, torch.float32, 1)])
def test_cache_write(cache_dtype, row_dtype, bs):
    from mla_compile.ops.triton.cache_write import _launch

    gen = torch.Generator().manual_seed(bs)
    nb, T, dc, dr = 300 // bs + 4, 257, 512, 64
    n_slots = nb * bs
    cache = torch.full((nb, bs, dc + dr), NAN, dtype=cache_dtype, device=util.DEVICE)
    latent = torch.randn(T, dc, generator=gen).to(util.DEVICE, row_dtype)
    k_pe = torch.randn(T, dr, generator=gen).to(util.DEVICE, row_dtype)
    slots = torch.randperm(n_slots, generator=gen)[:T] if T <= n_slots else torch.arange(T) % n_slots
    slots = slots.to(torch.int32)
    slots[::7] = -1  # padding
    slots[3] = n_slots + 11  # out of range: never written
    slots = slots.to(util.DEVICE)
    expected = cache.clone()
    in_range = torch.where(slots >= n_slots, -1, slots)
    keep = in_range >= 0
    expected.view(-1, dc + dr)[in_range[keep].long()] = torch.cat([latent, k_pe], -1)[keep].to(cache_dtype)
    _call(write_latent_cache, _launch, latent, k_pe, slots, cache)
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("bs,N", [(16, 20), (64, 5), (1, 3), (64, 0)])
def test_gather(bs, N):
    from mla_compile.ops.triton.gather import _launch

    gen = torch.Generator().manual_seed(bs + N)
    total = torch.randint(1, 700, (max(N, 1),), generator=gen)[:N]
    starts = (torch.rand(N, generator=gen) * total).long()
    lens = (total - starts).tolist()
    if N > 1:
        lens[1] = 0
    D = 576
    cache, table, _ = paged_cache(total.tolist() or [1], bs, D, torch.bfloat16, gen=gen)
    table = table[:N]
    cu = cu_from_lens(lens)
    S = sum(lens) + 13  # padding rows are zeroed
    out = torch.full((S, D), NAN, dtype=torch.bfloat16, device=util.DEVICE)
    expected = out.clone()
    st = starts.to(torch.int32).to(util.DEVICE)
    torch.ops.mla.gather_latent_cache_ref(cache, table, cu, st, expected)
    _call(gather_latent_cache, _launch, cache, table, cu, st, out)
    assert not out.isnan().any()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("causal,scale,case", [(True, math.log(2.0), "few"), (False, 1.0, "few"), (True, 1.0, "many"),
                                              (True, 1.0, "none")])
def test_finish_prefill(causal, scale, case):
    """The adapters' one-launch prefill boundary against the live rows of ``_common.prefill_live_rows``, float64:
    rows that see no key (an empty key sequence, causal rows before the first key) and padding rows -> 0 / -inf,
    whatever they held; live rows untouched; the LSE from a strided [H, T] layout times ``scale``; "many": 300
    sequences of 0-3 rows with one key fewer to one more; "none": no sequence, padding rows only."""
    from mla_compile.ops.adapters._common import prefill_live_rows
    from mla_compile.ops.triton.finish import finish_prefill_triton

    gen = torch.Generator().manual_seed(7 + causal + 2 * len(case))
    lens_q, lens_k = [5, 3, 0, 7], [2, 0, 4, 9]  # causal: rows 0-2 of the first sequence see no key
    if case == "none":  # no sequence: every row is padding
        lens_q, lens_k = [], []
    if case == "many":  # more sequences than the kernel scans in one chunk (128)
        lens_q = torch.randint(0, 4, (300,), generator=gen).tolist()
        lens_k = [n + int(d) - 1 for n, d in zip(lens_q, torch.randint(0, 3, (300,), generator=gen))]
        lens_k = [max(k, 0) for k in lens_k]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    T, H, D = sum(lens_q) + 3, 6, 40  # 3 padding rows
    out = torch.randn(T, H, D, generator=gen).to(util.DEVICE, torch.bfloat16)
    lse = (torch.randn(H, T, generator=gen) * 4).to(util.DEVICE).t()
    live = prefill_live_rows(cu_q.to(util.DEVICE), cu_k.to(util.DEVICE), T, causal)
    assert (0 < int(live.sum()) < T) if lens_q else not live.any()
    out[~live] = NAN
    expected_out = torch.where(live[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    expected_lse = torch.where(live[:, None], lse.double() * scale, float("-inf"))
    poison_allocator()
    got_out, got_lse = finish_prefill_triton(out.clone(), lse, cu_q.to(util.DEVICE), cu_k.to(util.DEVICE), causal,
                                             scale)
    assert got_lse.dtype == torch.float32 and got_lse.is_contiguous() and got_lse.shape == (T, H)
    assert torch.equal(got_out, expected_out)
    assert torch.equal(got_lse.isinf(), expected_lse.isinf())
    torch.testing.assert_close(got_lse.double(), expected_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("B,s_q,H,D,scale", [(6, 1, 16, 512, 1.0), (5, 2, 128, 512, math.log(2.0)),
                                             (4, 3, 3, 40, 1.0)])
def test_finish_decode(B, s_q, H, D, scale):
    """The adapters' one-launch decode boundary: rows that see nothing -> 0 / -inf (whatever they held),
    visible rows untouched, LSE from a strided [B, H, s_q] layout times ``scale`` into [B, s_q, H] float32."""
    from mla_compile.ops.triton.finish import finish_decode_triton

    gen = torch.Generator().manual_seed(B * H + s_q)
    out = torch.randn(B, s_q, H, D, generator=gen).to(util.DEVICE, torch.bfloat16)
    lse = (torch.randn(B, H, s_q, generator=gen) * 4).to(util.DEVICE).transpose(1, 2)
    lens = torch.randint(2, 50, (B,), generator=gen)
    lens[0], lens[1] = 0, 1  # nothing visible; with s_q > 1 only the last query sees a row
    vis = (lens[:, None] - (s_q - 1 - torch.arange(s_q))[None, :] > 0).to(util.DEVICE)
    out[~vis] = NAN
    expected_out = torch.where(vis[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    expected_lse = torch.where(vis[:, :, None], lse.double() * scale, float("-inf"))
    poison_allocator()
    got_out, got_lse = finish_decode_triton(out.clone(), lse, lens.to(util.DEVICE, torch.int32), scale)
    assert got_lse.dtype == torch.float32 and got_lse.is_contiguous() and got_lse.shape == (B, s_q, H)
    assert torch.equal(got_out, expected_out)
    assert torch.equal(got_lse.isinf(), expected_lse.isinf())
    torch.testing.assert_close(got_lse.double(), expected_lse, atol=1e-5, rtol=1e-6)
