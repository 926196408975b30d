"""``mla::moe_gate_route``: router GEMV + DeepSeek routing against a float64 per-row model (the logits from float64
products of the same half-precision values), at V2-Lite's (64 experts, top-6, softmax) and V3's (256 experts,
sigmoid + bias, 8 groups, top-4 groups, top-8, scaling 2.5) routing; the fused Triton kernel under Triton's
interpreter (CPU) and on CUDA (eager, compiled, CUDA-graph replay); opcheck; errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from mla_compile import ops
from mla_compile.ops.moe_gate_route import MAX_ROWS
from tests.ops.test_moe_route import route64, route_choice
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

# name: (E, top_k, num_group, topk_group, scoring, bias, renormalize, scaling)
ROUTINGS = {
    "v2-lite": (64, 6, 1, 1, "softmax", False, False, 1.0),
    "v3": (256, 8, 8, 4, "sigmoid", True, True, 2.5),
    "v4": (256, 6, 1, 1, "sqrtsoftplus", True, True, 1.5),
}


def _inputs(routing, T, H, dtype=torch.bfloat16, device="cpu", seed=0):
    E, *_, bias, _, _ = ROUTINGS[routing]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(E, H, generator=gen) * (2 / H ** 0.5)).to(device=device, dtype=dtype)
    b = (torch.randn(E, generator=gen) * 0.3).to(device) if bias else None
    return x, weight, b


def _route(x, weight, b, routing, backend):
    E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS[routing]
    return ops.moe_gate_route(x, weight, k, bias=b, num_group=G, topk_group=TG, scoring=scoring,
                              renormalize=renorm, scaling=scaling, backend=backend)


def _check(weights, ids, x, weight, b, routing, tol, near=1e-5):
    """Against the float64 model. A pick may differ from it only where the float64 choice values of the two
    experts are within ``near`` (a near-tie that the float32 summation order decides)."""
    E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS[routing]
    logits = x.double().cpu() @ weight.double().cpu().T
    bias = None if b is None else b.cpu()
    want = route64(logits, bias, k, G, TG, scoring, renorm, scaling)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == (x.shape[0], k) and weights.shape == (x.shape[0], k)
    ids, weights = ids.cpu(), weights.cpu()
    for t, row in enumerate(want):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert len(got) == k and all(0 <= e < E for e in got), (t, sorted(got))
        extra, missing = set(got) - set(row), set(row) - set(got)
        choice = route_choice(logits[t], bias, scoring)
        for e_got, e_want in zip(sorted(extra), sorted(missing)):
            assert abs(choice[e_got] - choice[e_want]) <= near, (t, sorted(got), sorted(row))
        for e in set(got) & set(row):
            assert abs(got[e] - row[e]) <= tol * max(1.0, abs(row[e])), (t, e, got[e], row[e])


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_reference_matches_float64(routing, dtype):
    x, weight, b = _inputs(routing, 5, 48, dtype=dtype, seed=1)
    w, ids = _route(x, weight, b, routing, "reference")
    if dtype == torch.float64:
        assert w.dtype == torch.float64
        w = w.float()
    _check(w, ids, x, weight, b, routing, 1e-5)


# The interpreted kernel cases: every (T, H) for V2-Lite's routing; V3's within a gate tile and past it (H = 200);
# V4's scoring at one shape (interpreting 256 experts costs seconds a case; the routing after the scores is V3's).
INTERPRETED = [("v2-lite", 1, 200), ("v2-lite", 2, 1100), ("v2-lite", 2, 24), ("v3", 1, 200), ("v3", 2, 24),
               ("v4", 2, 200)]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("routing,T,H", INTERPRETED)
def test_interpreter_kernel_matches_float64(routing, T, H):
    """One and two tokens, H past one gate tile (1100 > 512 at 64 experts; 200 > 128 at 256) and off the tile;
    outputs poisoned beforehand (every element must be written); picks best first; run-to-run equal (at 64 experts:
    interpreting 256 experts is slow; the slices test checks the counter every call leaves)."""
    from mla_compile.ops.triton import moe_gate_route as tmg

    E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS[routing]
    x, weight, b = _inputs(routing, T, H, seed=T + H)
    with poisoned_empty():
        w, ids = tmg._launch(x, weight, b, k, G, TG, scoring, renorm, scaling)
    _check(w, ids, x, weight, b, routing, 2e-6)
    logits = x.double() @ weight.double().T
    for t in range(T):
        picked = [route_choice(logits[t], b, scoring)[e] for e in ids[t].tolist()]
        assert picked == sorted(picked, reverse=True)
    if routing == "v2-lite":
        w2, ids2 = tmg._launch(x, weight, b, k, G, TG, scoring, renorm, scaling)
        assert torch.equal(w, w2) and torch.equal(ids, ids2)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("routing", ["v2-lite", "v3"])  # V4's 256 experts route as V3's after the scores
def test_interpreter_kernel_slices_agree_and_leave_the_counter_at_zero(routing, monkeypatch):
    """Any number of experts a program reads (1: a program per expert; 4; 16) gives the float64 model's picks, and
    every call leaves the arrival counter at 0 (the next call's last program is found by it)."""
    from mla_compile.ops._workspace import workspace
    from mla_compile.ops.triton import moe_gate_route as tmg

    E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS[routing]
    x, weight, b = _inputs(routing, 2, 40, seed=11)
    for max_slice in (1, 4, 16):
        monkeypatch.setitem(tmg.CONFIG, "max_slice", max_slice)
        assert tmg.slice_experts(E, x.device) == max_slice
        w, ids = tmg._launch(x, weight, b, k, G, TG, scoring, renorm, scaling)
        _check(w, ids, x, weight, b, routing, 2e-6)
        assert workspace("moe_gate_route-arrivals", x.device, 4, zero=True).view(torch.int32).item() == 0


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_kernel_refuses_more_rows():
    from mla_compile.ops.triton import moe_gate_route as tmg

    x, weight, _ = _inputs("v2-lite", MAX_ROWS + 1, 16)
    with pytest.raises(ValueError, match="tokens"):
        tmg._launch(x, weight, None, 6, 1, 1, "softmax", False, 1.0)


def test_opcheck_and_fake():
    import mla_compile.ops.triton.moe_gate_route  # noqa: F401

    for routing in ROUTINGS:
        E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS[routing]
        x, weight, b = _inputs(routing, 3, 32, seed=2)
        args = (x, weight, b, k, G, TG, scoring, renorm, scaling)
        torch.library.opcheck(torch.ops.mla.moe_gate_route_ref.default, args)
        torch.library.opcheck(torch.ops.mla.moe_gate_route_triton.default, args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        w, ids = torch.ops.mla.moe_gate_route_ref(mode.from_tensor(x), mode.from_tensor(weight), mode.from_tensor(b),
                                                  k, G, TG, scoring, renorm, scaling)
    assert w.shape == (3, k) and w.dtype == torch.float32 and ids.shape == (3, k) and ids.dtype == torch.int32


def test_compiled_call_matches_eager():
    x, weight, b = _inputs("v3", 4, 32, seed=3)
    fn = torch.compile(lambda a: _route(a, weight, b, "v3", None), fullgraph=True)
    w, ids = fn(x)
    _check(w, ids, x, weight, b, "v3", 1e-5)


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(16)), "x"),
    (dict(weight=torch.zeros(64, 15, dtype=torch.bfloat16)), "weight"),
    (dict(weight=torch.zeros(64, 16)), "weight"),
    (dict(bias=torch.zeros(63)), "bias"),
    (dict(num_group=3), "num_group"),
    (dict(top_k=65), "top_k"),
    (dict(scoring="relu"), "scoring"),
])
def test_errors_name_the_argument(change, match):
    args = dict(x=torch.zeros(2, 16, dtype=torch.bfloat16), weight=torch.zeros(64, 16, dtype=torch.bfloat16),
                top_k=6, bias=None, num_group=1, topk_group=1, scoring="softmax")
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.moe_gate_route(args.pop("x"), args.pop("weight"), args.pop("top_k"), backend="reference", **args)


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_moe_layer_wiring_passes_the_gates_routing(kind, monkeypatch):
    """``MLAMoE``'s fused path through ``mla::moe_gate_route`` (forced on CPU, its reference backend) gives the
    routing and output of the router + ``mla::moe_route`` path: the gate's bias, groups, scoring and scaling reach
    the op in the right places."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models import moe as moe_mod

    hf = toy.toy_hf_model(kind, seed=8)
    block = hf.model.layers[1].mlp
    if kind == "v3":
        with torch.no_grad():
            block.gate.e_score_correction_bias.copy_(torch.randn(block.gate.e_score_correction_bias.shape) * 0.3)
    layer = moe_mod.MLAMoE(block, impl="fused")
    x = torch.randn(2, hf.config.hidden_size)
    with torch.no_grad():
        want = layer(x)
        calls = []
        real = moe_mod.moe_gate_route

        def spy(*args, **kwargs):
            calls.append(kwargs)
            return real(*args, **{**kwargs, "backend": "reference"})

        monkeypatch.setattr(moe_mod, "moe_gate_route", spy)
        monkeypatch.setattr(moe_mod.MLAMoE, "_gate_route", lambda self, x: True)
        got = layer(x)
    assert len(calls) == 1 and calls[0]["scoring"] == ("sigmoid" if kind == "v3" else "softmax")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# --- CUDA (the lead's H200 run) ---

# (routing, H): V2-Lite's gate 64 x 2048, V3's routing at hidden 2048, V3's gate 256 x 7168 (the fused kernel to
# MAX_ROWS tokens, torch.mm + the route kernel inside the op above)
CUDA_CASES = [("v2-lite", 2048), ("v3", 2048), ("v3", 7168), ("v4", 4096)]


def cuda_grid(test):
    """The CUDA marks and the grid of the router tests' GPU runs: ``routing, H`` of :data:`CUDA_CASES`, one, two
    (the fused kernel) and five tokens, bf16 and fp16 (also ``mla::moe_norm_gate_route``'s)."""
    for mark in (pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16]),
                 pytest.mark.parametrize("T", [1, 2, 5]), pytest.mark.parametrize("routing,H", CUDA_CASES),
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.cuda):
        test = mark(test)
    return test


@cuda_grid
def test_cuda_triton_matches_float64(routing, H, T, dtype):
    x, weight, b = _inputs(routing, T, H, dtype=dtype, device="cuda", seed=T + H)
    w, ids = _route(x, weight, b, routing, "triton")
    _check(w, ids, x, weight, b, routing, 1e-4)
    ref_w, ref_ids = _route(x, weight, b, routing, "reference")
    _check(ref_w, ref_ids, x, weight, b, routing, 1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("routing,H", CUDA_CASES[:2])
def test_cuda_compiled_and_graph_replay(routing, H, fresh_dynamo):
    """torch.compile with dynamic tokens (one graph for 2 and 6 tokens), then a CUDA graph of the compiled call at
    2 tokens replayed on new inputs."""
    x, weight, b = _inputs(routing, 6, H, device="cuda", seed=7)
    fn = torch.compile(lambda a: _route(a, weight, b, routing, "triton"), fullgraph=True, dynamic=True)
    for t in (2, 6):
        _check(*fn(x[:t]), x[:t], weight, b, routing, 1e-4)
    static = x[:2].clone()
    fn(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = fn(static)
    static.copy_(x[3:5])
    graph.replay()
    torch.cuda.synchronize()
    _check(w, ids, x[3:5], weight, b, routing, 1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_cuda_fused_moe_layer_routes_through_the_op(kind, monkeypatch, fresh_dynamo):
    """``MLAMoE(impl="fused")`` on CUDA bf16 takes ``mla::moe_gate_route`` ("auto" picks its Triton kernel) and
    matches the dense experts, eagerly and compiled."""
    pytest.importorskip("transformers")
    import mla_compile.models.moe as moe_mod
    from mla_compile.app import toy
    from mla_compile.models.moe import MLAMoE

    hf = toy.toy_hf_model(kind, seed=5, dtype=torch.bfloat16, device="cuda")
    block = hf.model.layers[1].mlp
    fused, dense = MLAMoE(block, impl="fused"), MLAMoE(block, impl="dense")
    x = torch.randn(2, hf.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert fused._gate_route(x)
    calls, real = [], moe_mod.moe_gate_route
    monkeypatch.setattr(moe_mod, "moe_gate_route", lambda *a, **kw: calls.append(kw["backend"]) or real(*a, **kw))
    with torch.no_grad():
        want = dense(x)
        for fn in (fused, torch.compile(fused, fullgraph=True, dynamic=True)):
            torch.testing.assert_close(fn(x).float(), want.float(), atol=2e-2, rtol=2e-2)
    assert calls and set(calls) == {"triton"}
