"""``mla::moe_experts_fp4``'s Triton kernels on a GPU: against the float64 per-(token, pick) loop from the format's
independent float64 model at small dims off the tiles (repeated ids, every code in both nibbles, the V4 clamp,
NaN-poisoned allocator, run-to-run equality), and against the reference op at DeepSeek-V4-Flash's expert dims
(hidden 4096, width 2048; 32 experts, top-6) for T = 1, 8 and 64, eager and compiled, with the grouped backend and
"auto" beside. The CPU twins run under Triton's interpreter (tests/ops/test_moe_experts_fp4.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_compile.ops.moe_experts_fp4 import moe_experts_fp4
from tests.ops.test_moe_experts_fp4 import experts64, make, rel
from tests.ops.triton._triton_test_util import poison_allocator

DEV = "cuda"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,I,E,k,limit,every_code", [
    (1, 1056, 160, 8, 6, None, True), (5, 96, 544, 5, 2, 0.05, False), (9, 64, 96, 6, 3, None, False)])
def test_kernels_match_float64_loop(T, H, I, E, k, limit, every_code, dtype):
    args = make(T, H, I, E, k, dtype=dtype, seed=T + H, repeat=True, every_code=every_code)
    want = experts64(*args, round_to=dtype, limit=limit)
    dev = tuple(a.to(DEV) for a in args)
    poison_allocator(device=DEV)
    out = moe_experts_fp4(*dev, swiglu_limit=limit, out_float32=True, backend="triton")
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert rel(out.cpu(), want) < (2e-6 if dtype == torch.float32 else 5e-3)
    assert torch.equal(out, moe_experts_fp4(*dev, swiglu_limit=limit, out_float32=True, backend="triton"))
    low = moe_experts_fp4(*dev, swiglu_limit=limit, backend="triton")
    assert low.dtype == dtype and rel(low.cpu(), want) < (2e-6 if dtype == torch.float32 else 1e-2)


@pytest.fixture(scope="module")
def v4_args():
    """V4-Flash's expert dims with 32 experts (random codes and scales near 2^-7 made on the GPU), bf16 x for 64
    tokens."""
    H, I, E, k, T = 4096, 2048, 32, 6, 64
    gen = torch.Generator(device=DEV).manual_seed(0)

    def fp4(*shape):
        *lead, n, c = shape
        codes = torch.randint(0, 256, (*lead, n, c // 2), dtype=torch.uint8, device=DEV, generator=gen)
        scales = torch.randint(118, 122, (*lead, n, c // 32), dtype=torch.uint8, device=DEV, generator=gen)
        return codes, scales

    ids = torch.stack([torch.randperm(E, device=DEV, generator=gen)[:k] for _ in range(T)]).int()
    weights = torch.rand(T, k, device=DEV, generator=gen) + 0.1
    x = torch.randn(T, H, device=DEV, generator=gen).bfloat16()
    return (x, weights, ids, *fp4(E, I, H), *fp4(E, I, H), *fp4(E, H, I))


@pytest.mark.parametrize("T", [1, 8, 64])
def test_v4_dims_against_the_reference_op(v4_args, T):
    args = (v4_args[0][:T], v4_args[1][:T], v4_args[2][:T], *v4_args[3:])
    want = moe_experts_fp4(*args, swiglu_limit=10.0, out_float32=True, backend="reference")
    poison_allocator(device=DEV)
    fused = moe_experts_fp4(*args, swiglu_limit=10.0, backend="triton")
    assert fused.dtype == torch.bfloat16 and not fused.isnan().any()
    assert rel(fused, want) < 1e-2
    assert rel(moe_experts_fp4(*args, swiglu_limit=10.0, out_float32=True, backend="triton"), want) < 2e-3
    assert rel(moe_experts_fp4(*args, swiglu_limit=10.0, out_float32=True, backend="grouped"), want) < 1e-2
    assert rel(moe_experts_fp4(*args, swiglu_limit=10.0, out_float32=True), want) < 1e-2  # "auto"
    compiled = torch.compile(lambda *a: moe_experts_fp4(*a, swiglu_limit=10.0, backend="triton"), fullgraph=True)
    assert rel(compiled(*args), want) < 1e-2
