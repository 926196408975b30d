"""``mla::write_latent_cache_absorb_q``: the cache rows and the absorbed queries (q_pe rotated) against float64
loops, for a float cache and the fp8 one (the rows' bytes as ``mla::write_latent_cache_fused`` writes them); the Triton
launch under Triton's interpreter and on CUDA; compiled for sm_90 on the CPU; opcheck, the fake, errors before any
write, "auto" before the kernel is GPU-tested."""

from __future__ import annotations

import pytest
import torch

from mla_compile import ops
from mla_compile.ops.fused_kv_write import rms_norm, rope
from mla_compile.ops.write_absorb_q import MAX_ROWS
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

EPS = 1e-6


def _inputs(T, H=3, N=32, Dc=64, Dr=16, dtype=torch.float32, fp8=False, device="cpu", seed=0):
    """``(latent, k_pe, norm_weight, cos, sin, slots, cache, q_nope, w_uk, q_pe)``: latent a strided view (the split
    of kv_a), W_UK a strided view (kv_b_proj's), slots with a padding -1 when T > 1; the cache NaN-poisoned."""
    gen = torch.Generator().manual_seed(seed)
    Dc = 128 if fp8 else Dc
    kv = torch.randn(T, Dc + Dr, generator=gen).to(dtype)
    lat, kpe = kv[:, :Dc], kv[:, Dc:]
    w = (torch.rand(Dc, generator=gen) + 0.5).to(dtype)
    ang = torch.rand(T, Dr // 2, generator=gen) * 6
    slots = torch.tensor([5, -1, 20, 0, 11][:T])
    if fp8:
        cache = torch.zeros(4, 8, Dc + Dc // 32 + 2 * Dr, dtype=torch.uint8)
    else:
        cache = torch.full((4, 8, Dc + Dr), float("nan"), dtype=dtype)
    q = torch.randn(T, H, N + Dr, generator=gen).to(dtype)
    kvb = (torch.randn(H, 2 * N, Dc, generator=gen) / N ** 0.5).to(dtype)
    out = (lat, kpe, w, ang.cos(), ang.sin(), slots, cache, q[..., :N], kvb[:, :N], q[..., N:])
    return [t.to(device) for t in out]


def _want(args, interleave):
    """float64: the cache rows as the fused write's reference writes them, q_abs from float64 products."""
    lat, kpe, w, cos, sin, slots, cache, q_nope, w_uk, q_pe = args
    want_cache = cache.clone()
    torch.ops.mla.write_latent_cache_fused(lat.cpu(), kpe.cpu(), w.cpu(), cos.cpu(), sin.cpu(), slots.cpu(),
                                           want_cache.cpu(), EPS, interleave) if cache.is_cpu else None
    T, H, Dr = q_pe.shape
    pe = torch.stack([rope(q_pe[:, h].double().cpu(), cos.double().cpu(), sin.double().cpu(), interleave)
                      for h in range(H)], 1)
    lat_q = torch.einsum("thn,hnc->thc", q_nope.double().cpu(), w_uk.double().cpu())
    return want_cache, torch.cat([lat_q, pe], -1)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_reference_matches_float64(T, interleave):
    args = _inputs(T, dtype=torch.float64, seed=T)
    want_cache, want_q = _want(args, interleave)
    got = ops.write_latent_cache_absorb_q(*args[:7], EPS, interleave, *args[7:], backend="reference")
    torch.testing.assert_close(got, want_q, atol=1e-6, rtol=1e-6)  # the RoPE computes in float32, as the model's
    cache = args[6]
    assert torch.equal(cache.isnan(), want_cache.isnan())
    torch.testing.assert_close(cache.nan_to_num(), want_cache.nan_to_num(), atol=0, rtol=0)
    flat = cache.view(-1, cache.shape[-1])  # the row of token 0 at slot 5, as a float64 loop makes it
    x = args[0][0]
    torch.testing.assert_close(flat[5, :64], args[2] * x / torch.sqrt((x * x).mean() + EPS), atol=1e-6, rtol=1e-6)


def _run_interpreted(args, interleave):
    from mla_compile.ops.triton import write_absorb_q as twa

    with poisoned_empty():
        return twa.launch(*args[:7], EPS, interleave, *args[7:])


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("T", [1, 2])
def test_interpreter_one_launch_matches_the_reference(T, interleave, fp8):
    """The launch's cache rows equal the reference's (a float cache within one rounding: the interpreter truncates
    its casts; fp8 rows decoded), the untouched rows stay as they were, q_abs within bf16 of float64 (q_pe rotated)."""
    from mla_compile.ops.fp8_cache import dequantize_fp8_rows

    args = _inputs(T, dtype=torch.bfloat16, fp8=fp8, seed=10 + T)
    ref_args = [a.clone() for a in args]
    want_q = ops.write_latent_cache_absorb_q(*ref_args[:7], EPS, interleave, *ref_args[7:], backend="reference")
    _, want64 = _want(args, interleave)
    got = _run_interpreted(args, interleave)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want64, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want_q.float(), atol=3e-2, rtol=2e-2)
    cache, ref_cache = args[6], ref_args[6]
    if fp8:
        written = [5, 20][:T]
        rows, ref_rows = (torch.cat(dequantize_fp8_rows(c.view(-1, c.shape[-1])[written], 128), -1)
                          for c in (cache, ref_cache))
        torch.testing.assert_close(rows, ref_rows, atol=0.1, rtol=0.1)
        assert torch.equal(cache.view(-1, cache.shape[-1])[1], ref_cache.view(-1, cache.shape[-1])[1])  # untouched
    else:
        assert torch.equal(cache.isnan(), ref_cache.isnan())
        torch.testing.assert_close(cache.float().nan_to_num(), ref_cache.float().nan_to_num(), atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_refuses_more_tokens():
    from mla_compile.ops.triton import write_absorb_q as twa

    args = _inputs(MAX_ROWS + 1, dtype=torch.bfloat16)
    with pytest.raises(AssertionError):
        twa.launch(*args[:7], EPS, True, *args[7:])


def test_opcheck_and_fake():
    import mla_compile.ops.triton.write_absorb_q  # noqa: F401

    for fp8 in (False, True):
        args = _inputs(2, dtype=torch.float32, fp8=fp8)
        full = (*args[:7], EPS, True, *args[7:])
        torch.library.opcheck(torch.ops.mla.write_latent_cache_absorb_q_ref.default, full)
        torch.library.opcheck(torch.ops.mla.write_latent_cache_absorb_q_triton.default, full)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        out = torch.ops.mla.write_latent_cache_absorb_q_ref(*fake[:7], EPS, True, *fake[7:])
    assert out.shape == (2, 3, 128 + 16) and out.dtype == torch.float32


@pytest.mark.parametrize("which,match", [(9, "q_pe"), (8, "w_uk"), (7, "q_nope"), (2, "norm_weight"), (3, "cos")])
def test_errors_name_the_argument_before_any_write(which, match):
    args = _inputs(2)
    bad = list(args)
    bad[which] = args[which][..., :-2] if which in (9, 8, 2, 3) else args[which][:1]
    before = args[6].clone()
    with pytest.raises((ValueError, TypeError), match=match):
        ops.write_latent_cache_absorb_q(*bad[:7], EPS, True, *bad[7:], backend="reference")
    assert torch.equal(before.isnan(), args[6].isnan())


def test_auto_takes_the_kernel_on_a_gpu():
    """GPU-tested (BENCHMARKS.md run 216): "auto" takes the kernel for CUDA half tensors, the reference elsewhere."""
    from mla_compile.ops.select import Facts, select

    assert select("write_latent_cache_absorb_q", Facts(torch.device("cuda"), torch.bfloat16, cap=(9, 0))).name == "triton"
    assert ops.resolve("write_latent_cache_absorb_q", torch.device("cpu"), None, dtype=torch.bfloat16).name == "reference"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T,H", [(1, 16), (2, 16), (2, 128), (5, 16)])
def test_cuda_matches_the_unfused_ops(T, H, fp8):
    """V2-Lite / V3 widths (nope 128, latent 512 (fp8: 128), rope 64): the one launch (1-2 tokens) and the ops
    inside (5) against the reference (the fused write's torch code + ``mla::absorb_q`` of the rotated q_pe): the
    written rows within one rounding (the kernel's norm sums in its own order; fp8 rows decoded), every other row
    untouched, q_abs within bf16."""
    from mla_compile.ops.fp8_cache import dequantize_fp8_rows

    args = _inputs(T, H=H, N=128, Dc=512, Dr=64, dtype=torch.bfloat16, fp8=fp8, device="cuda", seed=T + H)
    ref = [a.clone() for a in args]
    got = ops.write_latent_cache_absorb_q(*args[:7], EPS, True, *args[7:], backend="triton")
    want = ops.write_latent_cache_absorb_q(*ref[:7], EPS, True, *ref[7:], backend="reference")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    cache, ref_cache = (c.view(-1, c.shape[-1]) for c in (args[6], ref[6]))
    written = [s for s in args[5].tolist() if s >= 0]
    kept = [i for i in range(cache.shape[0]) if i not in written]
    assert torch.equal(cache[kept].view(torch.uint8), ref_cache[kept].view(torch.uint8))
    if fp8:
        rows, ref_rows = (torch.cat(dequantize_fp8_rows(c[written], 128), -1) for c in (cache, ref_cache))
        torch.testing.assert_close(rows, ref_rows, atol=0.1, rtol=0.1)
    else:
        torch.testing.assert_close(cache[written].float(), ref_cache[written].float(), atol=1e-2, rtol=2e-2)
