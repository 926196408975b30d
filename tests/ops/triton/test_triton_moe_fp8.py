"""``mla::moe_experts_fp8``'s Triton kernels on a GPU: against the float64 per-(token, pick) loop from the math
(block dequantization) at small dims off the tiles and blocks (repeated ids, shared experts, the V4 clamp,
NaN-poisoned allocator, run-to-run equality), and against the reference op at V3's per-expert dims (H 7168,
I 2048; 32 experts, top-8, one shared) for T = 1 and 8, eager and compiled, with the grouped backend beside.
The CPU twins run under Triton's interpreter (tests/ops/test_moe_experts_fp8.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_compile.ops.moe_experts_fp8 import moe_experts_fp8
from tests.ops.test_moe_experts_fp8 import NAMES, experts64, make, rel
from tests.ops.triton._triton_test_util import poison_allocator

DEV = "cuda"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]


def _call(args, **kw):
    return moe_experts_fp8(*args[:9], **dict(zip(NAMES[9:], args[9:])), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,I,E,k,S,limit", [(1, 200, 136, 8, 6, 0, None), (5, 300, 20, 5, 2, 1, 0.05),
                                               (5, 1000, 264, 12, 4, 2, None), (1, 130, 18, 4, 2, 8, None)])
def test_kernels_match_float64_loop(T, H, I, E, k, S, limit, dtype):
    args = make(T, H, I, E, k, S, dtype=dtype, seed=T + H, repeat=True)
    want = experts64(*args, round_to=dtype, limit=limit)
    dev = tuple(None if a is None else a.to(DEV) for a in args)
    poison_allocator(device=DEV)
    out = _call(dev, swiglu_limit=limit, out_float32=True, backend="triton")
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert rel(out.cpu(), want) < (2e-6 if dtype == torch.float32 else 5e-3)
    assert torch.equal(out, _call(dev, swiglu_limit=limit, out_float32=True, backend="triton"))
    low = _call(dev, swiglu_limit=limit, backend="triton")
    assert low.dtype == dtype and rel(low.cpu(), want) < (2e-6 if dtype == torch.float32 else 1e-2)


@pytest.fixture(scope="module")
def v3_args():
    """V3's per-expert dims with 32 experts (fp8 codes and scales made on the GPU), bf16 x for T = 8."""
    H, I, E, k, S = 7168, 2048, 32, 8, 1
    gen = torch.Generator(device=DEV).manual_seed(0)

    def fp8(*shape, fan_in):
        codes = torch.empty(shape, dtype=torch.float8_e4m3fn, device=DEV)
        flat = codes.view(-1, shape[-1])
        for r in range(0, flat.shape[0], 8192):  # chunks bound the float32 temporaries
            rows = flat[r:r + 8192]
            rows.copy_((torch.randn(rows.shape, device=DEV, generator=gen) * 64).clamp(-448, 448))
        blocks = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
        return codes, (torch.rand(blocks, device=DEV, generator=gen) + 0.5) * fan_in ** -0.5 / 64

    ids = torch.stack([torch.randperm(E, device=DEV, generator=gen)[:k] for _ in range(8)]).int()
    weights = torch.rand(8, k, device=DEV, generator=gen) + 0.1
    x = torch.randn(8, H, device=DEV, generator=gen).bfloat16()
    return (x, weights, ids, *fp8(E, I, H, fan_in=H), *fp8(E, I, H, fan_in=H), *fp8(E, H, I, fan_in=I),
            *fp8(S * I, H, fan_in=H), *fp8(S * I, H, fan_in=H), *fp8(H, S * I, fan_in=I))


@pytest.mark.parametrize("T", [1, 8])
def test_v3_dims_against_the_reference_op(v3_args, T):
    args = (v3_args[0][:T], v3_args[1][:T], v3_args[2][:T], *v3_args[3:])
    want = _call(args, out_float32=True, backend="reference")
    poison_allocator(device=DEV)
    fused = _call(args, backend="triton")
    assert fused.dtype == torch.bfloat16 and not fused.isnan().any()
    assert rel(fused, want) < 1e-2
    assert rel(_call(args, out_float32=True, backend="triton"), want) < 2e-3
    assert rel(_call(args, out_float32=True, backend="grouped"), want) < 1e-2
    compiled = torch.compile(lambda *a: _call(a, backend="triton"), fullgraph=True)
    assert rel(compiled(*args), want) < 1e-2


@pytest.mark.parametrize("T,H,I,E,k,S,limit", [(2, 200, 136, 8, 6, 0, None), (5, 300, 20, 5, 2, 1, 0.05)])
def test_masked_tokens_read_no_experts(T, H, I, E, k, S, limit):
    """``token_mask``: masked tokens pick only an expert of NaN codes and scales and have NaN x; "triton" (eager and
    compiled) gives exact 0 there and the unmasked rows elsewhere; "grouped" zeroes the rows of an unpoisoned call."""
    from tests.ops.test_moe_token_mask import poison_masked, random_mask

    args = make(T, H, I, E, k, S, dtype=torch.bfloat16, seed=T + H)
    mask = random_mask(T, seed=T)
    dev = tuple(None if a is None else a.to(DEV) for a in args)
    poisoned = tuple(None if a is None else a.to(DEV) for a in poison_masked(args, mask, (3, 4, 5, 6, 7, 8)))
    mask = mask.to(DEV)
    want = _call(dev, swiglu_limit=limit, out_float32=True, backend="triton")
    compiled = torch.compile(lambda *a, **kw: _call(a, **kw), fullgraph=True)
    for fn in (_call, lambda a, **kw: compiled(*a, **kw)):
        poison_allocator(device=DEV)
        out = fn(poisoned, swiglu_limit=limit, out_float32=True, backend="triton", token_mask=mask)
        assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
        assert torch.equal(out[mask], want[mask])
    unmasked = _call(dev, swiglu_limit=limit, out_float32=True, backend="grouped")
    got = _call(dev, swiglu_limit=limit, out_float32=True, backend="grouped", token_mask=mask)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    torch.testing.assert_close(got[mask], unmasked[mask], atol=0, rtol=0)
