"""``mla::moe_norm_gate_route``: the residual add, HF's RMSNorm and ``mla::moe_gate_route``'s router + routing, against
float64 models of the same half-precision values: the reference (routing of its own rounded normed rows), the Triton
kernel under Triton's interpreter (CPU) and on CUDA (routing of the unrounded normed rows, as its contract allows);
opcheck; errors naming the argument; the MoE layer's and the regional model's wiring."""

from __future__ import annotations

import copy

import pytest
import torch

from mla_compile import ops
from mla_compile.ops.moe_gate_route import MAX_ROWS
from tests.ops.test_moe_gate_route import CUDA_CASES, ROUTINGS, _check, cuda_grid
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

EPS = 1e-6


def _inputs(routing, T, H, dtype=torch.bfloat16, device="cpu", seed=0):
    E, *_, bias, _, _ = ROUTINGS[routing]
    gen = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(T, H, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    nw = (torch.rand(H, generator=gen) + 0.5).to(device=device, dtype=dtype)
    weight = (torch.randn(E, H, generator=gen) * (2 / H ** 0.5)).to(device=device, dtype=dtype)
    b = (torch.randn(E, generator=gen) * 0.3).to(device) if bias else None
    return x, r, nw, weight, b


def _call(x, r, nw, weight, b, routing, backend):
    E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS[routing]
    return ops.moe_norm_gate_route(x, r, nw, EPS, weight, k, bias=b, num_group=G, topk_group=TG, scoring=scoring,
                                   renormalize=renorm, scaling=scaling, backend=backend)


def _normed64(h, nw):
    """float64 RMSNorm of the given rows, no rounding anywhere."""
    h = h.double().cpu()
    return nw.double().cpu() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)


def _check_all(got, x, r, nw, weight, b, routing, h_ulps, n_ulps, tol, near):
    """``h`` within ``h_ulps`` bf16 ulps (2^-7 of its size) of float64 ``x + r``, ``normed`` within ``n_ulps`` ulps
    of the row's largest value of float64 math on the returned ``h`` (two roundings to nearest: 1; the interpreter
    truncates: 2), the routing against float64 logits of that unrounded normed row."""
    h, normed, w, ids = got
    assert h.dtype == normed.dtype == x.dtype and h.shape == normed.shape == x.shape
    want_h = x.double().cpu() + r.double().cpu()
    assert ((h.double().cpu() - want_h).abs() <= h_ulps * want_h.abs() * 2.0 ** -7 + 1e-30).all()
    want_n = _normed64(h, nw)
    scale = want_n.abs().amax(-1, keepdim=True)
    assert ((normed.double().cpu() - want_n).abs() <= n_ulps * scale * 2.0 ** -7 + 1e-30).all()
    _check(w, ids, want_n, weight, b, routing, tol, near)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_reference_matches_float64(routing, dtype):
    """The add exact in its dtype, HF's norm rounding (one rounding of the scaled row, one of the product), the
    routing of its own rounded normed rows."""
    x, r, nw, weight, b = _inputs(routing, 5, 48, dtype=dtype, seed=1)
    h, normed, w, ids = _call(x, r, nw, weight, b, routing, "reference")
    assert torch.equal(h, x + r)
    if dtype == torch.float64:
        assert w.dtype == torch.float64
        w = w.float()
    _check_all((h, normed, w, ids), x, r, nw, weight, b, routing, 1, 1, 2e-3, 2e-2)  # logits of the rounded rows
    _check(w, ids, normed, weight, b, routing, 1e-5)  # exactly the routing of the rows it returns


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("routing,T,H", [("v2-lite", 1, 200), ("v2-lite", 2, 1100), ("v2-lite", 2, 24),
                                         ("v3", 1, 200)])  # V4's scoring: test_moe_gate_route's
def test_interpreter_kernel_matches_float64(routing, T, H):
    """One and two tokens; H past one gate tile and off it, and fewer columns than programs (24 < 64 experts: some
    programs store no column); every output poisoned beforehand (each element must be written); run-to-run equal
    (checked at 64 experts and H = 24 only: interpreting 256 experts is slow; V3's routing one case)."""
    from mla_compile.ops.triton import moe_gate_route as tmg

    E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS[routing]
    x, r, nw, weight, b = _inputs(routing, T, H, seed=T + H)
    with poisoned_empty(like=True):
        got = tmg._launch_norm(x, r, nw, EPS, weight, b, k, G, TG, scoring, renorm, scaling)
    # the interpreter truncates float32 -> bf16 casts: h within 1 ulp, normed (two casts) within 2
    _check_all(got, x, r, nw, weight, b, routing, 1, 2, 2e-6, 1e-5)
    if H == 24 and routing == "v2-lite":
        again = tmg._launch_norm(x, r, nw, EPS, weight, b, k, G, TG, scoring, renorm, scaling)
        assert all(torch.equal(a, c) for a, c in zip(got, again))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("max_slice", [4, 16])
def test_interpreter_kernel_slices_cover_every_column(max_slice, monkeypatch):
    """Fewer programs (4 or 16 experts a program: 64 / 16 programs at 256 experts), so each stores a wider slice of
    h and normed (H = 300: a last slice cut short); the routing as with one expert a program."""
    from mla_compile.ops.triton import moe_gate_route as tmg

    E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS["v3"]
    x, r, nw, weight, b = _inputs("v3", 2, 300, seed=5)
    monkeypatch.setitem(tmg.CONFIG, "max_slice", max_slice)
    with poisoned_empty(like=True):
        got = tmg._launch_norm(x, r, nw, EPS, weight, b, k, G, TG, scoring, renorm, scaling)
    _check_all(got, x, r, nw, weight, b, "v3", 1, 2, 2e-6, 1e-5)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_kernel_refuses_more_rows():
    from mla_compile.ops.triton import moe_gate_route as tmg

    x, r, nw, weight, _ = _inputs("v2-lite", MAX_ROWS + 1, 16)
    with pytest.raises(ValueError, match="tokens"):
        tmg._launch_norm(x, r, nw, EPS, weight, None, 6, 1, 1, "softmax", False, 1.0)


def test_opcheck_and_fake():
    import mla_compile.ops.triton.moe_gate_route  # noqa: F401

    for routing in ROUTINGS:
        E, k, G, TG, scoring, _, renorm, scaling = ROUTINGS[routing]
        x, r, nw, weight, b = _inputs(routing, 3, 32, seed=2)
        args = (x, r, nw, EPS, weight, b, k, G, TG, scoring, renorm, scaling)
        torch.library.opcheck(torch.ops.mla.moe_norm_gate_route_ref.default, args)
        torch.library.opcheck(torch.ops.mla.moe_norm_gate_route_triton.default, args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        h, n, w, ids = torch.ops.mla.moe_norm_gate_route_ref(*(mode.from_tensor(a) for a in (x, r, nw)), EPS,
                                                             mode.from_tensor(weight), mode.from_tensor(b), k, G, TG,
                                                             scoring, renorm, scaling)
    assert h.shape == n.shape == (3, 32) and n.dtype == torch.bfloat16
    assert w.shape == (3, k) and w.dtype == torch.float32 and ids.shape == (3, k) and ids.dtype == torch.int32


def test_compiled_call_matches_eager():
    x, r, nw, weight, b = _inputs("v3", 4, 32, seed=3)
    fn = torch.compile(lambda a, c: _call(a, c, nw, weight, b, "v3", None), fullgraph=True)
    got, want = fn(x, r), _call(x, r, nw, weight, b, "v3", "reference")
    assert all(torch.equal(a, c) for a, c in zip(got, want))


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(16)), "x"),
    (dict(residual=torch.zeros(2, 8, dtype=torch.bfloat16)), "residual"),
    (dict(residual=torch.zeros(2, 16)), "residual"),
    (dict(norm_weight=torch.zeros(15, dtype=torch.bfloat16)), "norm_weight"),
    (dict(eps=0.0), "eps"),
    (dict(weight=torch.zeros(64, 15, dtype=torch.bfloat16)), "weight"),
    (dict(top_k=65), "top_k"),
    (dict(scoring="relu"), "scoring"),
])
def test_errors_name_the_argument(change, match):
    args = dict(x=torch.zeros(2, 16, dtype=torch.bfloat16), residual=torch.zeros(2, 16, dtype=torch.bfloat16),
                norm_weight=torch.ones(16, dtype=torch.bfloat16), eps=EPS,
                weight=torch.zeros(64, 16, dtype=torch.bfloat16), top_k=6, scoring="softmax")
    args.update(change)
    pos = [args.pop(n) for n in ("x", "residual", "norm_weight", "eps", "weight", "top_k")]
    with pytest.raises((ValueError, TypeError), match=match):
        ops.moe_norm_gate_route(*pos, backend="reference", **args)


def test_auto_takes_the_kernel_on_a_gpu():
    """GPU-tested (BENCHMARKS.md run 216): "auto" takes the kernel for CUDA half tensors, the reference elsewhere."""
    from mla_compile.ops.select import Facts, select

    assert select("moe_norm_gate_route", Facts(torch.device("cuda"), torch.bfloat16, cap=(9, 0))).name == "triton"
    assert ops.resolve("moe_norm_gate_route", torch.device("cpu"), None, dtype=torch.bfloat16).name == "reference"


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_moe_forward_residual_wiring(kind, monkeypatch):
    """``MLAMoE.forward_residual`` through ``mla::moe_norm_gate_route`` (forced on CPU, its reference backend) gives
    the sum and the output of the add, the norm and the MoE: the norm's weight and epsilon, the gate's routing
    arguments reach the op; without ``norm_eps`` (or the op's backend not "triton") it never folds."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models import moe as moe_mod

    hf = toy.toy_hf_model(kind, seed=8)
    dec = hf.model.layers[1]
    norm, block = dec.post_attention_layernorm, dec.mlp
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape) + 0.5)
        if kind == "v3":
            block.gate.e_score_correction_bias.copy_(torch.randn(block.gate.e_score_correction_bias.shape) * 0.3)
    layer = moe_mod.MLAMoE(block, impl="fused", norm_eps=norm.variance_epsilon)
    h, res = torch.randn(2, hf.config.hidden_size), torch.randn(2, hf.config.hidden_size)
    assert not layer.norm_route_serves(h, norm)  # CPU
    with torch.no_grad():
        want = (h + res, layer(norm(h + res)))
        unfolded = layer.forward_residual(h, res, norm)
        calls, real = [], moe_mod.moe_norm_gate_route

        def spy(*args, **kwargs):
            calls.append((args[3], kwargs))
            return real(*args, **{**kwargs, "backend": "reference"})

        monkeypatch.setattr(moe_mod, "moe_norm_gate_route", spy)
        monkeypatch.setattr(moe_mod.MLAMoE, "norm_route_serves", lambda self, h, norm: True)
        got = layer.forward_residual(h, res, norm)
    assert len(calls) == 1 and calls[0][0] == norm.variance_epsilon
    assert calls[0][1]["scoring"] == ("sigmoid" if kind == "v3" else "softmax")
    for a, b in ((unfolded, want), (got, want)):
        torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
        torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-5)


def test_patch_hands_the_norm_eps_and_the_backend_to_the_moe():
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.model import patch
    from mla_compile.models.moe import MLAMoE

    hf = toy.toy_hf_model("v2-lite", seed=1, num_hidden_layers=2, first_k_dense_replace=1)
    model = patch(copy.deepcopy(hf), moe_impl="fused", backend="moe_norm_gate_route=triton")
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MLAMoE) and moe._norm_route == "triton"
    assert float(moe._norm_eps) == hf.model.layers[1].post_attention_layernorm.variance_epsilon
    assert patch(hf, moe_impl="fused").model.layers[1].mlp._norm_route == "auto"


# --- CUDA (the lead's H200 run; mla::moe_gate_route's grid) ---


@cuda_grid
def test_cuda_triton_matches_float64(routing, H, T, dtype):
    """The fused kernel (1, 2 tokens) and, for 5, the add + norm launch and ``mla::moe_gate_route``'s path; h exact
    (as torch's add), normed within one rounding of float64 math, the routing against float64 logits."""
    x, r, nw, weight, b = _inputs(routing, T, H, dtype=dtype, device="cuda", seed=T + H)
    torch.full((1 << 28,), float("nan"), device="cuda")  # freed: the op's outputs are carved from NaN
    got = _call(x, r, nw, weight, b, routing, "triton")
    assert torch.equal(got[0], x + r)
    near = 1e-5 if T <= MAX_ROWS else 2e-2  # more tokens: logits of the rounded normed rows
    _check_all(got, x, r, nw, weight, b, routing, 1, 1, 1e-4 if T <= MAX_ROWS else 2e-2, near)
    ref = _call(x, r, nw, weight, b, routing, "reference")  # two roundings of values whose sums differ in order
    assert ((got[1].double() - ref[1].double()).abs() <= ref[1].double().abs() * 2.0 ** -6 + 1e-30).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("routing,H", CUDA_CASES[:2])
def test_cuda_compiled_and_graph_replay(routing, H, fresh_dynamo):
    """torch.compile with dynamic tokens (one graph for 2 and 6 tokens), then a CUDA graph of the compiled call at
    2 tokens replayed on new inputs."""
    x, r, nw, weight, b = _inputs(routing, 6, H, device="cuda", seed=7)
    fn = torch.compile(lambda a, c: _call(a, c, nw, weight, b, routing, "triton"), fullgraph=True, dynamic=True)
    for t in (2, 6):
        _check_all(fn(x[:t], r[:t]), x[:t], r[:t], nw, weight, b, routing, 1, 1, 2e-2, 2e-2)
    sx, sr = x[:2].clone(), r[:2].clone()
    fn(sx, sr)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(sx, sr)
    sx.copy_(x[3:5])
    sr.copy_(r[3:5])
    graph.replay()
    torch.cuda.synchronize()
    _check_all(out, x[3:5], r[3:5], nw, weight, b, routing, 1, 1, 1e-4, 1e-5)
