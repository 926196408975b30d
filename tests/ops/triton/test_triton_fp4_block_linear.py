"""The Triton ``mla::fp4_block_linear`` kernels (tiled GEMM with either decode and per-row GEMV, each on every
case): under Triton's CPU interpreter against the float64 model of the fp4 format (every code, both nibbles, ue8m0 extremes and NaN,
odd shapes, grouped and sorted groups), and on a GPU (eager and compiled, DeepSeek-V4 expert shapes) against
the same model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_compile import ops
from tests.checkpoints import dequantize_fp4_64
from tests.ops.test_fp4_block_linear import OFFS, _ref64, _rel, _sorted64, _weights
from tests.ops.triton.conftest import INTERPRET

CASES = [((7, 160), (70, 160)), ((1, 32), (1, 32)), ((17, 96), (130, 96)), ((5, 96), (3, 70, 96)),
         ((3, 5, 96), (3, 70, 96)), ((20, 320), (33, 320)), ((9, 256), (40, 256))]
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")


GEMV_CASES = [((1, 32), (1, 32)), ((3, 160), (70, 160)), ((2, 96), (3, 70, 96)), ((3, 2, 96), (3, 70, 96))]


def _force(monkeypatch, path):
    """Run the tiled ``tl.dot`` GEMM (GEMV_ROWS = 0; "dot-words": its int32-word decode, TILED_WORDS) or the per-row
    GEMV (always) whatever the row count."""
    from mla_compile.ops.triton import fp4_block_linear

    tiled = path.startswith("dot")
    monkeypatch.setattr(fp4_block_linear, "GEMV_ROWS", 0 if tiled else 1 << 30)
    monkeypatch.setattr(fp4_block_linear, "GEMV_ROWS_SORTED", 0 if tiled else 1 << 30)
    monkeypatch.setattr(fp4_block_linear, "TILED_WORDS", path == "dot-words")


@pytest.fixture(params=["dot", "dot-words", "gemv"])
def path(request, monkeypatch):
    """Both kernels on the case."""
    _force(monkeypatch, request.param)
    return request.param


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path,x_shape,w_shape", [(p, *c) for p in ("dot", "dot-words") for c in CASES]
                         + [("gemv", *c) for c in GEMV_CASES])
def test_interpreter_matches_float64(x_shape, w_shape, dtype, path, monkeypatch):
    from mla_compile.ops.triton.fp4_block_linear import _launch

    _force(monkeypatch, path)
    packed, scale = _weights(*w_shape)
    x = torch.randn(*x_shape).to(dtype)
    y = _launch(x, packed, scale)
    want = _ref64(x.float(), packed, scale)
    assert y.shape == want.shape and y.dtype == dtype
    # bf16 / fp16: output rounding only (the interpreter's float32 -> bf16 cast truncates: up to 2**-8)
    assert _rel(y, want) < (1e-6 if dtype == torch.float32 else 8e-3)


def _every_code():
    """All 256 bytes across the rows (so every code sits in both nibbles), with scales 2^-3 .. 2^4."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(8, 32)
    scale = torch.arange(124, 132, dtype=torch.uint8)[:, None].expand(8, 2).contiguous()
    return packed, scale


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreter_every_code_and_nibble(path, dtype):
    """Every code exactly (bf16 holds each weight: two significant bits), through each decode."""
    from mla_compile.ops.triton.fp4_block_linear import _launch

    packed, scale = _every_code()
    y = _launch(torch.eye(64, dtype=dtype), packed, scale)
    assert torch.equal(y.double(), dequantize_fp4_64(packed, scale).T)


@interpret
def test_interpreter_word_decode_scale_range(monkeypatch):
    """bf16 x on the word decode (weights times 2^-32 in bfloat16): exact for scale bytes 34..160, byte 255 (NaN)
    gives NaN and bytes above 160 a non-finite output, never a wrong finite one."""
    from mla_compile.ops.triton.fp4_block_linear import _launch

    _force(monkeypatch, "dot-words")
    torch.manual_seed(0)
    for byte in (34, 60, 127, 160):
        packed = torch.randint(0, 256, (5, 48), dtype=torch.uint8)
        scale = torch.full((5, 3), byte, dtype=torch.uint8)
        x = (torch.randn(17, 96) * 2.0 ** max(-100, min(100, 117 - byte))).bfloat16()
        want = x.double() @ dequantize_fp4_64(packed, scale).T
        assert _rel(_launch(x, packed, scale), want) < 8e-3, byte
    scale[1] = 161
    scale[3, 2] = 255
    y = _launch(torch.randn(17, 96).bfloat16(), packed, scale)
    assert not torch.isfinite(y[:, [1, 3]]).any() and torch.isfinite(y[:, [0, 2, 4]]).all()


@interpret
@pytest.mark.parametrize("byte", [0, 1, 127, 254])
def test_interpreter_ue8m0_extremes(byte, path):
    from mla_compile.ops.triton.fp4_block_linear import _launch

    torch.manual_seed(byte)
    packed = torch.randint(0, 256, (5, 48), dtype=torch.uint8)
    if byte >= 253:
        packed &= 0xBB  # |W| <= 1.5 * 2^127, finite in float32
    scale = torch.full((5, 3), byte, dtype=torch.uint8)
    x = torch.randn(3, 96) * 2.0 ** max(-100, min(100, 117 - byte))
    want = x.double() @ dequantize_fp4_64(packed, scale).T
    y = _launch(x, packed, scale)
    assert torch.isfinite(y).all() and _rel(y, want) < 1e-6


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreter_nan_scale(path, dtype):
    from mla_compile.ops.triton.fp4_block_linear import _launch

    packed = torch.full((3, 32), 0x22, dtype=torch.uint8)
    scale = torch.tensor([[127, 127], [127, 255], [120, 127]], dtype=torch.uint8)
    y = _launch(torch.randn(20, 64).to(dtype), packed, scale)
    assert torch.isnan(y[:, 1]).all() and torch.isfinite(y[:, [0, 2]]).all()


# the per-row GEMV, the slowest interpreted form, at K=256 on the mixed and the empty offsets only
SORTED_CASES = [pytest.param(offs, dtype, path, K, id=f"{K}-offs{OFFS.index(offs)}-{path}-{str(dtype)[6:]}")
                for K in (96, 256) for offs in OFFS
                for path, dtype in [("dot", torch.float32), ("dot", torch.bfloat16), ("dot-words", torch.float32),
                                    ("dot-words", torch.bfloat16), ("gemv", torch.float32)]
                if path != "gemv" or K == 96 or offs in (OFFS[0], OFFS[-1])]


@interpret
@pytest.mark.parametrize("offs,dtype,path,K", SORTED_CASES)
def test_interpreter_sorted_groups(offs, dtype, path, K, monkeypatch):
    from mla_compile.ops.triton.fp4_block_linear import _launch_sorted

    _force(monkeypatch, path)
    packed, scale = _weights(4, 70, K)
    x = torch.randn(23, K).to(dtype)
    offs = torch.tensor(offs, dtype=torch.int32)
    y = _launch_sorted(x, packed, scale, offs)
    want = _sorted64(x.float(), packed, scale, offs)
    assert (y[int(offs[-1]):] == 0).all()
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert float((y.double() - want).norm()) <= tol * float(want.norm()) + 1e-12


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("x_shape,w_shape", CASES + [((1, 4096), (2048, 4096)), ((64, 2048), (4096, 2048)),
                                                     ((64, 4096), (6, 2048, 4096))])
def test_triton_on_gpu_matches_float64(x_shape, w_shape, path):
    packed, scale = _weights(*w_shape)
    x = torch.randn(*x_shape).bfloat16()
    want = _ref64(x.float(), packed, scale)
    p, s = packed.cuda(), scale.cuda()
    y = ops.fp4_block_linear(x.cuda(), p, s, backend="triton")
    assert _rel(y.cpu(), want) < 4e-3
    y32 = ops.fp4_block_linear(x.float().cuda(), p, s, backend="triton")
    assert _rel(y32.cpu(), want) < 1e-5
    fn = torch.compile(lambda a: ops.fp4_block_linear(a, p, s, backend="triton"), fullgraph=True)
    assert _rel(fn(x.cuda()).cpu(), want) < 4e-3


@pytest.mark.cuda
@needs_triton
def test_triton_sorted_groups_on_gpu(path):
    packed, scale = _weights(8, 2048, 4096)
    x = torch.randn(300, 4096).bfloat16()
    offs = torch.tensor([10, 10, 90, 150, 151, 200, 290, 290], dtype=torch.int32)
    want = _sorted64(x.float(), packed, scale, offs)
    y = ops.fp4_block_linear(x.cuda(), packed.cuda(), scale.cuda(), offs=offs.cuda(), backend="triton")
    assert _rel(y.cpu(), want) < 4e-3 and (y[290:] == 0).all()


@pytest.mark.cuda
@needs_triton
@pytest.mark.parametrize("byte", [0, 254])
def test_triton_extremes_on_gpu(byte, path):
    """Subnormal 2^-127 and 2^127 scales decode exactly on the GPU (no flush to zero)."""
    torch.manual_seed(byte)
    packed = torch.randint(0, 256, (64, 64), dtype=torch.uint8)
    if byte >= 253:
        packed &= 0xBB
    scale = torch.full((64, 4), byte, dtype=torch.uint8)
    x = torch.randn(16, 128) * 2.0 ** max(-100, min(100, 117 - byte))
    want = x.double() @ dequantize_fp4_64(packed, scale).T
    y = ops.fp4_block_linear(x.cuda(), packed.cuda(), scale.cuda(), backend="triton")
    assert _rel(y.cpu(), want) < 1e-5


@pytest.mark.cuda
@needs_triton
def test_triton_every_code_on_gpu(path):
    """Every code in bf16 on the GPU, exactly (the word decode's subnormal bfloat16 for code 0.5 not flushed)."""
    packed, scale = _every_code()
    y = ops.fp4_block_linear(torch.eye(64, dtype=torch.bfloat16, device="cuda"), packed.cuda(), scale.cuda(),
                             backend="triton")
    assert torch.equal(y.double().cpu(), dequantize_fp4_64(packed, scale).T)
