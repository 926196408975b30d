"""``mla::moe_route`` and ``mla::moe_experts`` on a GPU at DeepSeek-V2-Lite and V3 dims (bf16): the Triton kernels
against float64 math (routing row by row; the experts per (token, pick) in float64 for few tokens, against the
float32 reference op for more), NaN-poisoned outputs, run-to-run equality, the "auto" split and the grouped
backend, and the fused MoE block compiled (fullgraph) against the dense path. The CPU twins run the kernels
under Triton's interpreter (tests/ops/test_moe_route.py, tests/ops/test_moe_experts.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from mla_compile import ops
from tests.ops.test_moe_route import _check, route64
from tests.ops.triton._triton_test_util import poison_allocator

DEV = "cuda"  # a CPU dry run of the test code sets "cpu"
SLACK = 1.0  # and this to 2: the interpreter's float32 -> bf16 cast truncates (the GPU's rounds to nearest)
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

# name: (hidden, moe_intermediate, experts, top_k, shared experts)
DIMS = {"v2-lite": (2048, 1408, 64, 6, 2), "v3": (7168, 2048, 256, 8, 1)}
# name: (E, top_k, num_group, topk_group, scoring, bias, renormalize, scaling)
ROUTES = {"v2-lite": (64, 6, 1, 1, "softmax", False, False, 1.0),
          "v2": (160, 6, 8, 3, "softmax", False, False, 16.0),
          "v3": (256, 8, 8, 4, "sigmoid", True, True, 2.5)}


@pytest.mark.parametrize("T", [1, 8, 256])
@pytest.mark.parametrize("name", list(ROUTES))
def test_route_kernel_matches_float64_math(name, T):
    E, k, G, TG, scoring, bias, renorm, scaling = ROUTES[name]
    gen = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=gen) * 2
    b = torch.randn(E, generator=gen) * 0.3 if bias else None
    poison_allocator(device=DEV)
    w, ids = ops.moe_route(logits.to(DEV), k, bias=None if b is None else b.to(DEV), num_group=G, topk_group=TG,
                           scoring=scoring, renormalize=renorm, scaling=scaling, backend="triton")
    _check(w.cpu(), ids.cpu(), route64(logits, b, k, G, TG, scoring, renorm, scaling), 2e-6)


def _weights(name, seed=0):
    """bf16 ``(gate_up, down, shared_gate, shared_up, shared_down)`` on the GPU at ``name``'s dims."""
    H, I, E, _, S = DIMS[name]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    gate_up = torch.empty(E, 2 * I, H, device=DEV, dtype=torch.bfloat16)
    down = torch.empty(E, H, I, device=DEV, dtype=torch.bfloat16)
    for e in range(0, E, 16):  # chunks bound the float32 temporaries
        gate_up[e:e + 16] = torch.randn(gate_up[e:e + 16].shape, device=DEV, generator=gen) * H ** -0.5
        down[e:e + 16] = torch.randn(down[e:e + 16].shape, device=DEV, generator=gen) * I ** -0.5
    shared = [(torch.randn(*shape, device=DEV, generator=gen) * scale).bfloat16()
              for shape, scale in (((S * I, H), H ** -0.5), ((S * I, H), H ** -0.5), ((H, S * I), I ** -0.5))]
    return gate_up, down, *shared


@pytest.fixture(scope="module", params=list(DIMS))
def model_weights(request):
    weights = _weights(request.param)
    yield request.param, weights
    del weights
    torch.cuda.empty_cache()


def _routing(T, E, k, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=gen)[:k] for _ in range(T)]).int()
    return torch.rand(T, k, device=DEV, generator=gen) + 0.1, ids


def _experts64(x, weights, ids, gate_up, down, sg, su, sd):
    """The contract in float64 on the GPU, one (token, pick) at a time (activation rounded to bf16)."""
    I = gate_up.shape[1] // 2

    def mlp(g_w, u_w, d_w, v):
        a = (F.silu(g_w.double() @ v) * (u_w.double() @ v)).bfloat16().double()
        return d_w.double() @ a

    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        v = x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += float(weights[t, j]) * mlp(gate_up[e, :I], gate_up[e, I:], down[e], v)
        out[t] += mlp(sg, su, sd, v)
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# kernel 1's forms (``ops/triton/moe_experts.CONFIG``): the tensor-core form and the pipelined GEMV form
GATE_UP_FORMS = {"dot": dict(gate_up_pipe=False, gate_up_dot=True), "pipe": dict(gate_up_pipe=True)}


@pytest.mark.parametrize("form", list(GATE_UP_FORMS))
@pytest.mark.parametrize("T", [1, 4])
def test_fused_experts_match_float64_at_model_dims(model_weights, T, form, monkeypatch):
    from mla_compile.ops.triton import moe_experts as kernels

    for key, value in GATE_UP_FORMS[form].items():
        monkeypatch.setitem(kernels.CONFIG, key, value)
    name, (gate_up, down, sg, su, sd) = model_weights
    H, I, E, k, _ = DIMS[name]
    weights, ids = _routing(T, E, k, seed=T)
    x = torch.randn(T, H, device=DEV).bfloat16()
    want = _experts64(x, weights, ids, gate_up, down, sg, su, sd)
    poison_allocator(device=DEV)
    out = ops.moe_experts(x, weights, ids, gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd,
                          out_float32=True, backend="triton")
    assert not out.isnan().any() and _rel(out, want) < 4e-3 * SLACK, _rel(out, want)
    again = ops.moe_experts(x, weights, ids, gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd,
                            out_float32=True, backend="triton")
    assert torch.equal(out, again), "run-to-run results must be bitwise equal"
    low = ops.moe_experts(x, weights, ids, gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd,
                          backend="triton")
    assert low.dtype == torch.bfloat16 and _rel(low, want) < 8e-3 * SLACK


def test_pdl_chain_of_layers_reads_each_previous_output(model_weights):
    """On sm_90 the fused kernels run eagerly with programmatic dependent launch (``ops/triton/_pdl.py``): kernel 1
    requests the shared rows into L2 before its wait, kernel 2 reads the picks and requests its experts' rows before
    its wait. Four layers in a chain, each routed by torch kernels (a router GEMM, softmax, top-k) from the layer
    before's output, two tokens of which the second is padding (masked), eagerly and replayed from a CUDA graph on
    new inputs: every layer's output equals the float64 contract of its own input and picks, the masked token's is
    exactly 0, and graph replay equals eager bit for bit. A read before a missing wait would see half-written
    picks, x or activations."""
    from mla_compile.ops.triton import _pdl

    name, (gate_up, down, sg, su, sd) = model_weights
    H, I, E, k, _ = DIMS[name]
    if torch.cuda.get_device_capability()[0] >= 9:
        assert _pdl.launch_kwargs(torch.device(DEV), eager_only=True)["PDL"] is False  # not inside a triton_op
        assert _pdl.enabled(torch.device(DEV))
    gen = torch.Generator(device=DEV).manual_seed(5)
    routers = [torch.randn(E, H, device=DEV, generator=gen).bfloat16() for _ in range(4)]
    mask = torch.tensor([True, False], device=DEV)

    def chain(x):
        steps = []
        for router in routers:
            probs = (x @ router.t()).float().softmax(-1)
            weights, ids = probs.topk(k, dim=-1)
            out = ops.moe_experts(x, weights, ids.int(), gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd,
                                  out_float32=True, backend="triton", token_mask=mask)
            steps.append((x, weights, ids, out))
            x = (x.float() + out).bfloat16()
        return steps

    def check(steps):
        for x, weights, ids, out in steps:
            want = _experts64(x[:1], weights[:1], ids[:1], gate_up, down, sg, su, sd)
            assert _rel(out[:1], want) < 4e-3 * SLACK, _rel(out[:1], want)
            assert torch.equal(out[1], torch.zeros_like(out[1]))

    x = torch.randn(2, H, device=DEV, generator=gen).bfloat16()
    eager = chain(x)
    check(eager)
    static = x.clone()
    chain(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(static)
    for seed in (1, 2):
        new = torch.randn(2, H, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)).bfloat16()
        static.copy_(new)
        for *_, out in captured:
            out.fill_(float("nan"))
        graph.replay()
        check(captured)
        replayed = [t.clone() for step in captured for t in step]
        assert all(torch.equal(a, b) for a, b in zip(replayed, [t for step in chain(new) for t in step]))


@pytest.mark.parametrize("T", [16, 64])
def test_every_backend_matches_the_reference_at_model_dims(model_weights, T):
    name, (gate_up, down, sg, su, sd) = model_weights
    H, I, E, k, _ = DIMS[name]
    weights, ids = _routing(T, E, k, seed=T)
    x = torch.randn(T, H, device=DEV).bfloat16()
    shared = dict(shared_gate=sg, shared_up=su, shared_down=sd)
    want = _reference32(x, weights, ids, gate_up, down, sg, su, sd)
    for backend in ("triton", "grouped", "auto"):
        poison_allocator(device=DEV)
        out = ops.moe_experts(x, weights, ids, gate_up, down, **shared, out_float32=True, backend=backend)
        assert not out.isnan().any() and _rel(out, want) < 8e-3 * SLACK, (backend, _rel(out, want))


def _reference32(x, weights, ids, gate_up, down, sg, su, sd):
    """The reference op (float32 math, bf16 weights read one expert at a time)."""
    return torch.ops.mla.moe_experts_ref(x, weights, ids, gate_up, down, sg, su, sd, True)


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_compiled_fused_block_equals_dense_on_gpu(kind, fresh_dynamo):
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.moe import MLAMoE

    hf = toy.toy_hf_model(kind, seed=6, dtype=torch.bfloat16).to(DEV)
    block = hf.model.layers[1].mlp
    for impl in ("fused", "auto"):  # "auto": the fused kernels up to FUSED_MAX_TOKENS at hidden <= FUSED_MAX_HIDDEN
        compiled = torch.compile(MLAMoE(block, impl=impl), fullgraph=True)
        for T in (1, 3, 40):
            x = torch.randn(T, hf.config.hidden_size, device=DEV).bfloat16()
            with torch.no_grad():
                want = MLAMoE(block, impl="dense")(x)
                got = compiled(x)
                again = compiled(x)
            assert torch.equal(got, again), impl
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("T", [2, 5])
def test_masked_tokens_read_no_experts_at_model_dims(model_weights, T, fresh_dynamo):
    """``token_mask``: the B=1 decode step padded to 2 tokens (and 5 with 2 masked). The masked tokens pick only
    an expert whose weights are NaN (no real token picks it) and have NaN x: "triton" and "auto" (eager and
    compiled) give exact 0 there; elsewhere "triton" gives its unmasked call's rows bit for bit and "auto" its own
    unmasked call's rows to the rounding of the bf16 intermediate ("auto" takes the Triton grouped kernels from 3
    tokens and at V3's hidden size, where the masked pairs change the sorted blocks and so the order of the float32
    sums behind each bf16 ``act(g) * u``: H200 runs 158 and 166 saw differences of ~1e-4 and 1.3e-3); "grouped"
    (which may read) zeroes the rows of an unpoisoned call."""
    name, (gate_up, down, sg, su, sd) = model_weights
    H, I, E, k, _ = DIMS[name]
    weights, ids = _routing(T, E - 1, k, seed=T)  # real tokens never pick expert E - 1
    mask = torch.arange(T, device=DEV) % 2 == 0
    x = torch.randn(T, H, device=DEV).bfloat16()
    shared = dict(shared_gate=sg, shared_up=su, shared_down=sd)
    want = {backend: ops.moe_experts(x, weights, ids, gate_up, down, **shared, out_float32=True, backend=backend)
            for backend in ("triton", "auto")}
    x_p, ids_p = x.clone(), ids.clone()
    x_p[~mask], ids_p[~mask] = float("nan"), E - 1
    saved = gate_up[E - 1].clone(), down[E - 1].clone()
    compiled = torch.compile(lambda *a, **kw: ops.moe_experts(*a, **kw), fullgraph=True)
    try:
        gate_up[E - 1].fill_(float("nan"))
        down[E - 1].fill_(float("nan"))
        for backend, fn in (("triton", ops.moe_experts), ("auto", ops.moe_experts), ("triton", compiled)):
            poison_allocator(device=DEV)
            out = fn(x_p, weights, ids_p, gate_up, down, **shared, out_float32=True, backend=backend, token_mask=mask)
            assert torch.equal(out[~mask], torch.zeros_like(out[~mask])), backend
            if backend == "triton":
                assert torch.equal(out[mask], want[backend][mask]), backend
            else:
                torch.testing.assert_close(out[mask], want[backend][mask], atol=5e-3, rtol=5e-3)
    finally:
        gate_up[E - 1].copy_(saved[0])
        down[E - 1].copy_(saved[1])
    unmasked = ops.moe_experts(x, weights, ids, gate_up, down, **shared, out_float32=True, backend="grouped")
    got = ops.moe_experts(x, weights, ids, gate_up, down, **shared, out_float32=True, backend="grouped",
                          token_mask=mask)
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    torch.testing.assert_close(got[mask], unmasked[mask], atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_compiled_fused_block_with_a_token_mask_on_gpu(kind, fresh_dynamo):
    """``MLAMoE(token_mask=...)`` compiled (fullgraph): the real rows of a padded batch as without the mask."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.moe import MLAMoE

    hf = toy.toy_hf_model(kind, seed=6, dtype=torch.bfloat16).to(DEV)
    compiled = torch.compile(MLAMoE(hf.model.layers[1].mlp, impl="auto"), fullgraph=True)
    for T in (2, 5, 40):
        x = torch.randn(T, hf.config.hidden_size, device=DEV).bfloat16()
        mask = torch.arange(T, device=DEV) < (T + 1) // 2
        with torch.no_grad():
            want, got = compiled(x), compiled(x, token_mask=mask)
        if T <= 8:  # the fused kernels: the same programs for the real tokens
            assert torch.equal(got[mask], want[mask]), T
        else:  # the grouped GEMMs of another graph: bf16 roundings may differ
            torch.testing.assert_close(got[mask].float(), want[mask].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(got[~mask], torch.zeros_like(got[~mask])), T
