"""``mla::moe_route`` against a float64 per-row model of DeepSeek routing (V3 sigmoid + bias + groups, V2 softmax
greedy and group-limited), ``models.moe.route`` on HF gates, opcheck, the fake, errors naming the argument, and a
compiled call. The Triton kernel under the interpreter: tests/ops/triton/test_triton_interpret_moe.py."""

from __future__ import annotations

import math

import pytest
import torch

from mla_compile import ops

# (E, top_k, num_group, topk_group, scoring, bias, renormalize, scaling)
CASES = [
    (16, 4, 4, 2, "sigmoid", True, True, 2.5),     # V3-like
    (24, 3, 4, 1, "sigmoid", True, False, 1.0),    # one group kept, no renormalization
    (20, 5, 1, 1, "sigmoid", False, True, 1.5),    # no groups, no bias
    (8, 3, 1, 1, "softmax", False, False, 1.0),    # V2-Lite: greedy
    (40, 6, 8, 3, "softmax", False, False, 16.0),  # V2: group_limited_greedy, 5 experts a group
    (32, 6, 1, 1, "sqrtsoftplus", True, True, 1.5),  # V4: sqrt(softplus) + bias, no groups
    (24, 4, 4, 2, "sqrtsoftplus", False, False, 1.0),  # sqrt(softplus) with groups (two best a group)
]


def route64(logits, bias, top_k, num_group, topk_group, scoring, renormalize, scaling):
    """The contract, row by row in float64 Python: ``{expert id: weight}`` per token."""
    rows = []
    for z in logits.double().tolist():
        E = len(z)
        if scoring == "sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in z]
        elif scoring == "sqrtsoftplus":
            s = [math.sqrt(v if v > 20 else math.log1p(math.exp(v))) for v in z]
        else:
            m = max(z)
            p = [math.exp(v - m) for v in z]
            s = [v / sum(p) for v in p]
        c = [v + (float(bias[e]) if bias is not None else 0.0) for e, v in enumerate(s)]
        size = E // num_group
        groups = [sorted(c[g * size:(g + 1) * size], reverse=True) for g in range(num_group)]
        g_score = [sum(v[:2]) if scoring != "softmax" else v[0] for v in groups]
        kept = sorted(range(num_group), key=lambda g: -g_score[g])[:topk_group] if num_group > 1 else [0]
        cand = [e for e in range(E) if e // size in kept]
        picks = sorted(cand, key=lambda e: -c[e])[:top_k]
        w = {e: s[e] for e in picks}
        if renormalize:
            total = sum(w.values()) + 1e-20
            w = {e: v / total for e, v in w.items()}
        rows.append({e: v * scaling for e, v in w.items()})
    return rows


def _inputs(E, bias, T=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen) * 2
    b = torch.randn(E, generator=gen) * 0.3 if bias else None
    return logits, b


def _check(weights, ids, want, tol):
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    for t, row in enumerate(want):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(row), (t, sorted(got), sorted(row))
        for e, v in row.items():
            assert abs(got[e] - v) <= tol * max(1.0, abs(v)), (t, e, got[e], v)


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_float64_math(case):
    E, k, G, TG, scoring, bias, renorm, scaling = case
    logits, b = _inputs(E, bias)
    want = route64(logits, b, k, G, TG, scoring, renorm, scaling)
    w, ids = ops.moe_route(logits, k, bias=b, num_group=G, topk_group=TG, scoring=scoring, renormalize=renorm,
                           scaling=scaling, backend="reference")
    _check(w, ids, want, 1e-6)
    w64, ids64 = ops.moe_route(logits.double(), k, bias=b, num_group=G, topk_group=TG, scoring=scoring,
                               renormalize=renorm, scaling=scaling, backend="reference")
    assert w64.dtype == torch.float64
    for t, row in enumerate(want):
        got = dict(zip(ids64[t].tolist(), w64[t].tolist()))
        assert set(got) == set(row) and all(abs(got[e] - v) < 1e-12 for e, v in row.items())


def route_choice(z, bias, scoring):
    z = z.double()
    s = {"sigmoid": z.sigmoid, "sqrtsoftplus": lambda: torch.nn.functional.softplus(z).sqrt()}.get(
        scoring, lambda: z.softmax(-1))()
    return (s + (bias.double() if bias is not None else 0)).tolist()


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_models_route_on_hf_gates_matches_float64_math(kind):
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.moe import route, route_args

    gate = toy.toy_hf_model(kind, seed=4).model.layers[1].mlp.gate
    if kind == "v3":
        with torch.no_grad():
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.3)
    x = torch.randn(9, gate.weight.shape[1])
    bias, k, G, TG, scoring, renorm, scaling = route_args(gate)
    want = route64(x.double() @ gate.weight.double().T, bias, k, G, TG, scoring, renorm, scaling)
    w, ids = route(gate, x)
    _check(w, ids.int(), want, 1e-5)
    w, ids = ops.moe_route(x @ gate.weight.T, k, bias=bias, num_group=G, topk_group=TG, scoring=scoring,
                           renormalize=renorm, scaling=scaling)
    _check(w, ids, want, 1e-5)


def test_opcheck_and_fake():
    logits, b = _inputs(16, True)
    args = (logits, b, 4, 4, 2, "sigmoid", True, 2.5)
    torch.library.opcheck(torch.ops.mla.moe_route_ref, args)
    torch.library.opcheck(torch.ops.mla.moe_route_ref, (logits, None, 3, 1, 1, "softmax", False, 1.0))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        w, ids = torch.ops.mla.moe_route_ref(mode.from_tensor(logits), mode.from_tensor(b), 4, 4, 2, "sigmoid",
                                             True, 2.5)
    assert w.shape == (7, 4) and w.dtype == torch.float32 and ids.shape == (7, 4) and ids.dtype == torch.int32


def test_compiled_call_matches_eager():
    logits, b = _inputs(16, True)
    fn = torch.compile(lambda z: ops.moe_route(z, 4, bias=b, num_group=4, topk_group=2, scoring="sigmoid",
                                               renormalize=True, scaling=2.5), fullgraph=True)
    w, ids = fn(logits)
    _check(w, ids, route64(logits, b, 4, 4, 2, "sigmoid", True, 2.5), 1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(logits=torch.zeros(3, 16, dtype=torch.bfloat16)), "logits"),
    (dict(logits=torch.zeros(16)), "logits"),
    (dict(bias=torch.zeros(15)), "bias"),
    (dict(num_group=3), "num_group"),
    (dict(topk_group=5), "topk_group"),
    (dict(top_k=9), "top_k"),
    (dict(scoring="relu"), "scoring"),
])
def test_errors_name_the_argument(kwargs, match):
    args = dict(logits=torch.randn(3, 16), top_k=4, bias=torch.zeros(16), num_group=4, topk_group=2,
                scoring="sigmoid")
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.moe_route(args.pop("logits"), args.pop("top_k"), **args)
