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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink", ["random", "dominant", "none"])
def test_v4_attention_kernel_matches_reference(dtype, sink):
    from mla_compile.ops.triton.v4_attention import _launch

    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(1, dtype)
    if sink == "dominant":
        sinks = torch.full_like(sinks, 30.0)
    elif sink == "none":
        sinks = torch.full_like(sinks, float("-inf"))
    scale = q.shape[-1] ** -0.5
    out, lse = _launch(q, kv, ws, comp, cs, sinks, pos, inv_freq, scale, config=dict(BLOCK_H=2, BLOCK_N=4))
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


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_v4_attention_triton_op_cuda_real_dims(dtype):
    """V4-Flash head dims (512 with 64 rope), 64 heads, window 128, through the registered op on CUDA."""
    g = torch.Generator().manual_seed(3)
    T, H, D, bs = 7, 64, 512, 64
    q = torch.randn(T, H, D, generator=g).to(dtype).cuda()
    kv = torch.randn(8, bs, D, generator=g).to(dtype).cuda()
    comp = torch.randn(4, bs, D, generator=g).to(dtype).cuda()
    ws = torch.randint(-1, 8 * bs, (T, 128), generator=g).to(I32).cuda()
    cs = torch.randint(-1, 4 * bs, (T, 200), generator=g).to(I32).cuda()
    cs[2] = -1
    sinks = torch.randn(H, generator=g).cuda()
    pos = torch.randint(0, 10000, (T,), generator=g).to(I32).cuda()
    inv_freq = (1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).cuda()
    out, lse = mla_compile.ops.v4_attention(q, kv, ws, comp, cs, sinks, pos, inv_freq, D ** -0.5, backend="triton")
    ref, ref_lse = torch.ops.mla.v4_attention_ref(q.double(), kv.double(), ws, comp.double(), cs, sinks.double(),
                                                  pos, inv_freq.double(), D ** -0.5)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-2, rtol=1e-3)
