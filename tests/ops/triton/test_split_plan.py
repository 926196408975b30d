"""The split-KV plan of the decode kernels: concrete launches split only below one wave of programs; a
symbolic batch (torch.compile, dynamic) gets one formula and installs no guard. The plan needs no Triton
(CI runs it); the kernels' ``_pick`` tests skip without Triton."""

from __future__ import annotations

import os

import pytest
import torch

from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from mla_compile.ops.triton._plan import MAX_SPLITS, opaque_splits, split_plan, wave_splits


def _kernels():
    pytest.importorskip("triton")
    from mla_compile.ops.triton import decode, sparse_decode

    return decode, sparse_decode


def _sym(env: ShapeEnv, hint: int):
    return env.create_symintnode(env.create_symbol(hint, ConstantSource(f"b{hint}")), hint=hint)


@pytest.mark.parametrize("programs, splits, direct", [(1, 64, False), (3, 88, False), (132, 1, True), (500, 1, True)])
def test_concrete_plan(programs, splits, direct):
    assert split_plan(programs, 132, 64) == (min(splits, 64), direct)
    assert split_plan(programs, 132, 300)[0] == (min(-(-264 // programs), 64) if programs < 132 else 1)  # MAX_SPLITS


@pytest.mark.parametrize("hint", [2, 3, 131, 132, 200, 300])
def test_symbolic_plan_adds_no_guard(hint):
    env = ShapeEnv()
    b = _sym(env, hint)
    splits, direct = split_plan(b, 132, 64)
    assert direct is False and not env.guards, env.guards
    assert int(splits.node.expr.xreplace({b.node.expr: hint})) == -(-264 // hint)
    assert not any(f in str(splits.node.expr) for f in ("Min", "Max")), splits  # nothing Inductor must decide


@pytest.mark.parametrize("hint", [2, 200])
def test_picks_add_no_guard_on_a_symbolic_batch(hint):
    decode, sparse_decode = _kernels()
    env = ShapeEnv()
    b = _sym(env, hint)
    cfg = decode._pick(16, b, 8192, 512, torch.device("cpu"), None)
    cfg_sparse = sparse_decode._pick(16, b, 2048, 512, torch.device("cpu"), None, False)
    assert cfg["DIRECT"] is False and cfg_sparse["DIRECT"] is False
    assert not env.guards, env.guards
    concrete = decode._pick(16, hint, 8192, 512, torch.device("cpu"), None)
    assert concrete["DIRECT"] == (hint >= 4)  # 4 SMs off CUDA (ops/triton/_common.py)


def test_user_splits_decide_direct():
    decode, _ = _kernels()
    assert decode._pick(16, 8, 8192, 512, torch.device("cpu"), {"SPLITS": 1})["DIRECT"] is True
    assert decode._pick(16, 8, 8192, 512, torch.device("cpu"), {"SPLITS": 3})["DIRECT"] is False


@pytest.mark.parametrize("programs, slots, cap, want", [
    (128, 264, 64, (2, False)),   # 2 programs per SM on 132 SMs: two splits fill one wave (three would need two)
    (128, 132, 64, (1, True)),    # one program per SM: 128 of 132 busy beats two waves of halves
    (140, 132, 64, (8, False)),   # just over a wave: 9 waves of eighths (1.27) beat 2 of wholes (2.03)
    (264, 264, 64, (1, True)),    # a full wave: no split
    (1, 264, 8, (8, False)),      # one sequence: as many splits as the cap allows
    (300, 264, 1, (1, True)),     # cap 1: never split
])
def test_wave_splits(programs, slots, cap, want):
    from mla_compile.ops.triton._plan import wave_splits

    assert wave_splits(programs, slots, cap) == want


def test_wave_splits_minimises_the_waves_per_split():
    from mla_compile.ops.triton._plan import wave_cost, wave_splits

    for programs in (1, 7, 100, 131, 133, 200, 400, 1000):
        splits, direct = wave_splits(programs, 132, 16)
        assert direct == (splits == 1) and 1 <= splits <= 16
        assert all(wave_cost(programs, 132, 16, splits) <= wave_cost(programs, 132, 16, s) for s in range(1, 17))
    assert wave_cost(128, 264, 64, 2) < wave_cost(128, 264, 64, 3)  # two waves of thirds lose to one of halves


_WORKSPACE_SCRIPT = """
import sys, torch
from torch.library import triton_op
from mla_compile.ops.triton._plan import split_buffers, split_plan

@triton_op("mla_plan_test::ws", mutates_args=())
def ws_op(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    B = q.shape[0]
    splits, direct = split_plan(B, 132, table.shape[1] * 64 // 256)
    ws, wl = split_buffers(q, q[:, 0], B * 16, splits, 8, direct)
    ws.fill_(1.0)
    wl.fill_(2.0)
    return ws.sum() + wl.sum() + q

fn = torch.compile(lambda q, t: torch.ops.mla_plan_test.ws(q, t), fullgraph=True, dynamic=True)
q, table = torch.randn(300, 8), torch.zeros(300, 24, dtype=torch.int32)
for i, b in enumerate((2, 64, 140, 270)):
    with torch._dynamo.config.patch(error_on_recompile=i > 0):
        got = fn(q[:b], table[:b])
    splits = -(-264 // b)  # the traced plan: one formula for every batch
    torch.testing.assert_close(got, q[:b] + b * 16 * splits * 8 + 2.0 * b * 16 * splits)
print("ONE GRAPH")
"""


def test_dynamic_batch_workspace_compiles_once_cold_and_warm(tmp_path):
    """The symbolic plan and its flat workspaces inside a ``triton_op`` body under torch.compile(dynamic=True):
    batches on both sides of one split (264 programs on 132 SMs) and of the cap reuse one graph, with a cold
    compile cache and again with the warm one. A 3-d workspace or a Min against the block table's width
    guarded the batch (``check_contiguous_sizes_strides``); the warm AOTAutograd cache enforced it (H200
    run 28: the recompile this test would catch)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    for run in ("cold", "warm"):
        res = subprocess.run([sys.executable, "-c", _WORKSPACE_SCRIPT], env=env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0 and "ONE GRAPH" in res.stdout, (run, res.stderr[-3000:])


def test_opaque_splits_takes_a_callers_count_or_fills_waves():
    """A caller's SPLITS is taken as is (direct when 1) and refused outside [1, MAX_SPLITS] with the bound named;
    otherwise the wave plan, capped at one split per 4 tiles of the table and at MAX_SPLITS."""
    assert opaque_splits({"SPLITS": 1}, 128, 264, 8192, 64) == (1, True)
    assert opaque_splits({"SPLITS": 5}, 128, 264, 8192, 64) == (5, False)
    for bad in (0, MAX_SPLITS + 1):
        with pytest.raises(ValueError, match=rf"config SPLITS must be in \[1, {MAX_SPLITS}\].*got {bad}"):
            opaque_splits({"SPLITS": bad}, 128, 264, 8192, 64)
    assert opaque_splits(None, 128, 264, 8192, 64) == wave_splits(128, 264, 32)
    assert opaque_splits({}, 3, 264, 64 * 4 * 1000, 64) == wave_splits(3, 264, MAX_SPLITS)
    assert opaque_splits(None, 1, 264, 100, 64) == (1, True)  # a table shorter than 4 tiles: one split


def test_opaque_splits_caps_per_kernel():
    """The cap follows the kernel's own ``SPLIT_TILES`` entry (the default's for a kernel without one): the bf16
    and 64-row fp8 Gluon decodes cut 2 tiles a split, the rest 4."""
    from mla_compile.ops.triton._plan import SPLIT_TILES

    assert SPLIT_TILES["default"] == 4 and SPLIT_TILES["decode_gluon"] == SPLIT_TILES["fp8_decode_gluon64"] == 2
    assert opaque_splits(None, 2, 264, 4096, 64, "decode_gluon") == wave_splits(2, 264, 32)
    assert opaque_splits(None, 2, 264, 4096, 64, "fp8_decode_gluon64") == wave_splits(2, 264, 32)
    assert opaque_splits(None, 2, 264, 4096, 64, "fp8_decode_wgmma") == wave_splits(2, 264, 16)
    assert opaque_splits(None, 2, 264, 4096, 64) == wave_splits(2, 264, 16)
    assert wave_splits(2, 264, 32) != wave_splits(2, 264, 16), "the two caps give different plans here"


def test_split_tiles_keys_name_the_launchers_that_pass_them():
    """Every kernel entry of ``SPLIT_TILES`` names a module of ``ops/triton`` whose launcher passes that very key
    to ``opaque_splits`` (a misspelt key would silently take the default)."""
    import inspect

    from mla_compile.ops import triton as triton_pkg
    from mla_compile.ops.triton._plan import SPLIT_TILES

    folder = os.path.dirname(inspect.getfile(triton_pkg))
    for key in set(SPLIT_TILES) - {"default"}:
        source = open(os.path.join(folder, f"{key}.py")).read()
        assert f'BLOCK_N, "{key}")' in source, key

