"""The Triton kernels run by Triton's CPU interpreter against the float64 reference ops.

Run with ``TRITON_INTERPRET=1 pytest tests/ops/triton/test_triton_interpret.py`` where Triton is
installed; skipped otherwise. Shapes are small: the interpreter runs every program in Python.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import mla_compile  # noqa: F401  (registers the reference ops)

# conftest.py beside this file patches two interpreter bugs when these tests run
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs TRITON_INTERPRET=1 and an importable triton")

NAN = float("nan")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    return float((a - b)[fin].norm() / b[fin].norm().clamp_min(1e-30))


def _check(out, ref, lse, ref_lse, tol):
    assert not out.isnan().any(), "unwritten (NaN) output"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf LSE pattern differs"
    assert _rel(out, ref) < tol
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-3, rtol=1e-3)


def _paged(B, lens, bs, D, dtype, extra_blocks=3):
    """A NaN-poisoned paged cache with random rows at every used position, shuffled physical blocks."""
    max_blocks = max(1, max(math.ceil(n / bs) for n in lens))
    nb = B * max_blocks + extra_blocks
    cache = torch.full((nb, bs, D), NAN, dtype=dtype)
    table = torch.randperm(nb)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    for b, n in enumerate(lens):
        for p in range(n):
            cache[table[b, p // bs], p % bs] = torch.randn(D).to(dtype)
    return cache, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("s_q,splits", [(1, 1), (1, 3), (2, 2)])
def test_page_tiles_equal_row_gather(fp8, s_q, splits):
    """Tiles inside one page (one block-table entry, affine rows) give what the per-row gather gives,
    sequences ending mid-tile included, on a NaN-poisoned cache; and both match the reference."""
    from mla_compile.ops.triton import decode as td
    from mla_compile.ops.triton.fp8_decode import launch_fp8
    from _sparse_test_util import fp8_paged

    gen = torch.Generator().manual_seed(7 + s_q + splits)
    H, dc, dr, bs, lens = 16, 128, 16, 32, [0, 37, 80, 5, 64]
    scale = 1 / math.sqrt(dc + dr)
    if fp8:
        cache, table, seq_lens, _ = fp8_paged(lens, bs, dc, dr, "cpu", gen)
        run, ref_op = launch_fp8, torch.ops.mla.decode_fp8_ref
    else:
        torch.manual_seed(1)
        cache, table, seq_lens = _paged(len(lens), lens, bs, dc + dr, torch.bfloat16)
        run, ref_op = td._launch, torch.ops.mla.decode_ref
    q = torch.randn(len(lens), s_q, H, dc + dr, generator=gen).bfloat16()
    cfg = {"SPLITS": splits, "BLOCK_N": 16}
    out, lse = run(q, cache, table, seq_lens, scale, dc, config=dict(cfg, PAGE_TILES=True))
    out_g, lse_g = run(q, cache, table, seq_lens, scale, dc, config=dict(cfg, PAGE_TILES=False))
    assert torch.equal(out, out_g) and torch.equal(lse, lse_g)
    ref, ref_lse = ref_op(q.double(), cache if fp8 else cache.double().nan_to_num(), table, seq_lens, scale, dc)
    _check(out, ref, lse, ref_lse, 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("s_q,bs,lens,splits", [
    (1, 16, [0, 37, 80], 1),
    (1, 16, [0, 37, 80], 3),
    (2, 1, [1, 9, 0], 2),
    (3, 16, [2, 40], 1),
])
def test_decode(dtype, s_q, bs, lens, splits):
    from mla_compile.ops.triton import decode as td

    torch.manual_seed(0)
    H, dc, dr = 16, 64, 16
    cache, table, seq_lens = _paged(len(lens), lens, bs, dc + dr, dtype)
    q = torch.randn(len(lens), s_q, H, dc + dr).to(dtype)
    scale = 1 / math.sqrt(dc + dr)
    out, lse = td._launch(q, cache, table, seq_lens, scale, dc, config={"SPLITS": splits})
    ref, ref_lse = torch.ops.mla.decode_ref(q.double(), cache.double().nan_to_num(), table, seq_lens, scale, dc)
    assert out.shape == ref.shape and out.dtype == dtype and lse.dtype == torch.float32
    _check(out, ref, lse, ref_lse, 1e-2 if dtype == torch.bfloat16 else 1e-5)
    # a query that sees nothing: out exactly 0
    empty = torch.isinf(ref_lse)
    assert (out[empty] == 0).all()


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("block_c,splits,cap,tile", [(None, 5, 5, 4096), (32, 5, 5, 4096), (32, 7, 3, 4096),
                                                     (16, 70, 70, 4096), (32, 7, 7, 128), (None, 70, 70, 256)])
def test_reduce_splits_merges_the_used_partials_in_column_programs(monkeypatch, block_c, splits, cap, tile, one_pass):
    """The split merge, in one program a row or in programs of ``block_c`` columns, against a float64 merge of
    random partials: splits with no key (-inf) weigh nothing, a row of only such splits gives 0 / -inf, and the
    slots past the used count (``cap``, at most 64) hold NaN, never read. ``tile`` sets the split chunk (4 splits
    at 128, with more used splits than that: several chunks, as without ``one_pass``)."""
    from mla_compile.ops.triton import decode as td

    monkeypatch.setitem(td.REDUCE, "block_c", block_c)
    monkeypatch.setitem(td.REDUCE, "tile", tile)
    monkeypatch.setitem(td.REDUCE, "one_pass", one_pass)
    gen = torch.Generator().manual_seed(splits + (block_c or 0))
    rows, dc = 6, 64
    used = min(splits, cap, 64)
    o = torch.randn(rows, splits, dc, generator=gen)
    lse2 = torch.randn(rows, splits, generator=gen) * 4
    lse2[0, : used - 1] = float("-inf")  # one live split
    lse2[1, :used] = float("-inf")  # no key at all
    lse2[2, 1] = float("-inf")
    o[:, used:], lse2[:, used:] = NAN, NAN
    out = torch.full((rows, dc), NAN, dtype=torch.bfloat16)
    lse = torch.full((rows,), NAN)
    td.reduce_splits(lambda k: k, o.reshape(-1).clone(), lse2.reshape(-1).clone(), out, lse, rows, splits, cap, dc,
                     dc, False)
    l64 = lse2[:, :used].double()
    m = l64.max(1).values.clamp_min(-1e300)
    w = torch.exp2(l64 - m[:, None])
    tot = w.sum(1)
    ref = (o[:, :used].double() * w[..., None]).sum(1) / tot.clamp_min(1e-300)[:, None]
    ref_lse = torch.where(tot > 0, (m + torch.log2(tot)) * math.log(2), float("-inf"))
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[1], torch.zeros(dc, dtype=out.dtype)) and lse[1] == float("-inf")
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill(dtype, causal):
    from mla_compile.ops.triton import prefill as tp

    torch.manual_seed(1)
    H, dqk, dv = 2, 48, 32  # a 32 + 16 split of the qk dim, like 128 + 64
    lq, lk = [5, 0, 40, 17], [5, 7, 70, 17]
    cu_q = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    T, S = int(cu_q[-1]) + 6, int(cu_k[-1]) + 3  # padding rows past the last sequence
    q, k = torch.randn(T, H, dqk).to(dtype), torch.randn(S, H, dqk).to(dtype)
    v = torch.randn(S, H, dv).to(dtype)
    out, lse = tp._launch(q, k, v, cu_q, cu_k, 0.2, causal, config={"BLOCK_M": 16, "BLOCK_N": 16})
    ref, ref_lse = torch.ops.mla.prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, 0.2, causal)
    _check(out, ref, lse, ref_lse, 1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert (out[int(cu_q[-1]):] == 0).all() and torch.isinf(lse[int(cu_q[-1]):]).all()


def test_merge_empty_parts():
    from mla_compile.ops.triton import merge as tm

    torch.manual_seed(2)
    oa, ob = torch.randn(7, 3, 40).bfloat16(), torch.randn(7, 3, 40).bfloat16()
    la, lb = torch.randn(7, 3) * 3, torch.randn(7, 3) * 3
    la[0], oa[0] = float("-inf"), NAN  # an empty part may hold NaN
    lb[1], ob[1] = float("-inf"), NAN
    la[2], lb[2] = float("-inf"), float("-inf")
    out, lse = tm._launch(oa, la, ob, lb)
    ref, ref_lse = torch.ops.mla.merge_attn_states_ref(oa.double(), la, ob.double(), lb)
    _check(out, ref, lse, ref_lse, 1e-2)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cache_write(dtype):
    from mla_compile.ops.triton import cache_write as tc

    torch.manual_seed(3)
    nb, bs, dc, dr, T = 6, 16, 40, 8, 30
    cache = torch.full((nb, bs, dc + dr), NAN, dtype=dtype)
    # rows already in the cache dtype: the interpreter's float32 -> bfloat16 cast truncates (the GPU rounds)
    latent, k_pe = torch.randn(T, dc).to(dtype), torch.randn(T, dr).to(dtype)
    slots = torch.randperm(nb * bs)[:T].to(torch.int32)
    slots[3] = slots[7] = -1
    slots[9] = nb * bs + 5  # out of range: masked off, never written
    expected = cache.clone()
    ok_slots = torch.where(slots >= nb * bs, -1, slots)
    torch.ops.mla.write_latent_cache_ref(latent, k_pe, ok_slots, expected)
    tc._launch(latent, k_pe, slots, cache)
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())


def test_gather():
    from mla_compile.ops.triton import gather as tg

    torch.manual_seed(4)
    nb, bs, D = 9, 16, 48
    cache = torch.randn(nb, bs, D).bfloat16()
    table = torch.randperm(nb)[:8].view(2, 4).to(torch.int32)
    cu = torch.tensor([0, 20, 33], dtype=torch.int32)
    starts = torch.tensor([5, 10], dtype=torch.int32)
    out = torch.full((40, D), NAN, dtype=torch.bfloat16)  # rows 33.. are padding
    expected = out.clone()
    torch.ops.mla.gather_latent_cache_ref(cache, table, cu, starts, expected)
    tg._launch(cache, table, cu, starts, out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_splits_past_the_cap_change_nothing(fp8):
    """A traced launch may start more split programs than its cap (the symbolic plan has no Min): the
    programs past ``SPLIT_CAP`` exit, the merge reads the first ``SPLIT_CAP`` partials, and the result is
    bit for bit the capped launch's (eager and compiled runs agree)."""
    from mla_compile.ops.triton import decode as td

    gen = torch.Generator().manual_seed(3)
    lens = [0, 37, 80, 5]
    if fp8:
        from _sparse_test_util import fp8_paged

        cache, table, seq_lens, _ = fp8_paged(lens, 16, 128, 16, "cpu", gen)
    else:
        cache, table, seq_lens = _paged(len(lens), lens, 16, 144, torch.bfloat16)
    q = torch.randn(len(lens), 1, 16, 144, generator=gen).bfloat16()
    wide = td._launch(q, cache, table, seq_lens, 0.1, 128, config={"SPLITS": 7, "SPLIT_CAP": 3}, fp8=fp8)
    tight = td._launch(q, cache, table, seq_lens, 0.1, 128, config={"SPLITS": 3}, fp8=fp8)
    assert all(torch.equal(a, b) for a, b in zip(wide, tight))
    assert not wide[0].isnan().any() and torch.isinf(wide[1][0]).all()
