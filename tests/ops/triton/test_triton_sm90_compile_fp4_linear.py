"""The fp4 block-linear kernels compiled for sm_90 on the CPU (Triton's front end and bundled ptxas, no GPU) at
DeepSeek-V4-Flash expert shapes (hidden 4096, expert intermediate 2048), bf16 and fp32, dense and sorted
groups: they compile, and where cuobjdump is bundled, without register spills. Marked ``sm90_compile``."""

from __future__ import annotations

import pytest
import torch
from _triton_test_util import SM90_COMPILE, assert_fp32_under_fp64_floats

pytestmark = SM90_COMPILE


@pytest.mark.parametrize("words", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K,E", [(1, 2048, 4096, 0), (64, 4096, 2048, 0), (16, 2048, 4096, 8)])
def test_fp4_linear_compiles_for_sm90(M, N, K, E, dtype, words, monkeypatch):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, fp4_block_linear

    monkeypatch.setattr(fp4_block_linear, "TILED_WORDS", words)  # the tiled kernels' decode (M > 4)

    lead = (E,) if E else ()
    launches = _sm90.record(fp4_block_linear, fp4_block_linear._launch, torch.zeros(M, K, dtype=dtype),
                            torch.zeros(*lead, N, K // 2, dtype=torch.uint8),
                            torch.zeros(*lead, N, K // 32, dtype=torch.uint8))
    assert len(launches) == 1
    kernel, _, args, kwargs = launches[0]
    kwargs = {**kwargs, "F32": False} if "F32" in kwargs else kwargs  # as on a GPU (CPU tensors: the interpreter's)
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    assert compiled.metadata.shared <= 232448
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"


@pytest.mark.parametrize("words", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_sorted_groups_compile_for_sm90(dtype, words, monkeypatch):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, fp4_block_linear

    monkeypatch.setattr(fp4_block_linear, "TILED_WORDS", words)

    E, N, K = 8, 4096, 2048
    offs = torch.arange(1, E + 1, dtype=torch.int32) * 16
    launches = _sm90.record(fp4_block_linear, fp4_block_linear._launch_sorted, torch.zeros(128, K, dtype=dtype),
                            torch.zeros(E, N, K // 2, dtype=torch.uint8),
                            torch.zeros(E, N, K // 32, dtype=torch.uint8), offs)
    kernel, _, args, kwargs = launches[0]
    kwargs = {**kwargs, "F32": False}
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 64])
def test_fp4_experts_kernels_compile_for_sm90(T, dtype):
    """``mla::moe_experts_fp4``'s two kernels at V4-Flash dims (hidden 4096, expert width 2048, top-6) on an
    H200's 132 SMs (the tile width follows the program count): they compile without spills."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, moe_experts_fp4

    H, I, E, k = 4096, 2048, 8, 6
    b = lambda *s: torch.zeros(*s, dtype=torch.uint8)  # noqa: E731
    launches = _sm90.record(moe_experts_fp4, moe_experts_fp4._launch, torch.zeros(T, H, dtype=dtype),
                            torch.rand(T, k), torch.zeros(T, k, dtype=torch.int32), b(E, I, H // 2), b(E, I, H // 32),
                            b(E, I, H // 2), b(E, I, H // 32), b(E, H, I // 2), b(E, H, I // 32), True, 10.0, sms=132)
    assert len(launches) == 2
    for kernel, _, args, kwargs in launches:
        compiled = _sm90.compile_sm90(kernel, args, kwargs)
        if _sm90.cuobjdump() is not None:
            assert _sm90.resources(compiled)["stack"] == 0, "register spills"
    assert_fp32_under_fp64_floats(*[launches[0][i] for i in (0, 2, 3)])  # the clamp's limit


# (rows a warp, gate-up warps, down warps): every entry of the kernels' per-token-count table among them
MMA_CONFIGS = [(16, 4, 4), (32, 4, 4), (16, 8, 8), (16, 4, 8), (32, 2, 2), (16, 2, 2)]


@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("rows,gate_up_warps,down_warps", MMA_CONFIGS)
def test_fp4_experts_mma_kernels_compile_for_sm90(T, rows, gate_up_warps, down_warps, monkeypatch):
    """The Gluon ``mma`` kernels of ``mla::moe_experts_fp4`` (backend "gluon") at V4-Flash dims, per (token, pick) at
    one token and over rows sorted by expert at 64, at each launch configuration the launcher may take: they compile
    (their ``convert_layout(..., assert_trivial=True)`` fails the compile if the decoded weights or x's permuted
    columns would need a data exchange to become the dot's operands), and where cuobjdump is bundled, their hot loop
    runs ``mma.sync`` on operands that never leave registers: no spills, no shared-memory traffic."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, moe_experts_fp4_mma as m

    assert all(tuple(c) in MMA_CONFIGS for _, *c in m.CONFIG["per_pick"]) and m.CONFIG["sorted"] in MMA_CONFIGS
    monkeypatch.setitem(m.CONFIG, "rows", rows)
    monkeypatch.setitem(m.CONFIG, "gate_up_warps", gate_up_warps)
    monkeypatch.setitem(m.CONFIG, "down_warps", down_warps)
    monkeypatch.setitem(m.CONFIG, "per_pick", ())
    monkeypatch.setitem(m.CONFIG, "sorted", ())
    H, I, E, k = 4096, 2048, 8, 6
    b = lambda *s: torch.zeros(*s, dtype=torch.uint8)  # noqa: E731
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    assert m.eligible(x, I)
    kernels = ("_moe_fp4_mma_gate_up_kernel", "_moe_fp4_mma_down_kernel", "_moe_fp4_mma_sorted_gate_up_kernel",
               "_moe_fp4_mma_sorted_down_kernel")
    launches = _sm90.record(m, m.launch, x, torch.rand(T, k), torch.zeros(T, k, dtype=torch.int32), b(E, I, H // 2),
                            b(E, I, H // 32), b(E, I, H // 2), b(E, I, H // 32), b(E, H, I // 2), b(E, H, I // 32),
                            True, 10.0, gluon=kernels)
    grids = [(T * k, I // rows), (T, H // rows)] if T <= m.CONFIG["sorted_above"] else [(E, I // rows), (E, H // rows)]
    assert [launch[1] for launch in launches] == grids
    for kernel, _, args, kwargs in launches:
        compiled = _sm90.compile_sm90(kernel, args, kwargs)
        if _sm90.cuobjdump() is None:
            continue
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"
        (sass,) = _sm90._cuobjdump(compiled, "-sass")
        loop = max(_sm90.innermost_loops(sass), key=len)
        ops = {_sm90.opcode(t).split(".")[0] for t in loop}
        assert "HMMA" in ops and not ops & {"LDS", "STS", "LDL", "STL", "BAR"}, sorted(ops)
