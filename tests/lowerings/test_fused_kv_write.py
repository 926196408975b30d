"""``mla::write_latent_cache_fused`` against the unfused computation (float64 check of the reference op;
the Triton kernel under ``TRITON_INTERPRET=1`` on CPU, and on CUDA when a GPU is present), for a float
cache and for the fp8 latent cache (uint8 rows: the bytes of ``mla::write_latent_cache_fp8_ref``)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import mla_compile  # noqa: F401
from mla_compile.ops.fp8_cache import dequantize_fp8_rows
from mla_compile.ops.fused_kv_write import rms_norm, rope
from tests.ops.ref64 import generator, randn

SLOTS = [5, -1, 0, 17, 9, 30, 3]  # -1: padding, skipped


def _inputs(seed, dtype, w_dtype, Dc=48, Dr=16, device="cpu"):
    gen = generator(seed)
    T = len(SLOTS)
    lat = randn(gen, T, Dc + Dr + 3, dtype=dtype)[:, :Dc]  # a strided view, like the split of kv_a
    kpe = randn(gen, T, Dr, dtype=dtype)
    w = randn(gen, Dc, dtype=w_dtype)
    cos, sin = randn(gen, T, Dr // 2, dtype=torch.float32), randn(gen, T, Dr // 2, dtype=torch.float32)
    slots = torch.tensor(SLOTS)
    cache = torch.full((4, 8, Dc + Dr), float("nan"), dtype=dtype)
    return [t.to(device) for t in (lat, kpe, w, cos, sin, slots, cache)]


def _expected(lat, kpe, w, cos, sin, slots, cache, eps, interleave):
    out = cache.clone()
    rows = torch.cat([rms_norm(lat, w, eps), rope(kpe, cos, sin, interleave)], -1).to(cache.dtype)
    flat = out.view(-1, cache.shape[-1])
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < flat.shape[0]:
            flat[s] = rows[t]
    return out


def test_reference_op_matches_a_float64_loop():
    lat, kpe, w, cos, sin, slots, cache = _inputs(1, torch.float64, torch.float64, Dc=48, Dr=16)
    slots = torch.tensor([5, -1, 0, 17, 9, 30, 3])
    torch.ops.mla.write_latent_cache_fused(lat, kpe, w, cos, sin, slots, cache, 1e-5, True)
    flat = cache.view(-1, 64)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        x = lat[t]
        want_lat = w * x / torch.sqrt((x * x).mean() + 1e-5)
        ev, od = kpe[t, 0::2], kpe[t, 1::2]
        want_pe = torch.cat([ev * cos[t] - od * sin[t], od * cos[t] + ev * sin[t]])
        torch.testing.assert_close(flat[s], torch.cat([want_lat, want_pe]), atol=1e-5, rtol=1e-5)  # the model computes in fp32
    assert flat[[i for i in range(32) if i not in (5, 0, 17, 9, 30, 3)]].isnan().all()


def test_bad_norm_weight_is_named_before_any_write():
    lat, kpe, w, cos, sin, slots, cache = _inputs(2, torch.float32, torch.float32)
    before = cache.clone()
    with pytest.raises(ValueError, match="norm_weight"):
        torch.ops.mla.write_latent_cache_fused(lat, kpe, w[:-1], cos, sin, slots, cache, 1e-6, True)
    assert torch.equal(before.isnan(), cache.isnan())


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("dtype,w_dtype,interleave", [(torch.float32, torch.float32, True),
                                                      (torch.bfloat16, torch.bfloat16, False),
                                                      (torch.bfloat16, torch.float32, True)])
def test_triton_kernel_in_the_interpreter(dtype, w_dtype, interleave):
    from mla_compile.ops.triton.fused_kv_write import launch

    args = _inputs(3, dtype, w_dtype)
    want = _expected(*args, 1e-6, interleave)
    launch(*args, 1e-6, interleave)
    got = args[-1]
    torch.testing.assert_close(got, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2, equal_nan=True)  # bf16: 2 ulp


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,interleave", [(torch.bfloat16, True), (torch.float16, False), (torch.float32, True)])
def test_cuda_fused_write_matches_the_unfused_ops(dtype, interleave):
    args = _inputs(4, dtype, dtype, Dc=512, Dr=64, device="cuda")
    want = _expected(*args, 1e-6, interleave)
    torch.ops.mla.write_latent_cache_fused(*args, 1e-6, interleave)
    tol = dict(atol=1e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(args[-1], want, equal_nan=True, **tol)


# ------------------------------------------------------------------------------------------- fp8 cache

def _fp8_inputs(seed, dtype, w_dtype, Dc=256, Dr=16, device="cpu"):
    """The float inputs with an fp8 cache ``uint8 [4, 8, Dc + Dc / 32 + 2 Dr]`` of 0xFF (NaN) bytes."""
    args = _inputs(seed, dtype, w_dtype, Dc=Dc, Dr=Dr, device=device)
    args[-1] = torch.full((4, 8, Dc + Dc // 32 + 2 * Dr), 0xFF, dtype=torch.uint8, device=device)
    return args


def _fp8_expected(lat, kpe, w, cos, sin, slots, cache, eps, interleave):
    """The unfused path: the model's norm and rope, then the reference fp8 write op."""
    out = cache.clone()
    torch.ops.mla.write_latent_cache_fp8_ref(rms_norm(lat, w, eps), rope(kpe, cos, sin, interleave), slots, out)
    return out


def assert_fp8_rows_close(got, want, Dc):
    """fp8 caches whose rows were written from a norm computed in another summation order (or with
    another bf16 rounding, as in Triton's interpreter, whose casts truncate): the same rows written, each
    group scale and bf16 rope value within 2 bf16 ulps (2**-6: the norm is rounded twice, before and
    after the weight), each e4m3 code at most one step from the other (same sign), most codes equal."""
    got, want = got.view(-1, got.shape[-1]), want.view(-1, want.shape[-1])
    assert torch.equal(got.eq(0xFF).all(-1), want.eq(0xFF).all(-1))  # the same rows written
    live = ~want.eq(0xFF).all(-1)
    got, want = got[live], want[live]
    sg, sw = (r[:, Dc:Dc + Dc // 32].contiguous().view(torch.float32) for r in (got, want))
    torch.testing.assert_close(sg, sw, atol=0, rtol=2 ** -6)
    cg, cw = got[:, :Dc].int(), want[:, :Dc].int()
    mg, mw = cg & 0x7F, cw & 0x7F
    assert ((mg - mw).abs() <= 1).all() and (((cg ^ cw) & 0x80 == 0) | (mg + mw <= 1)).all()
    pe_g, pe_w = (dequantize_fp8_rows(r, Dc)[1] for r in (got, want))
    torch.testing.assert_close(pe_g, pe_w, atol=0, rtol=2 ** -6)
    assert cg.eq(cw).float().mean() > 0.9


def test_fp8_reference_writes_the_unfused_bytes():
    args = _fp8_inputs(5, torch.bfloat16, torch.bfloat16)
    want = _fp8_expected(*args, 1e-6, False)
    torch.ops.mla.write_latent_cache_fused(*args, 1e-6, False)
    assert torch.equal(args[-1], want)  # the same torch math and the same quantizer: identical bytes
    flat = args[-1].view(-1, args[-1].shape[-1])
    written = [s for s in SLOTS if s >= 0]
    assert flat[[i for i in range(32) if i not in written]].eq(0xFF).all()
    assert not flat[written].eq(0xFF).all(-1).any()
    lat, kpe, w, cos, sin = (t.double() for t in args[:5])  # and it is the norm + rope, quantized (float64)
    want_lat = w * lat / torch.sqrt((lat * lat).mean(-1, keepdim=True) + 1e-6)
    got_lat, got_pe = dequantize_fp8_rows(flat[written], 256)
    keep = [t for t, s in enumerate(SLOTS) if s >= 0]
    torch.testing.assert_close(got_lat.double(), want_lat[keep], atol=0.07 * want_lat.abs().max(), rtol=0.07)
    x1, x2 = kpe[keep].chunk(2, -1)
    want_pe = torch.cat([x1 * cos[keep] - x2 * sin[keep], x2 * cos[keep] + x1 * sin[keep]], -1)
    torch.testing.assert_close(got_pe.double(), want_pe, atol=2e-2, rtol=2e-2)


def test_fp8_cache_of_the_wrong_width_is_named_before_any_write():
    lat, kpe, w, cos, sin, slots, cache = _fp8_inputs(6, torch.float32, torch.float32)
    bad = cache[..., :-2].clone()
    with pytest.raises(ValueError, match=r"write_latent_cache_fused: kv_cache.*\[num_blocks, block_size, 296\] uint8 fp8 rows"):
        torch.ops.mla.write_latent_cache_fused(lat, kpe, w, cos, sin, slots, bad, 1e-6, True)
    assert bad.eq(0xFF).all()
    with pytest.raises(ValueError, match="write_latent_cache_fused: latent.*multiple of 128"):
        torch.ops.mla.write_latent_cache_fused(lat[:, :200], kpe, w[:200], cos, sin, slots, cache, 1e-6, True)
    assert cache.eq(0xFF).all()


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("dtype,w_dtype,interleave", [(torch.float32, torch.float32, True),
                                                      (torch.bfloat16, torch.bfloat16, False),
                                                      (torch.bfloat16, torch.float32, True)])
def test_fp8_triton_kernel_in_the_interpreter(dtype, w_dtype, interleave):
    from mla_compile.ops.triton.fused_kv_write import launch

    args = _fp8_inputs(7, dtype, w_dtype, Dc=384)  # 3 groups: BLOCK_DC 512 has a masked-off 4th
    want = _fp8_expected(*args, 1e-6, interleave)
    launch(*args, 1e-6, interleave)
    # not byte-exact: the kernel sums the squares in its own order (an ulp of the norm can move an e4m3
    # code at a rounding boundary), and the interpreter's bf16 casts truncate where the GPU rounds
    assert_fp8_rows_close(args[-1], want, 384)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,interleave", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
def test_cuda_fused_fp8_write_matches_the_unfused_ops(dtype, interleave):
    args = _fp8_inputs(8, dtype, dtype, Dc=512, Dr=64, device="cuda")
    assert args[-1].shape[-1] == 656
    want = _fp8_expected(*args, 1e-6, interleave)
    torch.ops.mla.write_latent_cache_fused(*args, 1e-6, interleave)
    assert_fp8_rows_close(args[-1].cpu(), want.cpu(), 512)  # the kernel's norm sums in its own order


@pytest.mark.parametrize("fp8", [False, True])
def test_opcheck_float_and_fp8_cache(fp8):
    args = _fp8_inputs(9, torch.float32, torch.float32) if fp8 else _inputs(9, torch.float32, torch.float32)
    args[-1] = args[-1].zero_()  # opcheck compares the mutated cache between runs: no NaN
    torch.library.opcheck(torch.ops.mla.write_latent_cache_fused.default, (*args, 1e-6, True))
