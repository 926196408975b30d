"""``mla::fp8_block_linear`` against a float64 model of DeepSeek's block math: odd M, K and N that are not
multiples of 128, 2-D and grouped 3-D weights, with and without the 1 x 128 activation quantization;
opcheck, the fake function, errors naming the argument, and a compiled call."""

from __future__ import annotations

import pytest
import torch

from mla_compile import ops
from tests.checkpoints import dequantize64, quantize_blocks

SHAPES = [(1, 128, 128), (7, 300, 200), (33, 64, 384), (5, 129, 1), (2, 1000, 130)]


def _weights(*shape, seed=0):
    """fp8 codes and block scales of a random ``[..., N, K]`` weight (per leading group)."""
    torch.manual_seed(seed)
    w = torch.randn(*shape)
    if w.dim() == 2:
        return quantize_blocks(w)
    pairs = [quantize_blocks(g) for g in w]
    return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


def _act64(x: torch.Tensor, act_quant: bool) -> torch.Tensor:
    """The contract's activation in float64: each 128-wide group of a row rounded to e4m3 with scale
    ``max(amax / 448, 2**-64)`` (float32 scale, torch's round-to-nearest-even cast), or ``x`` itself."""
    if not act_quant:
        return x.double()
    out = torch.empty(x.shape, dtype=torch.float64)
    for k0 in range(0, x.shape[-1], 128):
        g = x[..., k0:k0 + 128].float()
        s = (g.abs().amax(-1, keepdim=True) / 448.0).clamp_min(2.0 ** -64)
        out[..., k0:k0 + 128] = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s.double()
    return out


def _ref64(x, codes, scale, act_quant):
    if codes.dim() == 2:
        return _act64(x, act_quant) @ dequantize64(codes, scale).T
    w = torch.stack([dequantize64(c, s) for c, s in zip(codes, scale)])
    return _act64(x, act_quant) @ w.transpose(-1, -2)


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matches_float64_block_math(M, K, N, act_quant):
    codes, scale = _weights(N, K)
    x = torch.randn(M, K) * 3
    y = ops.fp8_block_linear(x, codes, scale, act_quant=act_quant)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert _rel(y, _ref64(x, codes, scale, act_quant)) < 2e-6
    y64 = ops.fp8_block_linear(x.double(), codes, scale, act_quant=act_quant)
    assert _rel(y64, _ref64(x, codes, scale, act_quant)) < 1e-12


def test_leading_dims_and_bfloat16():
    codes, scale = _weights(200, 300)
    x = torch.randn(2, 3, 300)
    y = ops.fp8_block_linear(x, codes, scale)
    assert y.shape == (2, 3, 200)
    torch.testing.assert_close(y, ops.fp8_block_linear(x.reshape(6, 300), codes, scale).view(2, 3, 200))
    yb = ops.fp8_block_linear(x.bfloat16(), codes, scale)
    assert yb.dtype == torch.bfloat16 and _rel(yb, _ref64(x.bfloat16().float(), codes, scale, False)) < 5e-3


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("shared_x", [True, False])
def test_grouped_weights(shared_x, act_quant):
    codes, scale = _weights(3, 70, 150)
    x = torch.randn(5, 150) if shared_x else torch.randn(3, 5, 150)
    y = ops.fp8_block_linear(x, codes, scale, act_quant=act_quant)
    assert y.shape == (3, 5, 70)
    assert _rel(y, _ref64(x, codes, scale, act_quant)) < 2e-6


# opcheck's test_schema perturbs every input with a multiply, which torch has no CPU kernel for on float8
# tensors; the other utilities (fake tensor, AOT dispatch static and dynamic) all run.
OPCHECK_UTILS = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")


def _sorted64(x, codes, scale, offs, act_quant):
    """The sorted-groups contract in float64: rows [offs[e-1], offs[e]) through group e, later rows 0."""
    want = torch.zeros(x.shape[0], codes.shape[1], dtype=torch.float64)
    begin = 0
    for e, end in enumerate(offs.tolist()):
        want[begin:end] = _ref64(x[begin:end], codes[e], scale[e], act_quant)
        begin = end
    return want


OFFS = [[5, 5, 17, 20], [0, 0, 0, 23], [23, 23, 23, 23], [0, 0, 0, 0]]


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("offs", OFFS)
def test_sorted_groups(offs, act_quant):
    codes, scale = _weights(4, 70, 150)
    x = torch.randn(23, 150)
    offs = torch.tensor(offs, dtype=torch.int32)
    y = ops.fp8_block_linear(x, codes, scale, act_quant=act_quant, offs=offs)
    assert y.shape == (23, 70)
    assert (y[int(offs[-1]):] == 0).all()
    want = _sorted64(x, codes, scale, offs, act_quant)
    assert float((y.double() - want).norm()) <= 2e-6 * float(want.norm()) + 1e-12


def test_opcheck():
    op = torch.ops.mla.fp8_block_linear_ref.default
    codes, scale = _weights(200, 300)
    for act_quant in (False, True):
        torch.library.opcheck(op, (torch.randn(7, 300), codes, scale, act_quant), test_utils=OPCHECK_UTILS)
    codes3, scale3 = _weights(2, 70, 150)
    torch.library.opcheck(op, (torch.randn(2, 5, 150), codes3, scale3, False), test_utils=OPCHECK_UTILS)
    offs = torch.tensor([3, 7], dtype=torch.int32)
    torch.library.opcheck(op, (torch.randn(9, 150), codes3, scale3, True, offs), test_utils=OPCHECK_UTILS)


def test_fake_gives_shapes_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(9, 300, dtype=torch.bfloat16)
        w = torch.empty(200, 300, dtype=torch.float8_e4m3fn)
        s = torch.empty(2, 3)
        y = torch.ops.mla.fp8_block_linear_ref(x, w, s, False)
        y3 = torch.ops.mla.fp8_block_linear_ref(x, w.expand(4, 200, 300), s.expand(4, 2, 3), True)
        offs = torch.empty(4, dtype=torch.int32)
        ys = torch.ops.mla.fp8_block_linear_ref(x, w.expand(4, 200, 300), s.expand(4, 2, 3), True, offs)
    assert (y.shape, y.dtype, y3.shape, ys.shape) == ((9, 200), torch.bfloat16, (4, 9, 200), (9, 200))


@pytest.mark.parametrize("change,match", [
    (dict(scale=torch.ones(2, 2)), r"weight_scale_inv must have shape .*\[2, 3\]"),
    (dict(weight=torch.zeros(200, 300)), "weight must have dtype .*float8_e4m3fn"),
    (dict(x=torch.randn(4, 299)), "x must have shape"),
    (dict(scale=torch.ones(2, 3, dtype=torch.float64)), "weight_scale_inv must have dtype .*float32"),
])
def test_errors_name_the_argument(change, match):
    codes, scale = _weights(200, 300)
    args = dict(x=torch.randn(4, 300), weight=codes, scale=scale) | change
    with pytest.raises((ValueError, TypeError), match=match):
        ops.fp8_block_linear(args["x"], args["weight"], args["scale"])


def test_offs_needs_grouped_weights():
    codes, scale = _weights(128, 128)
    with pytest.raises(ValueError, match="offs .* needs a 3-D weight"):
        ops.fp8_block_linear(torch.randn(2, 128), codes, scale, offs=torch.tensor([2], dtype=torch.int32))


def test_scaled_mm_backend_refuses_weight_only():
    codes, scale = _weights(128, 128)
    with pytest.raises(ValueError, match="act_quant=True"):
        ops.fp8_block_linear(torch.randn(2, 128), codes, scale, backend="scaled-mm")


def test_compiled_fullgraph_matches_eager():
    codes, scale = _weights(200, 300)
    fn = torch.compile(lambda x: ops.fp8_block_linear(x, codes, scale, act_quant=True), fullgraph=True)
    x = torch.randn(7, 300)
    torch.testing.assert_close(fn(x), ops.fp8_block_linear(x, codes, scale, act_quant=True), atol=1e-5, rtol=1e-5)
