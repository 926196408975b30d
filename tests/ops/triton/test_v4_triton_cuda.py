"""The V4 Triton kernels at DeepSeek-V4-Flash dims on CUDA, through the registered ops, against the reference.

(The small-dims kernel tests run in Triton's interpreter in CI: tests/ops/triton/test_triton_interpret_v4.py.)
"""

from __future__ import annotations

import pytest
import torch

import mla_compile  # noqa: F401  (registers the reference ops)

I32 = torch.int32
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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


@pytest.mark.cuda
@pytest.mark.parametrize("overlap,rate,C", [(True, 4, 512), (False, 128, 512), (True, 4, 128)])
def test_v4_compress_triton_op_cuda_real_dims(overlap, rate, C):
    """V4-Flash compressor dims (CSA 4 with 2 x 512, HCA 128 with 512, the indexer's 2 x 128) on CUDA,
    through the registered op, against the reference on the same inputs: caches and ring state equal."""
    g = torch.Generator().manual_seed(rate + C)
    cin = 2 * C if overlap else C
    R = 2 * rate if overlap else rate
    T = 300
    seq = torch.tensor([0] * 150 + [1] * 149 + [-1], dtype=I32)
    pos = torch.cat([torch.arange(150), torch.arange(37, 186), torch.zeros(1, dtype=torch.long)]).to(I32)
    kv, gate = torch.randn(T, cin, generator=g), torch.randn(T, cin, generator=g)
    bias, norm_w = torch.randn(rate, cin, generator=g), 1 + 0.1 * torch.randn(C, generator=g)
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    table = torch.randperm(16, generator=g).reshape(2, 8).to(I32)
    state_slot = torch.tensor([1, 0], dtype=I32)
    caches = [torch.randn(16, 64, C, generator=g), torch.randn(2, R, cin, generator=g),
              torch.randn(2, R, cin, generator=g)]
    args = [t.cuda() for t in (kv, gate, seq, pos, state_slot)]
    consts = [t.cuda() for t in (bias, norm_w, inv_freq)]
    for backend in ("triton", "reference"):
        got = [t.clone().cuda() for t in caches]
        mla_compile.ops.v4_compress_write(*args, got[1], got[2], *consts, got[0], table.cuda(), rate=rate, eps=1e-6,
                                          overlap=overlap, backend=backend)
        if backend == "triton":
            mine = got
    for a, b in zip(mine, got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
