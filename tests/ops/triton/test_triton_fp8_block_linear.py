"""The Triton ``mla::fp8_block_linear`` kernel: under Triton's CPU interpreter against the reference op, and
on a GPU (backends "triton" and "scaled-mm", eager and compiled) against the float64 block math."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_compile import ops
from tests.ops.test_fp8_block_linear import OFFS, OPCHECK_UTILS, _ref64, _rel, _sorted64, _weights
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

CASES = [((7, 300), (200, 300)), ((1, 128), (128, 128)), ((17, 64), (130, 64)), ((5, 150), (3, 70, 150)),
         ((3, 5, 150), (3, 70, 150))]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("x_shape,w_shape", CASES)
def test_interpreter_matches_reference(x_shape, w_shape, act_quant, dtype):
    from mla_compile.ops.triton.fp8_block_linear import _launch

    codes, scale = _weights(*w_shape)
    x = torch.randn(*x_shape).to(dtype)
    y = _launch(x, codes, scale, act_quant)
    ref = torch.ops.mla.fp8_block_linear_ref(x, codes, scale, act_quant)
    assert y.shape == ref.shape and y.dtype == dtype
    # bf16: output rounding only (the interpreter's float32 -> bf16 cast truncates: up to 1 ulp, 2**-8)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert _rel(y, ref.double()) < tol


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("split,w_shape", [(2, (70, 700)), (4, (70, 700)), (6, (3, 70, 700)), (3, (130, 520))])
def test_interpreter_split_k_matches_float64(split, w_shape, act_quant):
    """K split into float32 slices (4 of 6 steps -> 3 slices of 2; 6 -> one step each; a ragged last K step)."""
    from mla_compile.ops.triton.fp8_block_linear import _launch

    codes, scale = _weights(*w_shape)
    x = torch.randn(3, w_shape[-1]).bfloat16()
    want = _ref64(x.float(), codes, scale, act_quant)
    y = _launch(x, codes, scale, act_quant, split=split)
    assert y.shape == want.shape and y.dtype == torch.bfloat16
    assert _rel(y.double(), want) < 8e-3
    y32 = _launch(x.float(), codes, scale, act_quant, split=split)
    assert _rel(y32.double(), want) < 1e-6


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("x_shape,w_shape,split,serial", [((3, 700), (70, 700), None, False),
                                                          ((3, 700), (70, 700), 3, True),
                                                          ((5, 300), (3, 70, 300), 2, False),
                                                          ((1, 520), (130, 520), 4, True)])
def test_interpreter_pdl_launch_matches_float64(x_shape, w_shape, split, serial, act_quant, monkeypatch):
    """The launch an sm_90 device makes with PDL (``PDL=True``), its wait and trigger stood in by recorders (the
    interpreter has no ``griddepcontrol``): dense, K split and serial split, against float64; every program waits,
    then triggers."""
    import triton.language as tl

    from mla_compile.ops.triton import fp8_block_linear as k

    calls = []
    for name in ("gdc_wait", "gdc_launch_dependents"):
        monkeypatch.setattr(tl.extra.cuda, name, lambda *a, name=name, **kw: calls.append(name))
    monkeypatch.setattr(k, "launch_kwargs", lambda *a, **kw: {"PDL": True})
    codes, scale = _weights(*w_shape)
    x = torch.randn(*x_shape)
    y = k._launch(x, codes, scale, act_quant, split=split, serial=serial)
    assert _rel(y.double(), _ref64(x, codes, scale, act_quant)) < 1e-6
    assert calls[:2] == ["gdc_wait", "gdc_launch_dependents"] and len(calls) % 2 == 0  # each program: wait, trigger


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("x_shape,w_shape,split", [((3, 700), (70, 700), 3), ((1, 520), (130, 520), 2),
                                                   ((17, 300), (3, 70, 300), 3), ((3, 5, 300), (3, 70, 300), 2)])
def test_interpreter_serial_split_sums_in_the_kernel(x_shape, w_shape, split):
    """The serial split (each tile's last program adds the float32 slices in order) against float64, bf16 and
    float32 x; every output written (NaN-poisoned allocations); the arrival counters back at 0 after the call, so a
    second call gives the same result bit for bit."""
    from mla_compile.ops.triton import fp8_block_linear as k

    codes, scale = _weights(*w_shape)
    x = torch.randn(*x_shape).bfloat16()
    want = _ref64(x.float(), codes, scale, False)
    with poisoned_empty():
        y = k._launch(x, codes, scale, False, split=split, serial=True)
        y32 = k._launch(x.float(), codes, scale, False, split=split, serial=True)
        again = k._launch(x, codes, scale, False, split=split, serial=True)
    assert y.shape == want.shape and y.dtype == torch.bfloat16
    assert _rel(y.double(), want) < 8e-3
    assert y32.dtype == torch.float32 and _rel(y32.double(), want) < 1e-6
    count = k.workspace("fp8_block_linear-arrivals", x.device, 4 * k.MAX_SERIAL_TILES, zero=True)
    assert count.numel() == 4 * k.MAX_SERIAL_TILES and not count.any()
    assert torch.equal(again, y)
    if len(x_shape) == 2 and len(w_shape) == 2:  # the custom op around it: fake, AOT dispatch, compiled
        op = torch.ops.mla.fp8_block_linear_serial_triton
        with poisoned_empty():
            torch.library.opcheck(op, (x, codes, scale, False, split), test_utils=OPCHECK_UTILS)
            torch._dynamo.reset()
            compiled = torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")
            assert torch.equal(compiled(x, codes, scale, False, split), y)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("M,N1,N2,K,split", [(3, 100, 70, 2100, None), (1, 256, 128, 2048, None),
                                             (2, 70, 200, 700, 3), (20, 130, 40, 300, None)])
def test_interpreter_pair_matches_float64(M, N1, N2, K, split):
    """Two weights in one launch (``pair``): each output against float64, both with K split and summed in the
    kernel (few rows) and whole (20 rows), ragged column tiles at the seam between the weights, NaN-poisoned
    allocations; the custom op around it (fake, AOT dispatch)."""
    from mla_compile.ops.triton import fp8_block_linear as k

    c1, s1 = _weights(N1, K)
    c2, s2 = _weights(N2, K, seed=1)
    x = torch.randn(M, K).bfloat16()
    with poisoned_empty():
        y = k._launch(x, c1, s1, False, split=split, serial=True, pair=(c2, s2))
        y32 = k._launch(x.float(), c1, s1, True, split=split, serial=True, pair=(c2, s2))
    assert y.shape == (M, N1 + N2) and y.dtype == torch.bfloat16
    assert _rel(y[:, :N1].double(), _ref64(x.float(), c1, s1, False)) < 8e-3
    assert _rel(y[:, N1:].double(), _ref64(x.float(), c2, s2, False)) < 8e-3
    assert _rel(y32[:, N1:].double(), _ref64(x.float(), c2, s2, True)) < 1e-6
    if M == 20:
        with poisoned_empty():
            torch.library.opcheck(torch.ops.mla.fp8_block_linear_pair_triton, (x, c1, s1, c2, s2, False),
                                  test_utils=OPCHECK_UTILS)


def test_split_k_choice():
    from mla_compile.ops.triton.fp8_block_linear import _config, split_k

    assert split_k(48, 56) == 11  # V3's q_a at M=1: 48 column tiles of 32 -> 528 programs
    assert split_k(32, 32) == 8 and split_k(16, 32) == 8  # V4's q_a, kv: at most KB / 4 slices (four K steps each)
    assert split_k(128, 16) == 4 and split_k(256, 32) == 3  # V4's shared down (4 steps a slice), grouped o_a
    assert split_k(384, 56) == 1 and split_k(264, 56) == 1  # enough tiles already
    assert split_k(2, 15) == 1 and split_k(256, 8) == 1  # K too short to split (V4's indexer q_b)
    for tiles in range(1, 300):
        for kb in range(1, 130):
            s = split_k(tiles, kb)
            assert 1 <= s and (s == 1 or 4 * s <= kb)
    # 32-column tiles for few rows over at most 8192 output columns, 64 above and for more rows
    assert _config(1, False, 1024)["BLOCK_N"] == 32 and _config(16, False, 8 * 1024)["BLOCK_N"] == 32
    assert _config(1, False, 32768)["BLOCK_N"] == 64 and _config(17, False, 1024)["BLOCK_N"] == 64
    assert _config(64, False)["BLOCK_N"] == 64 and _config(1, True, 32768)["BLOCK_N"] == 32


def test_split_counts_every_row_tile_at_run_time_and_guards_no_new_band():
    """A run-time launch (an int M) splits K while all its programs (row tiles x column tiles) stay too few to fill
    the GPU (over 16 rows: at most 64 programs), so 64 rows over V4's q_a split as 1 row does and 4096 rows do not;
    traced with a symbolic M it splits for one row tile only, and the only guard it leaves on M is the ``M <= 16``
    band ``_config`` takes anyway."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mla_compile.ops.triton.fp8_block_linear import _split

    assert _split(1, 1, 32, 4096, None) == (8, 4) == _split(64, 1, 32, 4096, None)  # q_a: 32 tiles, 32 K steps
    assert _split(128, 2, 32, 4096, None) == (8, 4) and _split(4096, 64, 16, 4096, None) == (1, 32)
    assert _split(64, 1, 64, 8192, None) == (8, 8) and _split(128, 2, 64, 8192, None) == (1, 64)  # o_b: 64 programs
    assert _split(1, 1, 256, 4096, None) == (3, 11) and _split(64, 1, 128, 4096, None) == (1, 32)  # grouped o_a
    assert _split(64, 1, 512, 1024, None) == (1, 8) and _split(64, 1, 16, 4096, 3) == (3, 11)  # q_b; given
    for hint, m_tiles_of, want in ((64, lambda m: -(-m // 64), 1), (8, lambda m: 1, 8)):
        env = ShapeEnv()
        M = env.create_symintnode(env.create_symbol(hint, ConstantSource("M")), hint=hint)
        assert _split(M, m_tiles_of(M), 32, 4096, None)[0] == want
        assert [str(g.expr) for g in env.guards] == [f"{M.node.expr} {'>' if hint > 16 else '<='} 16"]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("offs", OFFS)
def test_interpreter_sorted_groups_match_reference(offs, act_quant, dtype):
    from mla_compile.ops.triton.fp8_block_linear import _launch_sorted

    codes, scale = _weights(4, 70, 150)
    x = torch.randn(23, 150).to(dtype)
    offs = torch.tensor(offs, dtype=torch.int32)
    y = _launch_sorted(x, codes, scale, act_quant, offs)
    ref = torch.ops.mla.fp8_block_linear_ref(x, codes, scale, act_quant, offs)
    assert (y[int(offs[-1]):] == 0).all()
    assert float((y.double() - ref.double()).norm()) <= (1e-6 if dtype == torch.float32 else 8e-3) * float(
        ref.double().norm()) + 1e-12


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("act_quant", [False, True])
def test_triton_sorted_groups_on_gpu(act_quant):
    codes, scale = _weights(8, 2048, 7168)
    x = torch.randn(300, 7168).bfloat16()
    offs = torch.tensor([10, 10, 90, 150, 151, 200, 290, 290], dtype=torch.int32)
    want = _sorted64(x.float(), codes, scale, offs, act_quant)
    y = ops.fp8_block_linear(x.cuda(), codes.cuda(), scale.cuda(), act_quant=act_quant, offs=offs.cuda(),
                             backend="triton")
    assert _rel(y.cpu(), want) < 4e-3 and (y[290:] == 0).all()


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("x_shape,w_shape", CASES + [((64, 7168), (2048, 7168)), ((1, 7168), (576, 7168))])
def test_triton_on_gpu_matches_float64(x_shape, w_shape, act_quant):
    codes, scale = _weights(*w_shape)
    x = torch.randn(*x_shape).bfloat16()
    want = _ref64(x.float(), codes, scale, act_quant)
    y = ops.fp8_block_linear(x.cuda(), codes.cuda(), scale.cuda(), act_quant=act_quant, backend="triton")
    assert _rel(y.cpu(), want) < 4e-3
    y32 = ops.fp8_block_linear(x.float().cuda(), codes.cuda(), scale.cuda(), act_quant=act_quant, backend="triton")
    assert _rel(y32.cpu(), want) < 1e-5
    fn = torch.compile(lambda a: ops.fp8_block_linear(a, codes.cuda(), scale.cuda(), act_quant=act_quant,
                                                      backend="triton"), fullgraph=True)
    assert _rel(fn(x.cuda()).cpu(), want) < 4e-3


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("x_shape,w_shape", [((1, 4096), (1024, 4096)), ((4, 2048), (4096, 2048)),
                                             ((16, 4096), (3, 256, 4096)), ((1, 2100), (130, 2100)),
                                             ((64, 4096), (1024, 4096)), ((40, 4096), (3, 256, 4096))])
def test_serial_split_on_gpu(x_shape, w_shape, act_quant):
    """Launches too small to fill the GPU (1 to 64 rows) split K in the serial op (one launch, the slices summed by
    each tile's last program): against float64 eager, under opcheck, compiled (Inductor) and replayed in a CUDA graph
    on new inputs; equal to the two-kernel split within float32 rounding; the arrival counters back at 0."""
    from mla_compile.ops.triton import fp8_block_linear as k

    codes, scale = (t.cuda() for t in _weights(*w_shape))
    x = torch.randn(*x_shape).bfloat16().cuda()
    split = k.serial_split(x, codes)
    assert split > 1
    want = _ref64(x.float().cpu(), codes.cpu(), scale.cpu(), act_quant)
    y = ops.fp8_block_linear(x, codes, scale, act_quant=act_quant, backend="triton")
    assert _rel(y.cpu(), want) < 4e-3
    two = k._launch(x.float(), codes, scale, act_quant, split=split)
    one = torch.ops.mla.fp8_block_linear_serial_triton(x.float(), codes, scale, act_quant, split)
    assert _rel(one.cpu(), two.double().cpu()) < 1e-6
    torch.library.opcheck(torch.ops.mla.fp8_block_linear_serial_triton, (x, codes, scale, act_quant, split),
                          test_utils=OPCHECK_UTILS)
    fn = torch.compile(lambda a: ops.fp8_block_linear(a, codes, scale, act_quant=act_quant, backend="triton"),
                       fullgraph=True)
    assert _rel(fn(x).cpu(), want) < 4e-3
    static = x.clone()
    fn(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    x2 = torch.randn(*x_shape).bfloat16().cuda()
    static.copy_(x2)
    out.fill_(float("nan"))
    graph.replay()
    assert _rel(out.cpu(), _ref64(x2.float().cpu(), codes.cpu(), scale.cpu(), act_quant)) < 4e-3
    count = k.workspace("fp8_block_linear-arrivals", x.device, 4 * k.MAX_SERIAL_TILES, zero=True)
    torch.cuda.synchronize()
    assert not count.any()


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("M,N1,N2,K", [(1, 1024, 512, 4096), (4, 2048, 2048, 4096), (16, 200, 70, 2100),
                                       (64, 1024, 512, 4096)])
def test_pair_on_gpu(M, N1, N2, K, act_quant):
    """``mla::fp8_block_linear_pair``'s Triton backend (V4-Flash's q_a + kv and the shared expert's gate + up at
    few tokens, ragged tiles, 64 rows unsplit) against float64, eager, compiled and replayed in a CUDA graph on new
    inputs, outputs NaN-poisoned before the replay."""
    c1, s1 = (t.cuda() for t in _weights(N1, K))
    c2, s2 = (t.cuda() for t in _weights(N2, K, seed=1))

    def want(x):
        return (_ref64(x.float().cpu(), c1.cpu(), s1.cpu(), act_quant),
                _ref64(x.float().cpu(), c2.cpu(), s2.cpu(), act_quant))

    x = torch.randn(M, K).bfloat16().cuda()
    for got, ref in zip(ops.fp8_block_linear_pair(x, (c1, s1), (c2, s2), act_quant=act_quant, backend="triton"),
                        want(x)):
        assert _rel(got.cpu(), ref) < 4e-3
    torch.library.opcheck(torch.ops.mla.fp8_block_linear_pair_triton, (x, c1, s1, c2, s2, act_quant),
                          test_utils=OPCHECK_UTILS)
    fn = torch.compile(lambda a: ops.fp8_block_linear_pair(a, (c1, s1), (c2, s2), act_quant=act_quant,
                                                           backend="triton"), fullgraph=True)
    static = x.clone()
    fn(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(static)
    x2 = torch.randn(M, K).bfloat16().cuda()
    static.copy_(x2)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    for got, ref in zip(outs, want(x2)):
        assert _rel(got.cpu(), ref) < 4e-3


@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K", [(1, 256, 512), (64, 2048, 7168), (33, 576, 7168), (16, 576, 512), (2, 384, 1024)])
def test_scaled_mm_on_gpu_matches_float64(M, N, K):
    codes, scale = _weights(N, K)
    x = torch.randn(M, K).bfloat16()
    want = _ref64(x.float(), codes, scale, True)
    y = ops.fp8_block_linear(x.cuda(), codes.cuda(), scale.cuda(), act_quant=True, backend="scaled-mm")
    # cuBLAS's blockwise fp8 path is less exact than our kernel's fp32 accumulation (BENCHMARKS run 108), but
    # a wrong scale layout or a bad row pad is off by far more than this
    assert _rel(y.cpu(), want) < 1e-2
