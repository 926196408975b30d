"""``mla::hc_pre`` (a DeepSeek-V4 hyper-connection before its block: mixing weights and collapse) against a float64
model written from HF's ``DeepseekV4HyperConnection`` formulas: the reference op, the Triton kernels under Triton's
interpreter (NaN-poisoned outputs, widths off the blocks, bf16 streams and weights), opcheck, the fake, errors naming
the argument, a compiled call; HF's module on the V4 toy; on CUDA the kernels eager, compiled and replayed."""

from __future__ import annotations

import pytest
import torch

from mla_compile import ops
from tests.ops.test_hc_sinkhorn import sinkhorn64
from tests.cuda_capture import capture
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty


def hc64(x, fn, base, scale, iters, norm_eps, hc_eps):
    """HF's formulas in float64: ``(post, comb, collapsed)``."""
    T, n, D = x.shape
    xd = x.double()
    flat = xd.reshape(T, -1)
    flat = flat / torch.sqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = flat @ fn.double().T
    b, s = base.double(), scale.double()
    pre = torch.sigmoid(mixes[:, :n] * s[0] + b[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, n:2 * n] * s[1] + b[n:2 * n])
    logits = mixes[:, 2 * n:].reshape(T, n, n) * s[2] + b[2 * n:].reshape(n, n)
    comb = torch.tensor(sinkhorn64(logits, iters, hc_eps), dtype=torch.float64).reshape(T, n, n)
    collapsed = (pre[:, :, None] * xd).sum(1)
    return post, comb, collapsed


def make(T, n, D, seed, dtype=torch.float32, wdtype=None, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    M = 2 * n + n * n
    x = torch.randn(T, n, D, generator=gen) * 2
    fn = torch.randn(M, n * D, generator=gen) * (n * D) ** -0.5 * 3
    base = torch.randn(M, generator=gen) * 0.5
    scale = torch.rand(3, generator=gen) + 0.5
    w = wdtype or dtype
    return x.to(device, dtype), fn.to(device, w), base.to(device, w), scale.to(device, w)


def _check(got, args, iters, norm_eps, hc_eps, tol):
    want = hc64(*(a.cpu() for a in args), iters, norm_eps, hc_eps)  # float64 on the host, whatever ran the op
    x = args[0]
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    for name, g, w, dt in zip(("post", "comb", "collapsed"), got, want, (wide, wide, x.dtype)):
        assert g.dtype == dt and g.shape == w.shape and g.is_contiguous(), name
        err = ((g.cpu().double() - w).norm() / w.norm()).item()
        assert err <= tol, (name, err)


CASES = [(3, 4, 64, 20), (1, 4, 700, 20), (5, 2, 24, 5), (2, 3, 100, 1), (4, 1, 513, 3)]


@pytest.mark.parametrize("T,n,D,iters", CASES)
def test_reference_matches_float64_math(T, n, D, iters):
    args = make(T, n, D, seed=T * D + n)
    _check(ops.hc_pre(*args, iters, 1e-6, 1e-6, backend="reference"), args, iters, 1e-6, 1e-6, 2e-6)
    args64 = tuple(a.double() for a in args)
    _check(ops.hc_pre(*args64, iters, 1e-6, 1e-6, backend="reference"), args64, iters, 1e-6, 1e-6, 1e-12)


def test_opcheck_and_fake():
    args = make(3, 4, 32, seed=1)
    torch.library.opcheck(torch.ops.mla.hc_pre_ref.default, (*args, 5, 1e-6, 1e-6))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        post, comb, out = torch.ops.mla.hc_pre_ref(torch.empty(6, 4, 32, dtype=torch.bfloat16), torch.empty(24, 128),
                                                  torch.empty(24), torch.empty(3), 20, 1e-6, 1e-6)
    assert (post.shape, post.dtype) == ((6, 4), torch.float32) and comb.shape == (6, 4, 4)
    assert (out.shape, out.dtype) == ((6, 32), torch.bfloat16)


@pytest.mark.parametrize("bad,match", [
    (lambda a: ops.hc_pre(a[0][0], *a[1:], 2, 1e-6, 1e-6), "x must have 3 dims"),
    (lambda a: ops.hc_pre(a[0], a[1][:, 1:], *a[2:], 2, 1e-6, 1e-6), r"fn must have shape \[24, 128\]"),
    (lambda a: ops.hc_pre(a[0], a[1], a[2][1:], a[3], 2, 1e-6, 1e-6), r"base must have shape \[24\]"),
    (lambda a: ops.hc_pre(*a[:3], a[3][:2], 2, 1e-6, 1e-6), r"scale must have shape \[3\]"),
    (lambda a: ops.hc_pre(*a, 0, 1e-6, 1e-6), "iters must be >= 1"),
])
def test_bad_input_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(make(2, 4, 32, seed=2))


def test_compiled_equals_eager(fresh_dynamo):
    args = make(3, 4, 48, seed=4)
    fn = torch.compile(lambda *a: ops.hc_pre(*a, 20, 1e-6, 1e-6), fullgraph=True, backend="inductor")
    for g, w in zip(fn(*args), ops.hc_pre(*args, 20, 1e-6, 1e-6)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_v4_toy_hyper_connection_equals_hf():
    """The op on the V4 toy's first hyper-connection against HF's module (float32)."""
    pytest.importorskip("transformers")
    from mla_compile.app import v4_toy

    hf = v4_toy.toy_v4_model(seed=1)
    hc = hf.model.layers[1].ffn_hc
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, hf.config.hc_mult, hf.config.hidden_size, generator=gen)
    eps = hc.input_norm.variance_epsilon if hasattr(hc.input_norm, "variance_epsilon") else hc.input_norm.eps
    got = ops.hc_pre(x, hc.fn, hc.base, hc.scale, hc.hc_sinkhorn_iters, eps, hc.hc_eps)
    with torch.no_grad():
        want = hc(x.unsqueeze(0))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.squeeze(0), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("T,n,D,iters", CASES + [(2, 4, 1024, 20), (3, 8, 40, 4)])
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
def test_interpreter_matches_float64_math(T, n, D, iters, dtype, wdtype):
    from mla_compile.ops.triton.hc_pre import _launch

    args = make(T, n, D, seed=50 + T * n + D, dtype=dtype, wdtype=wdtype)
    with poisoned_empty():
        got = _launch(*args, iters, 1e-6, 1e-6)
    tol = 2e-6 if dtype == torch.float32 else 8e-3  # bf16: collapsed rounded to bf16
    _check(got, args, iters, 1e-6, 1e-6, tol)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_bounds():
    from mla_compile.ops.triton.hc_pre import _launch

    with pytest.raises(ValueError, match="at most 8 streams"):
        _launch(*make(1, 9, 8, seed=0), 2, 1e-6, 1e-6)
    post, comb, out = _launch(*make(0, 4, 16, seed=0), 2, 1e-6, 1e-6)
    assert post.shape == (0, 4) and comb.shape == (0, 4, 4) and out.shape == (0, 16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,n,D,dtype", [(1, 4, 4096, torch.bfloat16), (2, 4, 4096, torch.bfloat16),
                                         (64, 4, 4096, torch.bfloat16), (7, 4, 700, torch.float32),
                                         (300, 4, 256, torch.bfloat16)])
def test_cuda_triton_matches_float64(T, n, D, dtype):
    args = make(T, n, D, seed=T + D, dtype=dtype, device="cuda")
    got = ops.hc_pre(*args, 20, 1e-6, 1e-6, backend="triton")
    _check(got, args, 20, 1e-6, 1e-6, 2e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_and_graph_replay(fresh_dynamo):
    """Compiled through the Triton backend with dynamic tokens, then a CUDA graph of the compiled call replayed on
    new streams."""
    x, fn, base, scale = make(40, 4, 1024, seed=8, dtype=torch.bfloat16, device="cuda")
    f = torch.compile(lambda a: ops.hc_pre(a, fn, base, scale, 20, 1e-6, 1e-6, backend="triton"), fullgraph=True,
                      dynamic=True)
    for t in (2, 40):
        _check(f(x[:t]), (x[:t], fn, base, scale), 20, 1e-6, 1e-6, 8e-3)
    static = x[:4].clone()
    graph, outs = capture(f, static)
    for rows in (x[30:34], x[10:14]):
        static.copy_(rows)
        graph.replay()
        torch.cuda.synchronize()
        _check(outs, (rows, fn, base, scale), 20, 1e-6, 1e-6, 8e-3)
