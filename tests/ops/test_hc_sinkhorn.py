"""``mla::hc_sinkhorn`` (DeepSeek-V4's mHC mixing matrices) against a float64 per-token model written with Python
floats: the reference op, the Triton kernel under Triton's interpreter (NaN-poisoned outputs, padded widths, token
counts off the block), opcheck, the fake, errors naming the argument, compiled calls, and on CUDA the kernel eager,
compiled and replayed in a CUDA graph; the V4 model's hyper-connection through the op equals HF's."""

from __future__ import annotations

import math

import pytest
import torch

from mla_compile import ops
from tests.cuda_capture import capture
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

def sinkhorn64(logits: torch.Tensor, iters: int, eps: float) -> list:
    """The contract token by token in float64 Python (lists of lists), independent of torch's kernels."""
    out = []
    for z in logits.double().tolist():
        n = len(z)
        c = []
        for row in z:
            m = max(row)
            e = [math.exp(v - m) for v in row]
            s = sum(e)
            c.append([v / s + eps for v in e])

        def cols(c):
            sums = [sum(c[i][j] for i in range(n)) + eps for j in range(n)]
            return [[c[i][j] / sums[j] for j in range(n)] for i in range(n)]

        c = cols(c)
        for _ in range(iters - 1):
            c = [[v / (sum(row) + eps) for v in row] for row in c]
            c = cols(c)
        out.append(c)
    return out


def _logits(T: int, n: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, n, n, generator=gen, dtype=torch.float64) * 3).to(dtype).to(device)


def _check(got: torch.Tensor, logits: torch.Tensor, iters: int, eps: float, tol: float) -> None:
    want = torch.tensor(sinkhorn64(logits.cpu(), iters, eps), dtype=torch.float64).reshape(logits.shape)
    assert got.shape == logits.shape and got.dtype == logits.dtype and got.is_contiguous()
    err = (got.cpu().double() - want).abs().max().item()
    assert err <= tol, err


CASES = [(7, 4, 20, 1e-6), (5, 2, 5, 1e-6), (3, 3, 1, 1e-3), (40, 4, 3, 0.0), (9, 5, 7, 1e-4)]


@pytest.mark.parametrize("T,n,iters,eps", CASES)
def test_reference_matches_float64_math(T, n, iters, eps):
    logits = _logits(T, n, seed=T * n + iters)
    _check(ops.hc_sinkhorn(logits, iters, eps, backend="reference"), logits, iters, eps, 2e-6)
    got64 = ops.hc_sinkhorn(logits.double(), iters, eps, backend="reference")
    _check(got64, logits.double(), iters, eps, 1e-12)


def test_the_result_is_doubly_stochastic_after_many_rounds():
    """The property the normalisation is for: after enough rounds rows and columns each sum to ~1."""
    logits = _logits(6, 4, seed=3)
    c = ops.hc_sinkhorn(logits.double(), 200, 0.0, backend="reference")
    assert torch.allclose(c.sum(-1), torch.ones(6, 4, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(c.sum(-2), torch.ones(6, 4, dtype=torch.float64), atol=1e-12)


def test_no_tokens():
    out = ops.hc_sinkhorn(torch.empty(0, 4, 4), 20, 1e-6)
    assert out.shape == (0, 4, 4)


def test_opcheck_and_fake():
    logits = _logits(5, 4, seed=11)
    torch.library.opcheck(torch.ops.mla.hc_sinkhorn_ref.default, (logits, 20, 1e-6))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.mla.hc_sinkhorn_ref(torch.empty(9, 4, 4), 3, 1e-6)
    assert out.shape == (9, 4, 4) and out.dtype == torch.float32


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: ops.hc_sinkhorn(torch.randn(3, 4, 5), 2, 1e-6), ValueError, r"logits must be \[T, n, n\]"),
    (lambda: ops.hc_sinkhorn(torch.randn(3, 16), 2, 1e-6), ValueError, "logits must have 3 dims"),
    (lambda: ops.hc_sinkhorn(torch.randn(3, 4, 4, dtype=torch.bfloat16), 2, 1e-6, backend="reference"), TypeError,
     "logits must have dtype"),
    (lambda: ops.hc_sinkhorn(torch.randn(3, 4, 4), 0, 1e-6), ValueError, "iters must be >= 1"),
    (lambda: ops.hc_sinkhorn(torch.randn(3, 4, 4), 2, -1.0), ValueError, "eps must be >= 0"),
])
def test_bad_input_names_the_argument(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend, fresh_dynamo):
    logits = _logits(6, 4, seed=5)
    fn = torch.compile(lambda z: ops.hc_sinkhorn(z * 0.5 + 1.0, 20, 1e-6), fullgraph=True, backend=backend)
    torch.testing.assert_close(fn(logits), ops.hc_sinkhorn(logits * 0.5 + 1.0, 20, 1e-6), rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("T,n,iters,eps", CASES + [(33, 4, 20, 1e-6), (1, 8, 4, 1e-6), (3, 6, 9, 1e-6), (2, 1, 3, 1e-6)])
def test_interpreter_matches_float64_math(T, n, iters, eps):
    from mla_compile.ops.triton.hc_sinkhorn import _launch

    logits = _logits(T, n, seed=100 + T * n + iters)
    with poisoned_empty():
        got = _launch(logits, iters, eps)
    _check(got, logits, iters, eps, 2e-6)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_strided_input_and_the_width_bound():
    from mla_compile.ops.triton.hc_sinkhorn import _launch

    wide = _logits(5, 4, seed=2).repeat(1, 1, 2)[:, :, 1:5]  # non-contiguous [5, 4, 4]
    _check(_launch(wide, 6, 1e-6), wide, 6, 1e-6, 2e-6)
    with pytest.raises(ValueError, match="at most 8"):
        _launch(torch.randn(2, 9, 9), 2, 1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,n,iters,eps", [(7, 4, 20, 1e-6), (1000, 4, 20, 1e-6), (37, 3, 5, 1e-3), (4, 8, 8, 1e-6)])
def test_cuda_triton_matches_float64(T, n, iters, eps):
    logits = _logits(T, n, seed=T + n, device="cuda")
    out = torch.full((T, n, n), float("nan"), device="cuda")
    out.copy_(ops.hc_sinkhorn(logits, iters, eps, backend="triton"))
    _check(out, logits, iters, eps, 2e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_and_graph_replay(fresh_dynamo):
    """torch.compile with dynamic tokens (one graph for 3 and 50 tokens) through "auto", then a CUDA graph of the
    compiled call replayed on new logits."""
    logits = _logits(50, 4, seed=9, device="cuda")
    fn = torch.compile(lambda z: ops.hc_sinkhorn(z, 20, 1e-6), fullgraph=True, dynamic=True)
    for t in (3, 50):
        _check(fn(logits[:t]), logits[:t], 20, 1e-6, 2e-6)
    static = logits[:8].clone()
    graph, out = capture(fn, static)
    static.copy_(logits[20:28])
    graph.replay()
    torch.cuda.synchronize()
    _check(out, logits[20:28], 20, 1e-6, 2e-6)


def test_v4_hyper_connection_through_the_op_equals_hf():
    """The V4 model's mHC weights (``mla::hc_sinkhorn`` inside) against HF's ``DeepseekV4HyperConnection`` on the
    toy's weights: the same post, comb and collapsed streams."""
    pytest.importorskip("transformers")
    from mla_compile.app import v4_toy
    from mla_compile.models.v4_model import hyper_connection, patch_v4

    hf = v4_toy.toy_v4_model(seed=0)
    patch_v4(hf)
    hc = hf.model.layers[0].attn_hc
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, hf.config.hc_mult, hf.config.hidden_size, generator=gen)
    got = hyper_connection(hc, x)
    with torch.no_grad():
        want = hc(x.unsqueeze(0))  # HF: [batch, seq, n, hidden]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.squeeze(0), rtol=1e-5, atol=1e-6)
