"""``mla::add_rms_linear``: the reference op against float64 math and against DeepSeek's RMSNorm module, the Triton
kernels under Triton's interpreter (CPU) and on CUDA (eager, compiled, replayed, in a PDL chain), bad inputs,
opcheck."""

from __future__ import annotations

import pytest
import torch

from mla_compile.ops.add_rms_linear import add_rms_linear
from mla_compile.ops.skinny_linear import MAX_ROWS
from tests.ops.triton.conftest import INTERPRET

EPS = 1e-6


def _case(M, K, Ns, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, r = (torch.randn(M, K, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    nw = (1 + 0.3 * torch.randn(K, generator=gen)).to(device=device, dtype=dtype)
    ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to(device=device, dtype=dtype) for N in Ns]
    return h, r, nw, ws


def _want(h, r, nw, ws):
    """float64 math on the same values: the sum rounded as the model's add, the normed rows (not rounded: the
    contract's two roundings are within the tolerance), the products."""
    s = (h + r).double()
    x = nw.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
    return (h + r), [x @ w.double().t() for w in ws]


def _check(outs, h, r, nw, ws, tol, exact_sum=True):
    """``exact_sum``: the sum equals the model's add bit for bit (False under Triton's interpreter, whose float32 ->
    bfloat16 conversion truncates: then within one bf16 step)."""
    s, ys = outs[0], outs[1:]
    want_s, want_ys = _want(h, r, nw, ws)
    assert s.dtype == h.dtype
    if exact_sum:
        assert torch.equal(s, want_s), "the sum is the model's add, rounded to the dtype"
    else:
        torch.testing.assert_close(s.float(), want_s.float(), rtol=2 ** -7, atol=0)
    assert len(ys) == len(ws)
    for y, want in zip(ys, want_ys):
        assert y.dtype == h.dtype and y.shape == want.shape and torch.isfinite(y).all()
        err = float((y.double() - want).norm() / want.norm().clamp_min(1e-30))
        assert err < tol, err


@pytest.mark.parametrize("Ns", [[24], [20, 9]])
def test_reference_matches_float64_and_deepseeks_norm(Ns):
    h, r, nw, ws = _case(3, 40, Ns, dtype=torch.float32)
    outs = add_rms_linear(h, r, nw, EPS, ws, backend="reference")
    _check(outs, h, r, nw, ws, 1e-6)
    # bf16: the norm rounds as DeepSeek's RMSNorm module (HF's DeepseekV3RMSNorm math) and the products as F.linear
    h, r, nw, ws = _case(3, 40, Ns)
    outs = add_rms_linear(h, r, nw, EPS, ws, backend="reference")
    s = h + r
    var = s.float().pow(2).mean(-1, keepdim=True)
    x = nw * (s.float() * torch.rsqrt(var + EPS)).to(torch.bfloat16)
    assert torch.equal(outs[0], s)
    for y, w in zip(outs[1:], ws):
        assert torch.equal(y, torch.nn.functional.linear(x, w))


def test_bad_inputs_name_the_argument():
    h, r, nw, ws = _case(2, 16, [8, 4])
    with pytest.raises(ValueError, match="residual"):
        add_rms_linear(h, r[:, :8], nw, EPS, ws, backend="reference")
    with pytest.raises(ValueError, match="norm_weight"):
        add_rms_linear(h, r, nw[:8], EPS, ws, backend="reference")
    with pytest.raises((ValueError, TypeError), match="norm_weight"):
        add_rms_linear(h, r, nw.float(), EPS, ws, backend="reference")
    with pytest.raises(ValueError, match="weights\\[1\\]"):
        add_rms_linear(h, r, nw, EPS, [ws[0], ws[1][:, :8]], backend="reference")
    with pytest.raises(ValueError, match="weights"):
        add_rms_linear(h, r, nw, EPS, ws + ws[:1], backend="reference")
    with pytest.raises((ValueError, TypeError), match="h"):
        add_rms_linear(h[0], r, nw, EPS, ws, backend="reference")


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("M,K,Ns", [(1, 64, [12]), (2, 96, [9, 5]), (2, 4100, [7, 6]), (3, 32, [1, 13]),
                                    (5, 2100, [6])])
def test_interpreter_kernels_match_float64(M, K, Ns, monkeypatch):
    """Up to 2 rows the GEMV that norms its rows (rows off the row block, K off the tile and past one K step:
    4100 > 2048, N off the 4-row tiles, two weights in one launch); more rows the add + norm kernel and F.linear.
    Outputs poisoned with NaN beforehand (every element must be written); a second launch gives the same bits."""
    from mla_compile.ops.triton import add_rms_linear as tarl

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    h, r, nw, ws = _case(M, K, Ns, seed=M + K)
    outs = tarl._launch(h, r, nw, EPS, ws)
    monkeypatch.setattr(torch, "empty", real_empty)
    # the interpreter truncates to bf16 (the GPU rounds to nearest): the normed rows' two roundings shrink every
    # value by up to 2 steps of 2**-8, not at random, so the bound is twice the GPU test's rounding allowance
    _check(outs, h, r, nw, ws, 2e-2, exact_sum=False)
    again = tarl._launch(h, r, nw, EPS, ws)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))
    ref = add_rms_linear(h, r, nw, EPS, ws, backend="reference")
    for a, b in zip(outs[1:], ref[1:]):  # the same roundings as the reference, up to float32 sum order
        assert float((a.double() - b.double()).norm() / b.double().norm()) < 2e-2


def test_opcheck():
    h, r, nw, ws = _case(2, 32, [8, 4])
    torch.library.opcheck(torch.ops.mla.add_rms_linear_ref.default, (h, r, nw, EPS, ws))
    import mla_compile.ops.triton.add_rms_linear  # noqa: F401
    torch.library.opcheck(torch.ops.mla.add_rms_linear_triton.default, (h, r, nw, EPS, ws))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 2, 5, 8, MAX_ROWS + 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_triton_matches_float64_at_deepseek_dims(M, dtype):
    """V2-Lite's q_proj + kv_a_proj_with_mqa after the input norm (2048 -> 3072, 576) and V3's q_a_proj +
    kv_a_proj_with_mqa (7168 -> 1536, 576: K past one 2048 step); a NaN in one row of h stays in that row."""
    for K, Ns in ((2048, [3072, 576]), (7168, [1536, 576])):
        h, r, nw, ws = _case(M, K, Ns, dtype=dtype, device="cuda", seed=M + K)
        _check(add_rms_linear(h, r, nw, EPS, ws, backend="triton"), h, r, nw, ws, 5e-3)
    h2 = h.clone()
    h2[0, 5] = float("nan")
    bad = add_rms_linear(h2, r, nw, EPS, ws, backend="triton")
    assert bad[1][0].isnan().all() and (M == 1 or torch.isfinite(bad[1][1:]).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_replayed_and_chained():
    """Through torch.compile (dynamic rows: one graph for 2 and 6 rows), a CUDA graph of the compiled call on new
    inputs, and a PDL chain of 12 calls each reading the one before's sum and output (a missing wait would read a
    half-written row) against the float64 chain of the same roundings."""
    h, r, nw, ws = _case(6, 2048, [3072, 576], device="cuda", seed=3)
    fn = torch.compile(lambda a, b: add_rms_linear(a, b, nw, EPS, ws, backend="triton"), fullgraph=True,
                       dynamic=True)
    for m in (2, 6):
        _check(fn(h[:m], r[:m]), h[:m], r[:m], nw, ws, 5e-3)
    sh, sr = h[:2].clone(), r[:2].clone()
    fn(sh, sr)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(sh, sr)
    sh.copy_(h[2:4])
    sr.copy_(r[2:4])
    graph.replay()
    _check(outs, h[2:4], r[2:4], nw, ws, 5e-3)

    gen = torch.Generator().manual_seed(5)
    square = [(torch.randn(2048, 2048, generator=gen) / 2048 ** 0.5).cuda().bfloat16() for _ in range(12)]

    def chain(s, y):
        for w in square:
            s, y = add_rms_linear(s, y, nw, EPS, [w], backend="triton")
        return s, y

    def reference(s, y):
        for w in square:
            s = (s + y)
            x = (s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + EPS)).bfloat16()
            y = ((nw.double() * x.double()).bfloat16().double() @ w.double().t()).bfloat16()
        return s, y

    s0, y0 = h[:2].clone(), r[:2].clone()
    got, want = chain(s0, y0), reference(s0, y0)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and float((a.double() - b.double()).norm() / b.double().norm()) < 2e-2
