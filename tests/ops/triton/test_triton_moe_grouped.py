"""The "triton-grouped" ``mla::moe_experts`` on a GPU at DeepSeek-V2-Lite dims (bf16, T = 64 and 256: nearly every
expert hit; V3 dims at T = 64): against the float32 reference op and the float64 per-(token, pick) loop on a few
tokens, NaN-poisoned allocator, run-to-run equality, a token count off every block size; then compiled
(fullgraph) and captured in a CUDA graph, replayed on new inputs. The CPU twins run the kernels under Triton's
interpreter (tests/ops/triton/test_triton_interpret_moe_grouped.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_compile import ops
from tests.cuda_capture import capture
from tests.ops.triton._triton_test_util import poison_allocator
from tests.ops.triton.test_triton_moe import DIMS, _experts64, _reference32, _rel, _routing, _weights

DEV = "cuda"  # a CPU dry run of the test code sets "cpu"
SLACK = 1.0  # and this to 2: the interpreter's float32 -> bf16 cast truncates (the GPU's rounds to nearest)
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]


@pytest.fixture(scope="module", params=["v2-lite", "v3"])
def weights(request):
    w = _weights(request.param)
    yield request.param, w
    del w
    torch.cuda.empty_cache()


def _call(x, w, ids, gate_up, down, sg, su, sd, out_float32=True, token_mask=None):
    return ops.moe_experts(x, w, ids, gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd,
                           out_float32=out_float32, backend="triton-grouped", token_mask=token_mask)


@pytest.mark.parametrize("T", [64, 201, 256])
def test_matches_the_reference_at_model_dims(weights, T):
    name, (gate_up, down, sg, su, sd) = weights
    H, I, E, k, _ = DIMS[name]
    if name == "v3" and T != 64:
        pytest.skip("V3 dims at T=64 only (the float32 reference walks 256 experts)")
    w, ids = _routing(T, E, k, seed=T)
    x = torch.randn(T, H, device=DEV).bfloat16()
    want = _reference32(x, w, ids, gate_up, down, sg, su, sd)
    poison_allocator(device=DEV)
    out = _call(x, w, ids, gate_up, down, sg, su, sd)
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert _rel(out, want) < 8e-3 * SLACK, _rel(out, want)
    assert torch.equal(out, _call(x, w, ids, gate_up, down, sg, su, sd)), "run-to-run results must be bitwise equal"
    low = _call(x, w, ids, gate_up, down, sg, su, sd, out_float32=False)
    assert low.dtype == torch.bfloat16 and _rel(low, want) < 1e-2 * SLACK
    # a few tokens against the float64 loop (the reference op itself rounds like the kernels)
    want64 = _experts64(x[:4], w[:4], ids[:4], gate_up, down, sg, su, sd)
    assert _rel(out[:4], want64) < 4e-3 * SLACK, _rel(out[:4], want64)


def test_token_mask_at_model_dims():
    """A step of 200 real tokens padded to 256 (the padding holds NaN and picks arbitrary experts): its rows are 0,
    the real ones as the reference on the real tokens alone."""
    H, I, E, k, _ = DIMS["v2-lite"]
    gate_up, down, sg, su, sd = _weights("v2-lite", seed=2)
    T, real = 256, 200
    w, ids = _routing(T, E, k, seed=4)
    x = torch.randn(T, H, device=DEV).bfloat16()
    x[real:] = float("nan")
    mask = torch.arange(T, device=DEV) < real
    want = _reference32(x[:real], w[:real], ids[:real], gate_up, down, sg, su, sd)
    poison_allocator(device=DEV)
    out = _call(x, w, ids, gate_up, down, sg, su, sd, token_mask=mask)
    assert (out[real:] == 0).all() and not out.isnan().any()
    assert _rel(out[:real], want) < 8e-3 * SLACK, _rel(out[:real], want)


@pytest.mark.parametrize("masked", [False, True])
def test_compiled_and_captured_in_a_cuda_graph(masked):
    """fullgraph compile, then one CUDA graph replayed on new routing and tokens (and, ``masked``, a token mask
    that changes between replays): equals the eager op's bits."""
    H, I, E, k, _ = DIMS["v2-lite"]
    gate_up, down, sg, su, sd = _weights("v2-lite", seed=1)
    T = 64
    w, ids = _routing(T, E, k, seed=1)
    x = torch.randn(T, H, device=DEV).bfloat16()
    mask = torch.ones(T, dtype=torch.bool, device=DEV) if masked else None
    fn = torch.compile(lambda a, b, c, m: _call(a, b, c, gate_up, down, sg, su, sd, out_float32=False, token_mask=m),
                       fullgraph=True)
    graph, out = capture(fn, x, w, ids, mask)
    for seed, real in ((2, 50), (3, 64)):
        w2, ids2 = _routing(T, E, k, seed=seed)
        x2 = torch.randn(T, H, device=DEV).bfloat16()
        x.copy_(x2)
        w.copy_(w2)
        ids.copy_(ids2)
        mask2 = torch.arange(T, device=DEV) < real if masked else None
        if masked:
            mask.copy_(mask2)
        poison_allocator(device=DEV)
        graph.replay()
        torch.cuda.synchronize()
        eager = _call(x2, w2, ids2, gate_up, down, sg, su, sd, out_float32=False, token_mask=mask2)
        assert torch.equal(out, eager), seed
        want = torch.ops.mla.moe_experts_ref(x2, w2, ids2, gate_up, down, sg, su, sd, True, mask2)
        assert _rel(out, want) < 1e-2 * SLACK
