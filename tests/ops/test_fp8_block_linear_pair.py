"""``mla::fp8_block_linear_pair`` (two fp8 block linears sharing one input): the reference against float64 block
math, opcheck, errors naming the argument, compiled; the Triton backend's kernel under the interpreter and on a GPU
(tests/ops/triton/test_triton_fp8_block_linear.py)."""

from __future__ import annotations

import pytest
import torch

from mla_compile import ops
from tests.ops.test_fp8_block_linear import OPCHECK_UTILS, _ref64, _rel, _weights


@pytest.mark.parametrize("act_quant", [False, True])
def test_reference_matches_float64(act_quant):
    c1, s1 = _weights(200, 300)
    c2, s2 = _weights(70, 300, seed=1)
    x = torch.randn(2, 3, 300)
    y1, y2 = ops.fp8_block_linear_pair(x, (c1, s1), (c2, s2), act_quant=act_quant)
    assert y1.shape == (2, 3, 200) and y2.shape == (2, 3, 70)
    assert _rel(y1.reshape(6, 200), _ref64(x.reshape(6, 300), c1, s1, act_quant)) < 2e-6
    assert _rel(y2.reshape(6, 70), _ref64(x.reshape(6, 300), c2, s2, act_quant)) < 2e-6


def test_opcheck_and_compiled():
    c1, s1 = _weights(200, 300)
    c2, s2 = _weights(70, 300, seed=1)
    x = torch.randn(5, 300)
    torch.library.opcheck(torch.ops.mla.fp8_block_linear_pair_ref.default, (x, c1, s1, c2, s2, False),
                          test_utils=OPCHECK_UTILS)
    torch._dynamo.reset()
    fn = torch.compile(lambda a: ops.fp8_block_linear_pair(a, (c1, s1), (c2, s2)), fullgraph=True)
    for got, want in zip(fn(x), ops.fp8_block_linear_pair(x, (c1, s1), (c2, s2))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("change,match", [
    (lambda a: (a[0][:, :200], *a[1:]), r"x.*\[M, K\]|weight.*300"),
    (lambda a: (a[0], a[1].float(), *a[2:]), r"weight.*float8_e4m3fn"),
    (lambda a: (*a[:3], a[3][:, :128], a[4]), r"weight2.*\[N, 300\]"),
    (lambda a: (*a[:4], a[4][:, :1]), r"weight2_scale_inv.*\[1, 3\]"),
    (lambda a: (*a[:4], a[4].double()), r"weight2_scale_inv.*float32"),
])
def test_errors_name_the_argument(change, match):
    c1, s1 = _weights(200, 300)
    c2, s2 = _weights(70, 300, seed=1)
    x, w1, sc1, w2, sc2 = change((torch.randn(5, 300), c1, s1, c2, s2))
    with pytest.raises((TypeError, ValueError), match=match):
        ops.fp8_block_linear_pair(x, (w1, sc1), (w2, sc2))


def _fp8_module(n: int, k: int, seed: int, act_quant: bool = False):
    from mla_compile.models.fp8_linear import FP8BlockLinear

    m = FP8BlockLinear(k, n, act_quant=act_quant)
    codes, scale = _weights(n, k, seed=seed)
    m.weight.data.copy_(codes)
    m.weight_scale_inv.data.copy_(scale)
    return m


@pytest.mark.parametrize("act_quant", [False, True])
def test_model_linears_run_a_pair_of_fp8_modules_as_one_op(act_quant, monkeypatch):
    """``models.attention.linears`` over two plain ``FP8BlockLinear`` modules: the pair op where ``fp8_pair`` holds
    (its Triton backend forced as "auto"'s choice: on the CPU the op's "auto" runs the reference), outputs equal to
    the modules' own; modules with a backend of their own, mixed ``act_quant`` or a third module run each."""
    from mla_compile.models import attention

    a, b = _fp8_module(200, 300, 0, act_quant), _fp8_module(70, 300, 1, act_quant)
    x = torch.randn(4, 300)
    calls = []
    real = ops.fp8_block_linear_pair
    monkeypatch.setattr(attention, "half_kernel",
                        lambda op, *args: "triton" if op == "fp8_block_linear_pair" else None)
    monkeypatch.setattr(attention.ops, "fp8_block_linear_pair", lambda *a, **k: calls.append(k) or real(*a, **k))
    y1, y2 = attention.linears(x, a, b)
    assert calls == [dict(act_quant=act_quant)]
    assert torch.equal(y1, a(x)) and torch.equal(y2, b(x))
    c = _fp8_module(70, 300, 2, not act_quant)
    b.backend = "reference"
    for modules in ((a, b), (a, c), (a, a, a)):
        assert not attention.fp8_pair(x, modules)
