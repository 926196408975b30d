"""The MoE kernels (``mla::moe_route``, the ``mla::moe_experts`` kernels, fused and grouped) and
``mla::skinny_linear``'s GEMV compiled for sm_90 on the CPU (Triton's front end and bundled ptxas, no GPU) at
DeepSeek-V2-Lite and V3 dims, with the launch shapes an H200 (132 SMs) gets: they compile, and where cuobjdump is
bundled, without register spills.
Marked ``sm90_compile``: skipped without Triton or under ``TRITON_INTERPRET=1`` (run by
test_sm90_compile_subprocess.py in CI)."""

from __future__ import annotations

import pytest
import torch
from _triton_test_util import SM90_COMPILE, assert_fp32_under_fp64_floats, assert_pdl_order

pytestmark = SM90_COMPILE

# (hidden, moe_intermediate, experts, top_k, shared experts)
DIMS = {"v2-lite": (2048, 1408, 64, 6, 2), "v3": (7168, 2048, 256, 8, 1)}


def _no_spills(launches):
    from mla_compile.ops.triton import _sm90

    for kernel, _, args, kwargs in launches:
        compiled = _sm90.compile_sm90(kernel, args, kwargs)
        if _sm90.cuobjdump() is not None:
            assert _sm90.resources(compiled)["stack"] == 0, f"register spills in {kernel.fn.__name__}"


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("name", list(DIMS))
def test_moe_experts_kernels_compile_for_sm90(name, T, masked, pdl):
    """With ``masked``, a token mask (the early exit of a padding token's programs); with ``pdl``, the launches an
    sm_90 device gets where the op runs eagerly: the PTX holds the waits and the triggers exactly then, and no
    global load comes before a wait (loading the down kernel's first weight tiles there was slower: BENCHMARKS.md
    run 175)."""
    _check_experts_kernels(name, T, masked, pdl)


@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("name", list(DIMS))
def test_moe_gate_up_pipe_form_compiles_for_sm90(name, T, monkeypatch):
    """Kernel 1's pipelined GEMV form (``CONFIG["gate_up_pipe"]``) under the same checks, masked and with PDL."""
    from mla_compile.ops.triton import moe_experts

    monkeypatch.setitem(moe_experts.CONFIG, "gate_up_pipe", True)
    launches = _check_experts_kernels(name, T, True, True)
    assert launches[0][0].fn.__name__ == "_moe_gate_up_pipe_kernel"


def _check_experts_kernels(name, T, masked, pdl):
    """The two kernels of ``moe_experts._launch`` at ``name``'s dims compile for sm_90 without spills, with PDL's
    wait and trigger exactly when ``pdl`` and no global load before the wait; returns the launches."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, moe_experts

    H, I, E, k, S = DIMS[name]

    def meta(*shape, dtype=torch.bfloat16):  # shapes and strides only: nothing is launched (V3's experts: 22 GB)
        return torch.empty(*shape, dtype=dtype, device="meta")

    args = (meta(T, H), meta(T, k, dtype=torch.float32), meta(T, k, dtype=torch.int32), meta(E, 2 * I, H),
            meta(E, H, I), meta(S * I, H), meta(S * I, H), meta(H, S * I), False,
            meta(T, dtype=torch.bool) if masked else None)
    launches = _sm90.record(moe_experts, moe_experts._launch, *args, sms=132, pdl=pdl)
    assert len(launches) == 2
    _no_spills(launches)
    for kernel, _, args, kwargs in launches:
        assert kwargs["PDL"] is pdl and kwargs.get("launch_pdl", False) is pdl
        assert_pdl_order(_sm90.compile_sm90(kernel, args, kwargs).asm["ptx"], pdl, kernel.fn.__name__)
    return launches


@pytest.mark.parametrize("E,k,G,TG,scoring,bias", [(64, 6, 1, 1, "softmax", False), (160, 6, 8, 3, "softmax", False),
                                                   (256, 8, 8, 4, "sigmoid", True)])
def test_moe_route_kernel_compiles_for_sm90(E, k, G, TG, scoring, bias):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, moe_route

    launches = _sm90.record(moe_route, moe_route._launch, torch.zeros(64, E), torch.zeros(E) if bias else None,
                            k, G, TG, scoring, scoring == "sigmoid", 2.5)
    assert len(launches) == 1
    _no_spills(launches)
    assert_fp32_under_fp64_floats(*(launches[0][i] for i in (0, 2, 3)))  # the scaling, as Inductor launches it


@pytest.mark.parametrize("limit", [None, 10.0])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("name", list(DIMS))
def test_moe_experts_fp8_kernels_compile_for_sm90(name, T, masked, limit):
    """The two ``mla::moe_experts_fp8`` kernels (e4m3 codes, float32 block scales), shared experts folded in;
    with ``masked``, a token mask; with ``limit``, V4's clamped SwiGLU, which stays fp32 with the limit typed fp64
    (Inductor's launch)."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, moe_experts_fp8

    H, I, E, k, S = DIMS[name]

    def meta(*shape, dtype=torch.float8_e4m3fn):
        return torch.empty(*shape, dtype=dtype, device="meta")

    def scales(rows, cols, *lead):
        return meta(*lead, -(-rows // 128), -(-cols // 128), dtype=torch.float32)

    routed = (meta(E, I, H), scales(I, H, E), meta(E, I, H), scales(I, H, E), meta(E, H, I), scales(H, I, E))
    shared = (meta(S * I, H), scales(S * I, H), meta(S * I, H), scales(S * I, H), meta(H, S * I), scales(H, S * I))
    launches = _sm90.record(moe_experts_fp8, moe_experts_fp8._launch, meta(T, H, dtype=torch.bfloat16),
                            meta(T, k, dtype=torch.float32), meta(T, k, dtype=torch.int32), *routed, *shared, False,
                            limit, meta(T, dtype=torch.bool) if masked else None, sms=132)
    assert len(launches) == 2
    _no_spills(launches)
    for kernel, _, args, kwargs in launches:
        assert_fp32_under_fp64_floats(kernel, args, kwargs)


@pytest.mark.parametrize("T,masked", [(64, False), (256, False), (256, True)])
@pytest.mark.parametrize("name", list(DIMS))
def test_moe_grouped_kernels_compile_for_sm90(name, T, masked):
    """The four kernels of the "triton-grouped" backend (align, gate_up, down, combine), shared experts as
    always-routed blocks, bf16 at the BLOCK_M the op picks for T, with and without a token mask: they compile
    without spills."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, moe_grouped

    H, I, E, k, S = DIMS[name]

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    launches = _sm90.record(moe_grouped, moe_grouped._launch, meta(T, H), meta(T, k, dtype=torch.float32),
                            meta(T, k, dtype=torch.int32), meta(E, 2 * I, H), meta(E, H, I), meta(S * I, H),
                            meta(S * I, H), meta(H, S * I), False, meta(T, dtype=torch.bool) if masked else None,
                            sms=132)
    assert [launch[0].fn.__name__ for launch in launches] == [
        "_moe_sort_kernel", "_moe_align_kernel", "_moe_grouped_gate_up_kernel", "_moe_grouped_down_kernel",
        "_moe_combine_kernel"]
    _no_spills(launches)


@pytest.mark.parametrize("M,K,Ns,form", [
    (2, 2048, (3072, 576), "_skinny_linear_pipe_kernel"), (8, 2048, (2048,), "_skinny_linear_kernel"),
    (1, 16384, (7168,), "_skinny_linear_pipe_kernel"), (16, 7168, (1536, 576), "_skinny_linear_pipe_kernel"),
    (2, 2048, (2048,), "_skinny_linear_kernel"), (2, 10944, (2048,), "_skinny_linear_pipe_kernel")])
def test_skinny_linear_kernel_compiles_for_sm90(M, K, Ns, form):
    """``mla::skinny_linear``'s GEMV at the decode step's projections (V2-Lite q_proj + kv_a, o_proj, the dense
    MLP's down; V3 o_proj, q_a + kv_a), each in the form its size takes, no register spills."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, skinny_linear

    meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")  # noqa: E731
    launches = _sm90.record(skinny_linear, skinny_linear._launch, meta(M, K), [meta(N, K) for N in Ns], pdl=True)
    assert len(launches) == 1 and launches[0][3]["PDL"]  # as an sm_90 device launches it
    assert launches[0][0].fn.__name__ == form
    _no_spills(launches)
