"""``mla::skinny_norm_linear``: the reference op against a float64 loop, the Triton kernel under Triton's interpreter
(CPU) and on CUDA against float64 math of the same half-precision values; bad inputs; opcheck."""

from __future__ import annotations

import pytest
import torch

from mla_compile.ops.skinny_norm_linear import MAX_ROWS, reference, skinny_norm_linear
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

EPS = 1e-6


def _case(M, K, Ns, residual=True, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
    r = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype) if residual else None
    g = (torch.rand(K, generator=gen) + 0.5).to(device=device, dtype=dtype)
    ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to(device=device, dtype=dtype) for N in Ns]
    return x, r, g, ws


def _want(x, r, g, ws):
    """float64 math of the same values: h = x + r, then ``g * h / rms(h)`` (no rounding between), the products."""
    h = x.double() + (r.double() if r is not None else 0)
    normed = g.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return h, [normed @ w.double().t() for w in ws]


def _check(got, x, r, g, ws, tol, h_ulps):
    h, outs = got
    want_h, want = _want(x, r, g, ws)
    assert h.dtype == x.dtype and h.shape == x.shape
    # h is x + r rounded to x's dtype: exact on a GPU; the interpreter's float32 -> bf16 cast truncates (1 ulp)
    assert ((h.double() - want_h).abs() <= h_ulps * want_h.abs() * 2.0 ** -7 + 1e-30).all()
    assert len(outs) == len(ws)
    for y, w in zip(outs, want):
        assert y.dtype == x.dtype and y.shape == w.shape and torch.isfinite(y).all()
        err = float((y.double() - w).norm() / w.norm().clamp_min(1e-30))
        assert err < tol, err


@pytest.mark.parametrize("residual", [True, False])
def test_reference_matches_float64_loop(residual):
    x, r, g, ws = _case(3, 40, [24, 9], residual, dtype=torch.float32)
    h, outs = skinny_norm_linear(x, r, g, EPS, ws, backend="reference")
    for m in range(3):  # row by row, in float64
        row = x[m].double() + (r[m].double() if residual else 0)
        assert torch.allclose(h[m].double(), row, atol=1e-6)
        normed = g.double() * row / torch.sqrt((row * row).sum() / 40 + EPS)
        for y, w in zip(outs, ws):
            assert torch.allclose(y[m].double(), w.double() @ normed, rtol=1e-5, atol=1e-5)
    assert h.data_ptr() != x.data_ptr()  # without a residual h is a copy, never x itself


def test_bad_inputs_name_the_argument():
    x, r, g, ws = _case(2, 16, [8, 4])
    cases = [((x, r[:, :8], g, EPS, ws), "residual"), ((x, r, g[:8], EPS, ws), "norm_weight"),
             ((x, r, g.float(), EPS, ws), "norm_weight"), ((x, r, g, 0.0, ws), "eps"),
             ((x, r, g, EPS, ws + ws[:1]), "weights"), ((x, r, g, EPS, [ws[0], ws[1][:, :8]]), "weights\\[1\\]"),
             ((x[0], r, g, EPS, ws), "x")]
    for args, name in cases:
        with pytest.raises((ValueError, TypeError), match=name):
            skinny_norm_linear(*args, backend="reference")


def test_opcheck():
    x, r, g, ws = _case(2, 32, [8, 4])
    torch.library.opcheck(torch.ops.mla.skinny_norm_linear_ref.default, (x, r, g, EPS, ws))
    torch.library.opcheck(torch.ops.mla.skinny_norm_linear_ref.default, (x, None, g, EPS, ws[:1]))
    import mla_compile.ops.triton.skinny_norm_linear  # noqa: F401
    torch.library.opcheck(torch.ops.mla.skinny_norm_linear_triton.default, (x, r, g, EPS, ws))


def test_auto_takes_the_reference_until_the_kernel_is_gpu_tested():
    from mla_compile import ops

    assert ops.resolve("skinny_norm_linear", torch.device("cuda"), None, dtype=torch.bfloat16).name == "reference"


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("M,K,Ns", [(1, 64, [12]), (2, 600, [40, 3]), (1, 300, [17, 33]), (2, 256, [16])])
def test_interpreter_kernel_matches_float64(M, K, Ns, residual):
    """K off the 256-wide step (several steps: 600, a masked tail: 300), N off the 16-row tile, two weights in one
    launch, one row and two; outputs poisoned with NaN beforehand (every element must be written)."""
    from mla_compile.ops.triton import skinny_norm_linear as tsnl

    x, r, g, ws = _case(M, K, Ns, residual, seed=M + K)
    with poisoned_empty(like=True):
        got = tsnl._launch(x, r, g, EPS, ws)
    _check(got, x, r, g, ws, 1e-2, h_ulps=1)  # bf16 outputs: one rounding of float32 sums
    again = tsnl._launch(x, r, g, EPS, ws)
    assert torch.equal(got[0], again[0]) and all(torch.equal(a, b) for a, b in zip(got[1], again[1]))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("M,K", [(5, 300), (3, 4100)])
def test_interpreter_many_rows_path_matches_float64(M, K, residual):
    """More rows than the GEMV serves: the add + norm kernel (K past one 2048-wide block: 4100; a masked tail: 300)
    and ``F.linear``, outputs poisoned with NaN beforehand."""
    from mla_compile.ops.triton import skinny_norm_linear as tsnl

    x, r, g, ws = _case(M, K, [24, 7], residual, seed=M + K)
    with poisoned_empty(like=True):
        got = tsnl._many_rows(x, r, g, EPS, ws)
    _check(got, x, r, g, ws, 1e-2, h_ulps=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 2, MAX_ROWS + 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_triton_matches_float64_at_deepseek_dims(M, dtype):
    """V2-Lite's input norm + q_proj + kv_a_proj_with_mqa (2048 -> 3072, 576) and V3's (7168 -> 1536, 576), with the
    residual add and without; more rows than the kernel serves run the reference inside the op."""
    for K, Ns in ((2048, [3072, 576]), (7168, [1536, 576])):
        for residual in (True, False):
            x, r, g, ws = _case(M, K, Ns, residual, dtype=dtype, device="cuda", seed=M + K)
            got = skinny_norm_linear(x, r, g, EPS, ws, backend="triton")
            _check(got, x, r, g, ws, 5e-3, h_ulps=1)  # x + r rounded once; exactly as torch: the next line
            assert torch.equal(got[0], x + r if residual else x)
            ref = reference(x, r, g, EPS, ws)
            rel = [float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got[1], ref[1])]
            assert max(rel) < 5e-3, rel
