"""``mla::moe_experts_fp4``'s Triton kernels on a GPU: against the float64 per-(token, pick) loop from the format's
independent float64 model at small dims off the tiles (repeated ids, every code in both nibbles, the V4 clamp,
NaN-poisoned allocator, run-to-run equality), and against the reference op at DeepSeek-V4-Flash's expert dims
(hidden 4096, width 2048; 32 experts, top-6) for T = 1, 8 and 64, eager and compiled, with the grouped backend and
"auto" beside; the Gluon kernels (backend "gluon") likewise at the dims they serve, with weight-0 picks, the fallback
off those dims, a compiled call and a CUDA-graph replay. The CPU twins run under Triton's interpreter
(tests/ops/test_moe_experts_fp4.py); the Gluon kernels' sm_90 compile is checked on the CPU
(test_triton_sm90_compile_fp4_linear.py)."""

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


# The Gluon kernels ("gluon", ops/triton/moe_experts_fp4_mma.py): dims they serve (H and I multiples of 1024)
@pytest.mark.parametrize("T,H,I,E,k,limit,every_code", [
    (1, 1024, 1024, 8, 6, None, True), (3, 2048, 1024, 5, 2, 0.05, False), (16, 1024, 2048, 9, 4, None, False),
    # above CONFIG["sorted_above"] tokens: the sorted kernels (experts with 0, a few and more than 8 rows)
    (40, 1024, 1024, 12, 3, 0.05, True), (17, 2048, 1024, 64, 6, None, False)])
def test_gluon_kernels_match_float64_loop(T, H, I, E, k, limit, every_code):
    from mla_compile.ops.triton.moe_experts_fp4_mma import eligible

    args = make(T, H, I, E, k, dtype=torch.bfloat16, seed=T + H, repeat=True, every_code=every_code)
    assert eligible(args[0], I), "these dims must run the Gluon kernels, not the Triton fallback"
    want = experts64(*args, round_to=torch.bfloat16, limit=limit)
    dev = tuple(a.to(DEV) for a in args)
    poison_allocator(device=DEV)
    out = moe_experts_fp4(*dev, swiglu_limit=limit, out_float32=True, backend="gluon")
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert rel(out.cpu(), want) < 5e-3
    assert torch.equal(out, moe_experts_fp4(*dev, swiglu_limit=limit, out_float32=True, backend="gluon"))
    low = moe_experts_fp4(*dev, swiglu_limit=limit, backend="gluon")
    assert low.dtype == torch.bfloat16 and rel(low.cpu(), want) < 1e-2


@pytest.mark.parametrize("T", [4, 24])
def test_gluon_kernels_skip_picks_of_weight_zero(T):
    """A weight-0 pick's expert is never read (its scales NaN here): the live picks' sum, 0 for a token with none;
    per (token, pick) and sorted by expert."""
    from tests.ops.test_moe_experts_fp8 import poison_last_expert, zero_picks

    E = 6
    args, dead = zero_picks(make(T, 1024, 1024, E, 3, dtype=torch.bfloat16, seed=11), E)
    want = experts64(*args, round_to=torch.bfloat16)
    dev = tuple(a.to(DEV) for a in poison_last_expert(args, E, 255))  # ue8m0 byte 255: NaN scales
    poison_allocator(device=DEV)
    out = moe_experts_fp4(*dev, out_float32=True, backend="gluon").cpu()
    assert not out.isnan().any() and rel(out, want) < 5e-3
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert dead.any() and not dead.all()


def test_gluon_falls_back_off_its_dims():
    """Dims the Gluon kernels do not serve (H = 1056) run the Triton kernels through the same op."""
    args = make(2, 1056, 160, 8, 3, dtype=torch.bfloat16, seed=3)
    dev = tuple(a.to(DEV) for a in args)
    out = moe_experts_fp4(*dev, out_float32=True, backend="gluon")
    assert torch.equal(out, moe_experts_fp4(*dev, out_float32=True, backend="triton"))


@pytest.mark.parametrize("T", [1, 8, 64])
def test_gluon_v4_dims_compiled_and_graph_replay(v4_args, T):
    """V4-Flash's dims against the reference op: eager, compiled (the op opaque, fullgraph) and replayed from a
    CUDA graph with new inputs copied in."""
    args = (v4_args[0][:T], v4_args[1][:T], v4_args[2][:T], *v4_args[3:])
    want = moe_experts_fp4(*args, swiglu_limit=10.0, out_float32=True, backend="reference")
    poison_allocator(device=DEV)
    assert rel(moe_experts_fp4(*args, swiglu_limit=10.0, out_float32=True, backend="gluon"), want) < 2e-3
    compiled = torch.compile(lambda *a: moe_experts_fp4(*a, swiglu_limit=10.0, backend="gluon"), fullgraph=True)
    assert rel(compiled(*args), want) < 1e-2
    x = args[0].clone()
    call = lambda: moe_experts_fp4(x, *args[1:], swiglu_limit=10.0, out_float32=True, backend="gluon")  # noqa: E731
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    x2 = torch.randn_like(x)
    x.copy_(x2)
    graph.replay()
    want2 = moe_experts_fp4(x2, *args[1:], swiglu_limit=10.0, out_float32=True, backend="reference")
    assert rel(out, want2) < 2e-3
