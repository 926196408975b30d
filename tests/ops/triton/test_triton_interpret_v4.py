"""The V4 attention Triton kernel under Triton's CPU interpreter, against the float64 reference op, on
NaN-poisoned caches (window rows before position 0, empty compressed sets, a dominant sink, no sink).

Run with ``TRITON_INTERPRET=1`` (tests/conftest.py sets it without a GPU); skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import mla_compile  # noqa: F401  (registers the reference ops)
from mla_compile.ops.v4_attention import compressed_slots, window_slots

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs TRITON_INTERPRET=1 and an importable triton")

I32 = torch.int32


def _case(seed, dtype, H=5, D=48, rope=16, W=6, bs=4, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor([0, 1, 1, -1, 0, 2], dtype=I32)
    pos = torch.tensor([2, 13, 30, 0, 21, 9], dtype=I32)
    T = seq.shape[0]
    table = torch.randperm(24, generator=g)[:24].reshape(3, 8).to(I32)
    etable = torch.randperm(6, generator=g).reshape(3, 2).to(I32)
    kv = torch.full((24, bs, D), float("nan"), dtype=dtype)
    comp = torch.full((6, bs, D), float("nan"), dtype=dtype)
    lens = [22, 31, 10]
    for b, L in enumerate(lens):
        for p in range(L):
            kv[table[b, p // bs], p % bs] = torch.randn(D, generator=g).to(dtype)
        for e in range(L // 4):
            comp[etable[b, e // bs], e % bs] = torch.randn(D, generator=g).to(dtype)
    ws = window_slots(table, seq, pos, block_size=bs, window=W)
    cs = compressed_slots(etable, seq, pos, block_size=bs, rate=4)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    sinks = torch.randn(H, generator=g)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    args = [q, kv, ws, comp, cs, sinks, pos, inv_freq]
    return [a.to(device) for a in args]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink", ["random", "dominant", "none"])
def test_v4_attention_kernel_matches_reference(dtype, sink, splits):
    from mla_compile.ops.triton.v4_attention import _launch

    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(1, dtype)
    if sink == "dominant":
        sinks = torch.full_like(sinks, 30.0)
    elif sink == "none":
        sinks = torch.full_like(sinks, float("-inf"))
    scale = q.shape[-1] ** -0.5
    out, lse = _launch(q, kv, ws, comp, cs, sinks, pos, inv_freq, scale,
                       config=dict(BLOCK_H=2, BLOCK_N=4, SPLITS=splits))
    ref, ref_lse = torch.ops.mla.v4_attention_ref(q.double(), kv.double(), ws, comp.double(), cs, sinks.double(),
                                                  pos, inv_freq.double(), scale)
    assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
    empty = torch.isinf(ref_lse)
    assert empty[3].all() and torch.equal(torch.isinf(lse), empty)  # the padding row sees nothing
    assert (out[3] == 0).all()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    scale_out = ref.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(out.double() / scale_out, ref / scale_out, **tol)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty].double(), atol=1e-3 if dtype != torch.float32
                               else 1e-5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_attention_few_rows_default_and_one_head_merge(dtype):
    """A single query row at the default config takes the few-rows split (16-slot tiles, many splits, a one-head
    merge); six rows with ``MERGE_BLOCK_H=1`` and uneven splits: both against the float64 reference."""
    from mla_compile.ops.triton.v4_attention import _launch, few_rows

    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(2, dtype, W=40)
    scale = q.shape[-1] ** -0.5
    ref, ref_lse = torch.ops.mla.v4_attention_ref(q.double(), kv.double(), ws, comp.double(), cs, sinks.double(),
                                                  pos, inv_freq.double(), scale)
    assert few_rows(1, 1) and few_rows(2, 8) and not few_rows(3, 8)  # one row here: min(32, cdiv(40 + K, 16)) splits
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    scale_out = ref.abs().max().clamp_min(1e-30)
    rows = [_launch(q[t:t + 1], kv, ws[t:t + 1], comp, cs[t:t + 1], sinks, pos[t:t + 1], inv_freq, scale)
            for t in range(q.shape[0])]
    many = _launch(q, kv, ws, comp, cs, sinks, pos, inv_freq, scale,
                   config=dict(BLOCK_H=2, BLOCK_N=4, SPLITS=7, MERGE_BLOCK_H=1))
    for out, lse in (tuple(torch.cat(x) for x in zip(*rows)), many):
        assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
        empty = torch.isinf(ref_lse)
        assert empty[3].all() and torch.equal(torch.isinf(lse), empty) and (out[3] == 0).all()
        torch.testing.assert_close(out.double() / scale_out, ref / scale_out, **tol)
        torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty].double(),
                                   atol=1e-3 if dtype != torch.float32 else 1e-5, rtol=1e-3)


def _compress_steps(seed, overlap, rate, C=24, rope=8):
    """A schedule of calls (3 sequences, uneven chunks crossing window boundaries, padding rows)."""
    g = torch.Generator().manual_seed(seed)
    cin = 2 * C if overlap else C
    lens = [23, 9, 2]
    data = [(torch.randn(L, cin, generator=g), torch.randn(L, cin, generator=g)) for L in lens]
    chunks = [[5, 1, 2], [1, 4, 0], [7, 1, 0], [1, 3, 0], [9, 0, 0]]
    done, steps = [0, 0, 0], []
    for step in chunks:
        seq, pos, kvs, gates = [], [], [], []
        for b, n in enumerate(step):
            for p in range(done[b], done[b] + n):
                seq.append(b), pos.append(p), kvs.append(data[b][0][p]), gates.append(data[b][1][p])
            done[b] += n
        seq.append(-1), pos.append(0), kvs.append(torch.full((cin,), float("nan"))), gates.append(kvs[-1])
        steps.append((torch.stack(kvs), torch.stack(gates), torch.tensor(seq, dtype=I32), torch.tensor(pos, dtype=I32)))
    bias = torch.randn(rate, cin, generator=g)
    norm_w = 1 + 0.2 * torch.randn(C, generator=g)
    inv_freq = 1.0 / (50.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    table = torch.randperm(12, generator=g).reshape(3, 4).to(I32)
    return steps, bias, norm_w, inv_freq, table, cin


@pytest.mark.parametrize("overlap,rate", [(True, 4), (False, 4), (False, 3), (True, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_compress_kernel_matches_reference(overlap, rate, dtype):
    from mla_compile.ops.triton.v4_compress import _launch

    steps, bias, norm_w, inv_freq, table, cin = _compress_steps(rate + 10 * overlap, overlap, rate)
    C = cin // 2 if overlap else cin
    R = 2 * rate if overlap else rate
    state_slot = torch.tensor([2, 0, 3], dtype=I32)
    mine = [torch.full((12, 3, C), float("nan"), dtype=dtype), torch.full((4, R, cin), float("nan"), dtype=dtype),
            torch.full((4, R, cin), float("nan"), dtype=dtype)]
    ref = [t.clone() for t in mine]
    for kv, gate, seq, pos in steps:
        kv, gate = kv.to(dtype), gate.to(dtype)
        _launch(kv, gate, seq, pos, state_slot, mine[1], mine[2], bias, norm_w, inv_freq, mine[0], table, rate,
                1e-6, overlap)
        torch.ops.mla.v4_compress_write_ref(kv, gate, seq, pos, state_slot, ref[1], ref[2], bias, norm_w, inv_freq,
                                            ref[0], table, rate, 1e-6, overlap)
        for a, b in zip(mine, ref):
            assert torch.equal(torch.isnan(a), torch.isnan(b)), "written slots differ"
            tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.float().nan_to_num(), b.float().nan_to_num(), **tol)
    assert not torch.isnan(mine[0]).all()  # entries were written
