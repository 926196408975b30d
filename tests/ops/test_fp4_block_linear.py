"""``mla::fp4_block_linear`` against a float64 model of DeepSeek-V4's fp4 format (tests/checkpoints.py): the 16
e2m1 codes, the nibble order, ue8m0 extremes (2^-127, 2^127, NaN), odd M and N, 2-D / grouped / sorted-group
weights, the checkpoint dtypes (int8 / float4_e2m1fn_x2 codes, uint8 / float8_e8m0fnu scales); opcheck, the
fake function, errors naming the argument (K not a multiple of 32 among them), and a compiled call."""

from __future__ import annotations

import pytest
import torch

from mla_compile import ops
from mla_compile.ops.fp4_block_linear import dequantize, unpack
from tests.checkpoints import E2M1, dequantize_fp4_64, quantize_fp4

SHAPES = [(1, 32, 1), (7, 160, 70), (33, 64, 129), (2, 1024, 17), (5, 96, 200)]


def _weights(*shape, seed=0):
    """fp4 codes and ue8m0 scales of a random ``[..., N, K]`` weight."""
    torch.manual_seed(seed)
    return quantize_fp4(torch.randn(*shape))


def _ref64(x, packed, scale):
    return x.double() @ dequantize_fp4_64(packed, scale).transpose(-1, -2)


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def _sorted64(x, packed, scale, offs):
    """The sorted-groups contract in float64: rows [offs[e-1], offs[e]) through group e, later rows 0."""
    want = torch.zeros(x.shape[0], packed.shape[1], dtype=torch.float64)
    begin = 0
    for e, end in enumerate(offs.tolist()):
        want[begin:end] = _ref64(x[begin:end], packed[e], scale[e])
        begin = end
    return want


def _pack(codes: list[int]) -> torch.Tensor:
    """4-bit codes -> bytes, element 2j in the low nibble of byte j (written from the format, not the op)."""
    return torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)], dtype=torch.uint8)


def test_every_e2m1_code_and_both_nibbles():
    """Row n of a 16-row weight holds code n at column 2n % 32 + (n // 8) (low nibble for n < 8, high after),
    every other element 0; x = identity: y[k, n] is code n's value exactly where column k holds it."""
    K = 32
    codes = torch.zeros(16, K, dtype=torch.int64)
    for n in range(16):
        codes[n, 2 * (n % 8) + n // 8] = n
    packed = torch.stack([_pack(row.tolist()) for row in codes])
    scale = torch.full((16, 1), 127, dtype=torch.uint8)  # 2^0
    want = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    w = dequantize(packed, scale, torch.float64)
    for n in range(16):
        k = 2 * (n % 8) + n // 8
        assert w[n, k] == want[n] and (torch.signbit(w[n, k]) == (n >= 8))  # -0 for code 8
        assert (w[n].abs().sum() == abs(want[n]))
    y = ops.fp4_block_linear(torch.eye(K, dtype=torch.float64), packed, scale)
    assert torch.equal(y, w.T)
    assert y[:, 7].max() == 6.0 and y[:, 1].max() == 0.5 and y[:, 15].min() == -6.0


def test_nibble_order_low_first():
    packed = torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8)  # codes 1 (0.5) then 7 (6.0)
    scale = torch.full((1, 1), 128, dtype=torch.uint8)  # 2^1
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 1] = 1.0, 1.0
    assert ops.fp4_block_linear(x, packed, scale).flatten().tolist() == [1.0, 12.0]
    assert unpack(packed)[0, :2].tolist() == [0.5, 6.0]


@pytest.mark.parametrize("byte", [0, 1, 126, 127, 128, 253, 254])
def test_ue8m0_extremes(byte):
    """Every block scale ``2^(byte - 127)``, 2^-127 (a float32 subnormal) to 2^127: float64 exact, float32 to
    rounding, with x scaled so the products are normal float32 numbers."""
    torch.manual_seed(byte)
    packed = torch.randint(0, 256, (5, 48), dtype=torch.uint8)
    if byte >= 253:  # keep |W| <= 1.5 * 2^127, finite in float32
        packed &= 0xBB  # clears bit 2 of each nibble: codes 0-3 and 8-11
    scale = torch.full((5, 3), byte, dtype=torch.uint8)
    x = torch.randn(3, 96, dtype=torch.float64) * 2.0 ** max(-100, min(100, 117 - byte))
    want = x @ dequantize_fp4_64(packed, scale).T
    assert torch.isfinite(want).all()
    assert torch.equal(ops.fp4_block_linear(x, packed, scale), want) or _rel(
        ops.fp4_block_linear(x, packed, scale), want) < 1e-15
    y32 = ops.fp4_block_linear(x.float(), packed, scale)
    assert torch.isfinite(y32).all() and _rel(y32, x.float().double() @ dequantize_fp4_64(packed, scale).T) < 1e-6


def test_scale_byte_255_is_nan():
    packed = torch.full((3, 32), 0x22, dtype=torch.uint8)  # every value 1.0
    scale = torch.tensor([[127, 127], [127, 255], [120, 127]], dtype=torch.uint8)
    y = ops.fp4_block_linear(torch.randn(2, 64), packed, scale)
    assert torch.isnan(y[:, 1]).all() and torch.isfinite(y[:, [0, 2]]).all()


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matches_float64(M, K, N):
    packed, scale = _weights(N, K)
    x = torch.randn(M, K) * 3
    y = ops.fp4_block_linear(x, packed, scale)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert _rel(y, _ref64(x, packed, scale)) < 2e-6
    y64 = ops.fp4_block_linear(x.double(), packed, scale)
    assert _rel(y64, _ref64(x, packed, scale)) < 1e-13


def test_leading_dims_and_half_dtypes():
    packed, scale = _weights(200, 96)
    x = torch.randn(2, 3, 96)
    y = ops.fp4_block_linear(x, packed, scale)
    assert y.shape == (2, 3, 200)
    torch.testing.assert_close(y, ops.fp4_block_linear(x.reshape(6, 96), packed, scale).view(2, 3, 200))
    for dtype in (torch.bfloat16, torch.float16):
        yh = ops.fp4_block_linear(x.to(dtype), packed, scale)
        assert yh.dtype == dtype and _rel(yh, _ref64(x.to(dtype).float(), packed, scale)) < 5e-3


def test_checkpoint_dtypes_are_views_of_the_same_bytes():
    """int8 / uint8 / float4_e2m1fn_x2 codes and uint8 / float8_e8m0fnu scales give the same result."""
    packed, scale = _weights(40, 64)
    x = torch.randn(3, 64)
    want = ops.fp4_block_linear(x, packed.view(torch.uint8), scale)
    for p in [packed] + ([packed.view(torch.float4_e2m1fn_x2)] if hasattr(torch, "float4_e2m1fn_x2") else []):
        for s in [scale] + ([scale.view(torch.float8_e8m0fnu)] if hasattr(torch, "float8_e8m0fnu") else []):
            assert torch.equal(ops.fp4_block_linear(x, p, s), want)


@pytest.mark.parametrize("shared_x", [True, False])
def test_grouped_weights(shared_x):
    packed, scale = _weights(3, 70, 96)
    x = torch.randn(5, 96) if shared_x else torch.randn(3, 5, 96)
    y = ops.fp4_block_linear(x, packed, scale)
    assert y.shape == (3, 5, 70)
    assert _rel(y, _ref64(x, packed, scale)) < 2e-6


OFFS = [[5, 5, 17, 20], [0, 0, 0, 23], [23, 23, 23, 23], [0, 0, 0, 0]]


@pytest.mark.parametrize("offs", OFFS)
def test_sorted_groups(offs):
    packed, scale = _weights(4, 70, 96)
    x = torch.randn(23, 96)
    offs = torch.tensor(offs, dtype=torch.int32)
    y = ops.fp4_block_linear(x, packed, scale, offs=offs)
    assert y.shape == (23, 70)
    assert (y[int(offs[-1]):] == 0).all()
    want = _sorted64(x, packed, scale, offs)
    assert float((y.double() - want).norm()) <= 2e-6 * float(want.norm()) + 1e-12


def test_opcheck():
    op = torch.ops.mla.fp4_block_linear_ref.default
    packed, scale = _weights(70, 96)
    torch.library.opcheck(op, (torch.randn(7, 96), packed, scale))
    packed3, scale3 = _weights(2, 70, 96)
    torch.library.opcheck(op, (torch.randn(2, 5, 96), packed3, scale3))
    torch.library.opcheck(op, (torch.randn(9, 96), packed3, scale3, torch.tensor([3, 7], dtype=torch.int32)))


def test_fake_gives_shapes_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(9, 320, dtype=torch.bfloat16)
        w = torch.empty(200, 160, dtype=torch.int8)
        s = torch.empty(200, 10, dtype=torch.uint8)
        y = torch.ops.mla.fp4_block_linear_ref(x, w, s)
        y3 = torch.ops.mla.fp4_block_linear_ref(x, w.expand(4, 200, 160), s.expand(4, 200, 10))
        offs = torch.empty(4, dtype=torch.int32)
        ys = torch.ops.mla.fp4_block_linear_ref(x, w.expand(4, 200, 160), s.expand(4, 200, 10), offs)
    assert (y.shape, y.dtype, y3.shape, ys.shape) == ((9, 200), torch.bfloat16, (4, 9, 200), (9, 200))


@pytest.mark.parametrize("change,match", [
    (dict(weight=torch.zeros(20, 20, dtype=torch.uint8), scale=torch.zeros(20, 1, dtype=torch.uint8),
          x=torch.randn(4, 40)), r"K = 2 \* weight.shape\[-1\] = 40 must be a multiple of 32"),
    (dict(scale=torch.ones(20, 2, dtype=torch.uint8)), r"weight_scale must have shape \[20, 3\]"),
    (dict(scale=torch.ones(20, 3)), "weight_scale must have dtype"),
    (dict(weight=torch.zeros(20, 48)), "weight must have dtype"),
    (dict(x=torch.randn(4, 48)), r"x must have shape \[\*, 96\]"),
    (dict(x=torch.randn(4, 96, dtype=torch.float64).to(torch.int32)), "x must have dtype"),
])
def test_errors_name_the_argument(change, match):
    packed, scale = _weights(20, 96)
    args = dict(x=torch.randn(4, 96), weight=packed, scale=scale) | change
    with pytest.raises((ValueError, TypeError), match=match):
        ops.fp4_block_linear(args["x"], args["weight"], args["scale"])


def test_offs_needs_grouped_weights():
    packed, scale = _weights(32, 64)
    with pytest.raises(ValueError, match="offs .* needs a 3-D weight"):
        ops.fp4_block_linear(torch.randn(2, 64), packed, scale, offs=torch.tensor([2], dtype=torch.int32))


def test_compiled_fullgraph_matches_eager():
    packed, scale = _weights(70, 96)
    fn = torch.compile(lambda x: ops.fp4_block_linear(x, packed, scale), fullgraph=True)
    x = torch.randn(7, 96)
    torch.testing.assert_close(fn(x), ops.fp4_block_linear(x, packed, scale), atol=1e-5, rtol=1e-5)
