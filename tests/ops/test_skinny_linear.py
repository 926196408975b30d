"""``mla::skinny_linear``: the reference op, the Triton GEMV under Triton's interpreter (CPU) and on CUDA, against
float64 products of the same half-precision values; bad inputs; opcheck."""

from __future__ import annotations

import pytest
import torch

from mla_compile.ops.skinny_linear import MAX_ROWS, skinny_linear
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty


def _case(M, K, Ns, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
    ws = [(torch.randn(N, K, generator=gen) / K ** 0.5).to(device=device, dtype=dtype) for N in Ns]
    return x, ws


# the GEMV's forms, forced by ``PIPE["min_bytes"]``: the one-step form (a huge threshold; K past MAX_BLOCK_K still
# takes the pipelined one) and the pipelined form (every weight)
FORMS = {"one-step": 1 << 62, "pipelined": 0}


def _form(monkeypatch, form):
    from mla_compile.ops.triton import skinny_linear as tsl

    monkeypatch.setitem(tsl.PIPE, "min_bytes", FORMS[form])


def _check(outs, x, ws, tol):
    assert len(outs) == len(ws)
    for y, w in zip(outs, ws):
        want = x.double() @ w.double().t()
        assert y.dtype == x.dtype and y.shape == want.shape
        assert torch.isfinite(y).all()
        err = float((y.double() - want).norm() / want.norm().clamp_min(1e-30))
        assert err < tol, err


@pytest.mark.parametrize("Ns", [[24], [20, 9]])
def test_reference_matches_float64(Ns):
    x, ws = _case(3, 40, Ns, dtype=torch.float32)
    _check(skinny_linear(x, ws, backend="reference"), x, ws, 1e-6)


def test_bad_inputs_name_the_argument():
    x, ws = _case(2, 16, [8, 4])
    with pytest.raises(ValueError, match="weights\\[1\\]"):
        skinny_linear(x, [ws[0], ws[1][:, :8]], backend="reference")
    with pytest.raises(ValueError, match="weights"):
        skinny_linear(x, ws + ws[:1], backend="reference")
    with pytest.raises((ValueError, TypeError), match="x"):
        skinny_linear(x[0], ws, backend="reference")
    with pytest.raises((ValueError, TypeError), match="weights\\[0\\]"):
        skinny_linear(x, [ws[0].float()], backend="reference")


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("M,K,Ns", [(1, 64, [12]), (2, 96, [9, 5]), (5, 4100, [7, 6]), (3, 32, [1, 13]),
                                    (2, 600, [40, 3])])
def test_interpreter_kernel_matches_float64(M, K, Ns, form, monkeypatch):
    """Rows of x off the row block, K off the tile (and past one K step: 4100 > 2048; the pipelined form's 256-wide
    steps: 600), N off the 4- and 16-row tiles, two weights in one launch; outputs poisoned with NaN beforehand
    (every element must be written)."""
    from mla_compile.ops.triton import skinny_linear as tsl

    _form(monkeypatch, form)
    x, ws = _case(M, K, Ns, seed=M + K)
    with poisoned_empty():
        outs = tsl._launch(x, ws)
    _check(outs, x, ws, 1e-2)  # bf16 outputs: one rounding of float32 sums
    again = tsl._launch(x, ws)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))


def test_opcheck():
    x, ws = _case(2, 32, [8, 4])
    torch.library.opcheck(torch.ops.mla.skinny_linear_ref.default, (x, ws))
    import mla_compile.ops.triton.skinny_linear  # noqa: F401
    torch.library.opcheck(torch.ops.mla.skinny_linear_triton.default, (x, ws))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("M", [1, 2, 5, 8, MAX_ROWS, MAX_ROWS + 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_triton_matches_float64_at_deepseek_dims(M, dtype, form, monkeypatch):
    """V2-Lite's q_proj + kv_a_proj_with_mqa (2048 -> 3072, 576) and V3's o_proj (16384 -> 7168) shapes."""
    _form(monkeypatch, form)
    x, ws = _case(M, 2048, [3072, 576], dtype=dtype, device="cuda", seed=M)
    _check(skinny_linear(x, ws, backend="triton"), x, ws, 5e-3)
    x, ws = _case(M, 16384, [7168], dtype=dtype, device="cuda", seed=M + 1)
    _check(skinny_linear(x, ws, backend="triton"), x, ws, 5e-3)
    x2 = x.clone()
    x2[0] = float("nan")
    bad = skinny_linear(x2, ws, backend="triton")[0]
    assert bad[0].isnan().all() and (M == 1 or torch.isfinite(bad[1:]).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_and_graph_replay():
    """Through torch.compile (dynamic rows, one graph for 2 and 6 rows) and a CUDA graph of the compiled call."""
    x, ws = _case(6, 2048, [3072, 576], device="cuda", seed=3)
    fn = torch.compile(lambda a: skinny_linear(a, ws, backend="triton"), fullgraph=True, dynamic=True)
    for m in (2, 6):
        _check(fn(x[:m]), x[:m], ws, 5e-3)
    static = x[:2].clone()
    fn(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(static)
    static.copy_(x[2:4])
    graph.replay()
    _check(outs, x[2:4], ws, 5e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", list(FORMS))
def test_cuda_pdl_chain_reads_each_previous_output(form, monkeypatch):
    """On sm_90 the kernel is launched with programmatic dependent launch (``ops/triton/_pdl.py``): it may start
    while the kernel before it runs and requests its weights before it waits. A chain of 24 calls, each reading
    the one before's output (and a torch op between some of them), eagerly and replayed from a CUDA graph on new
    inputs, equals the float64 chain of the same bf16 roundings: a missing wait would read a half-written x."""
    from mla_compile.ops.triton import _pdl

    _form(monkeypatch, form)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert _pdl.enabled(torch.device("cuda")) and _pdl.launch_kwargs(torch.device("cuda"))["launch_pdl"]
    gen = torch.Generator().manual_seed(11)
    ws = [(torch.randn(2048, 2048, generator=gen) / 2048 ** 0.5).cuda().bfloat16() for _ in range(24)]

    def chain(x):
        for i, w in enumerate(ws):
            x = skinny_linear(x, [w], backend="triton")[0]
            if i % 5 == 4:
                x = x * 1.5  # a torch kernel (launched without PDL) between two of ours
        return x

    def reference(x):
        x = x.double()
        for i, w in enumerate(ws):
            x = (x @ w.double().t()).bfloat16().double()
            if i % 5 == 4:
                x = (x.bfloat16() * 1.5).double()
        return x

    def close(got, want):  # the float32 sums may round a value the other way: a small drift over 24 steps
        assert torch.isfinite(got).all()
        assert float((got.double() - want).norm() / want.norm()) < 2e-2

    x = torch.randn(2, 2048, generator=gen).cuda().bfloat16()
    close(chain(x), reference(x))
    static = x.clone()
    chain(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    for seed in (1, 2):
        new = torch.randn(2, 2048, generator=torch.Generator().manual_seed(seed)).cuda().bfloat16()
        static.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        close(out, reference(new))
