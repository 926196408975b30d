"""``mla::write_latent_cache_fused`` against the unfused computation (float64 check of the reference op;
the Triton kernel under ``TRITON_INTERPRET=1`` on CPU, and on CUDA when a GPU is present)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import mla_compile  # noqa: F401
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
