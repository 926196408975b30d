"""``mla::context_attention`` (prefill queries over their cached context, slice by slice) against a float64
loop over every (query, head, context token), for float and fp8 caches, any slice budget."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing import assert_close

from mla_compile.models.metadata import context_slices
from mla_compile.ops import context_attention
from .ref64 import F64, NAN, NEG_INF, OUT_TOL, LSE_TOL, fill_paged_cache, generator, paged, randn, seeds
from .ref_sparse import dequantize64, fill_fp8_cache

H, NOPE, V, RANK, ROPE = 2, 8, 8, 128, 16  # RANK: a multiple of the fp8 format's 128-wide groups


def _inputs(layout, lens_q, dtype, gen, fp8=False):
    """Queries, the new-token part ``(out, lse)`` (some rows empty: lse -inf, out NaN), weights, cache."""
    T = sum(lens_q)
    q = randn(gen, T, H, NOPE + ROPE, dtype=dtype)
    out = randn(gen, T, H, V, dtype=dtype)
    lse = randn(gen, T, H, dtype=torch.float32) * 2
    empty = torch.rand(T, H, generator=gen) < 0.25
    lse[empty], out[empty] = NEG_INF, NAN
    w = randn(gen, H * (NOPE + V), RANK, dtype=dtype) / math.sqrt(RANK)
    if fp8:
        cache = fill_fp8_cache(layout, RANK, ROPE, gen)
        rows64 = dequantize64(cache, RANK)
    else:
        cache = fill_paged_cache(layout, RANK + ROPE, dtype, gen)
        rows64 = cache.to(F64)
    return q, out, lse, w, cache, rows64


def _ref64(q, out, lse, w, rows64, layout, lens_q, scale):
    """Exact merge of the given part with attention over each sequence's whole context, in float64."""
    w64 = w.to(F64).view(H, NOPE + V, RANK)
    ref_out = torch.zeros(q.shape[0], H, V, dtype=F64)
    ref_lse = torch.full((q.shape[0], H), NEG_INF, dtype=F64)
    t = 0
    for b, lq in enumerate(lens_q):
        ctx = [rows64[layout.where(b, p)] for p in range(layout.seq_lens[b])]
        for _ in range(lq):
            for h in range(H):
                parts = [] if float(lse[t, h]) == NEG_INF else [(float(lse[t, h]), out[t, h].to(F64))]
                for row in ctx:
                    key = torch.cat([w64[h, :NOPE] @ row[:RANK], row[RANK:]])
                    parts.append((float(q[t, h].to(F64) @ key) * scale, w64[h, NOPE:] @ row[:RANK]))
                if parts:
                    m = max(s for s, _ in parts)
                    weights = [math.exp(s - m) for s, _ in parts]
                    ref_out[t, h] = sum(wt * o for wt, (_, o) in zip(weights, parts)) / math.fsum(weights)
                    ref_lse[t, h] = m + math.log(math.fsum(weights))
            t += 1
    return ref_out, ref_lse


def _call(q, out, lse, cache, layout, lens_q, w, budget, scale):
    ctx = context_slices(list(layout.seq_lens), budget)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0).tolist()), dtype=torch.int32)
    return context_attention(q, out, lse, cache, layout.block_table(), cu_q, ctx.cu_seqlens, ctx.starts, ctx.rows,
                             w, scale, kv_lora_rank=RANK, rope_dim=ROPE), ctx


# the merge weights come from float32 LSEs (our contract), so float64 outputs are float32-exact only
_OUT_TOL = {**OUT_TOL, F64: dict(rtol=1e-6, atol=1e-6)}


def _check(got, ref, dtype):
    out, lse = got
    ref_out, ref_lse = ref
    assert_close(lse.double(), ref_lse, **LSE_TOL[dtype])
    live = ~torch.isneginf(ref_lse)
    assert_close(out.double()[live], ref_out[live], **_OUT_TOL[dtype])
    assert (out[~live] == 0).all() or not (~live).any(), "a row with no keys at all must give out 0"
    assert not torch.isnan(out[live]).any()


@given(layout=paged(min_seqs=1, max_seqs=3), budget=st.integers(1, 40), fp8=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]), data=st.data(), seed=seeds)
def test_matches_float64_for_any_slice_budget(layout, budget, fp8, dtype, data, seed):
    gen = generator(seed)
    lens_q = data.draw(st.lists(st.integers(0, 3), min_size=len(layout.seq_lens), max_size=len(layout.seq_lens)))
    q, out, lse, w, cache, rows64 = _inputs(layout, lens_q, dtype, gen, fp8)
    out_in, lse_in = out.clone(), lse.clone()
    got, ctx = _call(q, out, lse, cache, layout, lens_q, w, budget, 0.3)
    assert int(ctx.rows.max()) <= budget and ctx.num_slices >= 2
    _check(got, _ref64(q, out, lse, w, rows64, layout, lens_q, 0.3), dtype)
    assert torch.equal(lse, lse_in) and torch.equal(out.isnan(), out_in.isnan()), "inputs must not be mutated"


def test_many_slices_deepseek_rope_and_bf16():
    """A context of 45 slices of 3 rows (bf16 cache): the same result as one slice holding it all."""
    gen = generator(3)
    from .ref64 import Paged
    layout = Paged(4, 40, (70, 0, 65), (tuple(range(18)), (), tuple(range(18, 35))), 18, -1)
    lens_q = [2, 1, 3]
    q, out, lse, w, cache, rows64 = _inputs(layout, lens_q, torch.bfloat16, gen)
    got, ctx = _call(q, out, lse, cache, layout, lens_q, w, 3, 0.25)
    assert ctx.num_slices == 45
    _check(got, _ref64(q, out, lse, w, rows64, layout, lens_q, 0.25), torch.bfloat16)
    whole, _ = _call(q, out, lse, cache, layout, lens_q, w, 1000, 0.25)
    assert_close(got[0].float(), whole[0].float(), atol=2e-2, rtol=2e-2)


def test_no_slices_returns_copies():
    gen = generator(4)
    q, out, lse = randn(gen, 3, H, NOPE + ROPE, dtype=torch.float32), randn(gen, 3, H, V, dtype=torch.float32), \
        randn(gen, 3, H, dtype=torch.float32)
    cache = torch.full((2, 4, RANK + ROPE), NAN)
    none = torch.zeros(0, 2, dtype=torch.int32)
    got_out, got_lse = context_attention(q, out, lse, cache, torch.zeros(1, 1, dtype=torch.int32),
                                         torch.tensor([0, 3], dtype=torch.int32), none, none[:, :1],
                                         torch.zeros(0, dtype=torch.int64), randn(gen, H * (NOPE + V), RANK, dtype=torch.float32),
                                         0.3, kv_lora_rank=RANK, rope_dim=ROPE)
    assert torch.equal(got_out, out) and torch.equal(got_lse, lse) and got_out.data_ptr() != out.data_ptr()


def _valid_args():
    gen = generator(5)
    from .ref64 import Paged
    layout = Paged(4, 4, (6,), ((0, 1),), 2, -1)
    q, out, lse, w, cache, _ = _inputs(layout, [2], torch.float32, gen)
    ctx = context_slices([6], 4)
    return dict(q=q, out=out, lse=lse, kv_cache=cache, block_table=layout.block_table(),
                cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32), slice_cu_seqlens=ctx.cu_seqlens,
                slice_starts=ctx.starts, slice_rows=ctx.rows, kv_b_weight=w, scale=0.3)


@pytest.mark.parametrize("name,bad,match", [
    ("slice_rows", torch.tensor([4.0, 2.0]), "slice_rows must have dtype"),
    ("slice_starts", torch.zeros(3, 1, dtype=torch.int32), r"slice_starts must have shape \[2, 1\]"),
    ("kv_b_weight", torch.zeros(3, RANK), "kv_b_weight must have shape"),
    ("lse", torch.zeros(2, H, dtype=torch.float64), "lse must have dtype"),
    ("kv_cache", torch.zeros(4, 4, RANK + ROPE + 1), r"kv_cache must have shape \[\*, \*, 144\]"),
])
def test_bad_arguments_are_named(name, bad, match):
    args = _valid_args()
    args[name] = bad
    with pytest.raises((ValueError, TypeError), match=match):
        context_attention(**args, kv_lora_rank=RANK, rope_dim=ROPE)


def test_opcheck():
    args = _valid_args()
    torch.library.opcheck(torch.ops.mla.context_attention.default,
                          tuple(args.values()) + (RANK, ROPE, "auto", "auto", "auto"))


def test_compiles_once_for_any_slice_count():
    """The slice count is a dimension: one graph serves 7, 6 and 11 slices (the first count matches no other
    size, so duck sizing ties it to nothing)."""
    from torch._dynamo.testing import CompileCounter
    from .ref64 import Paged
    torch._dynamo.reset()
    cnt = CompileCounter()

    @torch.compile(backend=cnt, fullgraph=True, dynamic=True)
    def f(q, out, lse, cache, table, cu_q, cu, starts, rows, w):
        return context_attention(q, out, lse, cache, table, cu_q, cu, starts, rows, w, 0.3,
                                 kv_lora_rank=RANK, rope_dim=ROPE)

    for n, budget in ((13, 2), (20, 4), (21, 2)):
        gen = generator(n)
        layout = Paged(4, 8, (n, 1), (tuple(range(-(-n // 4))), (7,)), 6, -1)
        q, out, lse, w, cache, rows64 = _inputs(layout, [2, 1], torch.float32, gen)
        ctx = context_slices([n, 1], budget)
        cu_q = torch.tensor([0, 2, 3], dtype=torch.int32)
        got = f(q, out, lse, cache, layout.block_table(), cu_q, ctx.cu_seqlens, ctx.starts, ctx.rows, w)
        _check(got, _ref64(q, out, lse, w, rows64, layout, [2, 1], 0.3), torch.float32)
    assert cnt.frame_count == 1
    torch._dynamo.reset()
