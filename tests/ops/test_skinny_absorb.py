"""``mla::skinny_absorb_q`` / ``mla::skinny_absorb_out``: the absorbed projections on ``kv_b_proj``'s strided per-head
views against float64 products of the same values; the per-head GEMV kernels under Triton's interpreter (CPU) and
on CUDA (eager, compiled with dynamic tokens, CUDA-graph replay); opcheck; errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from mla_compile import ops
from mla_compile.ops.skinny_absorb import MAX_ROWS
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty


def _case(T, H, N, V, C, R, dtype=torch.bfloat16, device="cpu", seed=0):
    """``q_nope, q_pe, out_lat`` and the W_UK / W_UV views of one ``kv_b_proj.weight [H * (N + V), C]``, as
    ``MLAAttention._w_uk_uv`` makes them (strided, no copy)."""
    gen = torch.Generator().manual_seed(seed)
    kv_b = (torch.randn(H * (N + V), C, generator=gen) / C ** 0.5).to(device=device, dtype=dtype)
    w = kv_b.view(H, N + V, C)
    w_uk, w_uv = w[:, :N], w[:, N:]
    q_nope = torch.randn(T, H, N, generator=gen).to(device=device, dtype=dtype)
    q_pe = torch.randn(T, H, R, generator=gen).to(device=device, dtype=dtype)
    out_lat = torch.randn(T, H, C, generator=gen).to(device=device, dtype=dtype)
    return q_nope, w_uk, q_pe, out_lat, w_uv


def _rel(got, want):
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _check_q(q_abs, q_nope, w_uk, q_pe, tol):
    T, H, _ = q_nope.shape
    C = w_uk.shape[2]
    assert q_abs.shape == (T, H, C + q_pe.shape[2]) and q_abs.dtype == q_nope.dtype and q_abs.is_contiguous()
    assert torch.isfinite(q_abs).all()
    want = torch.einsum("thn,hnc->thc", q_nope.double(), w_uk.double())
    assert _rel(q_abs[..., :C], want) < tol
    assert torch.equal(q_abs[..., C:], q_pe.to(q_abs.dtype))


def _check_out(out, out_lat, w_uv, tol):
    T, H, _ = out_lat.shape
    assert out.shape == (T, H * w_uv.shape[1]) and out.dtype == out_lat.dtype and out.is_contiguous()
    assert torch.isfinite(out).all()
    want = torch.einsum("thc,hvc->thv", out_lat.double(), w_uv.double()).reshape(T, -1)
    assert _rel(out, want) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_matches_float64(dtype):
    q_nope, w_uk, q_pe, out_lat, w_uv = _case(3, 4, 16, 12, 40, 8, dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    _check_q(ops.skinny_absorb_q(q_nope, w_uk, q_pe, backend="reference"), q_nope, w_uk, q_pe, tol)
    _check_out(ops.skinny_absorb_out(out_lat, w_uv, backend="reference"), out_lat, w_uv, tol)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("H,N,V,C,R", [(3, 24, 20, 72, 8), (2, 160, 16, 600, 5)])
def test_interpreter_kernels_match_float64(T, H, N, V, C, R):
    """Strided weight views; latent columns off the 64-column tile (72), past one latent step of absorb_out (600 >
    512) and past one nope step of absorb_q (160 > 128); value rows off the 16-row tile (20); a rope width off a
    power of two (5); outputs poisoned with NaN beforehand (every element must be written)."""
    from mla_compile.ops.triton import skinny_absorb as tsa

    q_nope, w_uk, q_pe, out_lat, w_uv = _case(T, H, N, V, C, R, seed=T + N)
    assert not w_uk.is_contiguous() and not w_uv.is_contiguous()
    with poisoned_empty():
        q_abs = tsa.launch_q(q_nope, w_uk, q_pe)
        out = tsa.launch_out(out_lat, w_uv)
    _check_q(q_abs, q_nope, w_uk, q_pe, 1e-2)  # bf16 outputs: one rounding of float32 sums
    _check_out(out, out_lat, w_uv, 1e-2)
    assert torch.equal(q_abs, tsa.launch_q(q_nope, w_uk, q_pe)) and torch.equal(out, tsa.launch_out(out_lat, w_uv))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_absorb_q_takes_a_transposed_weight():
    """W_UK as the transpose of a contiguous [H, C, N] tensor (no unit last stride: the kernel path copies it)."""
    from mla_compile.ops.triton import skinny_absorb as tsa

    q_nope, w_uk, q_pe, _, _ = _case(2, 3, 24, 4, 40, 8, seed=9)
    w_t = w_uk.transpose(1, 2).contiguous().transpose(1, 2)
    _check_q(tsa.launch_q(q_nope, w_t, q_pe), q_nope, w_t, q_pe, 1e-2)


def test_opcheck():
    import mla_compile.ops.triton.skinny_absorb  # noqa: F401

    q_nope, w_uk, q_pe, out_lat, w_uv = _case(2, 3, 8, 6, 16, 4, dtype=torch.float32)
    torch.library.opcheck(torch.ops.mla.skinny_absorb_q_triton.default, (q_nope, w_uk, q_pe))
    torch.library.opcheck(torch.ops.mla.skinny_absorb_out_triton.default, (out_lat, w_uv))


def test_compiled_call_matches_eager():
    q_nope, w_uk, q_pe, out_lat, w_uv = _case(3, 2, 8, 6, 16, 4, dtype=torch.float32)
    fn = torch.compile(lambda a, b, c: (ops.skinny_absorb_q(a, w_uk, b), ops.skinny_absorb_out(c, w_uv)),
                       fullgraph=True)
    q_abs, out = fn(q_nope, q_pe, out_lat)
    _check_q(q_abs, q_nope, w_uk, q_pe, 1e-6)
    _check_out(out, out_lat, w_uv, 1e-6)


def test_bad_inputs_name_the_argument():
    q_nope, w_uk, q_pe, out_lat, w_uv = _case(2, 3, 8, 6, 16, 4)
    with pytest.raises(ValueError, match="w_uk"):
        ops.skinny_absorb_q(q_nope, w_uk[:2], q_pe, backend="reference")
    with pytest.raises((ValueError, TypeError), match="w_uk"):
        ops.skinny_absorb_q(q_nope, w_uk.float(), q_pe, backend="reference")
    with pytest.raises(ValueError, match="q_pe"):
        ops.skinny_absorb_q(q_nope, w_uk, q_pe[:1], backend="reference")
    with pytest.raises(ValueError, match="w_uv"):
        ops.skinny_absorb_out(out_lat, w_uv[..., :8], backend="reference")
    with pytest.raises(ValueError, match="out_lat"):
        ops.skinny_absorb_out(out_lat[0], w_uv, backend="reference")


# --- CUDA (the lead's H200 run) ---

# (H, N, V, C, R): V2-Lite (16 heads) and V3 (128 heads), nope 128, v 128, latent 512, rope 64
CUDA_DIMS = [(16, 128, 128, 512, 64), (128, 128, 128, 512, 64)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dims", CUDA_DIMS)
@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_triton_matches_float64(dims, T, dtype):
    q_nope, w_uk, q_pe, out_lat, w_uv = _case(T, *dims, dtype=dtype, device="cuda", seed=T)
    _check_q(ops.skinny_absorb_q(q_nope, w_uk, q_pe, backend="triton"), q_nope, w_uk, q_pe, 5e-3)
    _check_out(ops.skinny_absorb_out(out_lat, w_uv, backend="triton"), out_lat, w_uv, 5e-3)
    bad = out_lat.clone()
    bad[0, 1] = float("nan")
    got = ops.skinny_absorb_out(bad, w_uv, backend="triton").view(T, dims[0], -1)
    assert got[0, 1].isnan().all() and torch.isfinite(got[0, 0]).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_and_graph_replay():
    """torch.compile with dynamic tokens (one graph for 2 and 6 tokens: the GEMV and the bmm inside the op), then a
    CUDA graph of the compiled call at 2 tokens replayed on new inputs."""
    q_nope, w_uk, q_pe, out_lat, w_uv = _case(6, *CUDA_DIMS[0], device="cuda", seed=11)

    def step(a, b, c):
        return ops.skinny_absorb_q(a, w_uk, b, backend="triton"), ops.skinny_absorb_out(c, w_uv, backend="triton")

    fn = torch.compile(step, fullgraph=True, dynamic=True)
    for t in (2, 6):
        q_abs, out = fn(q_nope[:t], q_pe[:t], out_lat[:t])
        _check_q(q_abs, q_nope[:t], w_uk, q_pe[:t], 5e-3)
        _check_out(out, out_lat[:t], w_uv, 5e-3)
    static = [q_nope[:2].clone(), q_pe[:2].clone(), out_lat[:2].clone()]
    fn(*static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_abs, out = fn(*static)
    for s, src in zip(static, (q_nope, q_pe, out_lat)):
        s.copy_(src[3:5])
    graph.replay()
    torch.cuda.synchronize()
    _check_q(q_abs, q_nope[3:5], w_uk, q_pe[3:5], 5e-3)
    _check_out(out, out_lat[3:5], w_uv, 5e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_model_helpers_take_the_ops_once_gpu_tested(monkeypatch):
    """``models.attention.absorb_q`` / ``absorb_out`` run the ops when their Triton backend is the "auto" choice
    (here forced by marking it GPU-tested), with the results of the einsum path."""
    import dataclasses

    from mla_compile.models import attention
    from mla_compile.ops.registry import backends_for

    for op in ("skinny_absorb_q", "skinny_absorb_out"):
        table = backends_for(op)
        monkeypatch.setitem(table, "triton", dataclasses.replace(table["triton"], gpu_tested=True))
    q_nope, w_uk, q_pe, out_lat, w_uv = _case(2, *CUDA_DIMS[0], device="cuda", seed=12)
    calls = []
    real = ops.skinny_absorb_q
    monkeypatch.setattr(ops, "skinny_absorb_q", lambda *a, **k: calls.append(1) or real(*a, **k))
    _check_q(attention.absorb_q(q_nope, w_uk, q_pe), q_nope, w_uk, q_pe, 5e-3)
    _check_out(attention.absorb_out(out_lat, w_uv).reshape(2, -1), out_lat, w_uv, 5e-3)
    assert calls == [1]
