"""The few-token kernels (``mla::moe_gate_route``'s fused router + routing, ``mla::skinny_absorb_q`` / ``_out``'s
per-head GEMVs) and the adapters' boundary kernels (``ops/triton/finish.py``) compiled for sm_90 on the CPU (Triton's
front end and bundled ptxas, no GPU) at DeepSeek-V2-Lite and V3 dims: they compile, and where cuobjdump is bundled,
without register spills.
Marked ``sm90_compile``: skipped without Triton or under ``TRITON_INTERPRET=1`` (run by
test_sm90_compile_subprocess.py in CI)."""

from __future__ import annotations

import pytest
import torch
from _triton_test_util import SM90_COMPILE, assert_pdl_order

pytestmark = SM90_COMPILE


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _no_spills(launches):
    from mla_compile.ops.triton import _sm90

    for kernel, _, args, kwargs in launches:
        compiled = _sm90.compile_sm90(kernel, args, kwargs)
        if _sm90.cuobjdump() is not None:
            assert _sm90.resources(compiled)["stack"] == 0, f"register spills in {kernel.fn.__name__}"


# (E, H, top_k, num_group, topk_group, scoring, bias, renormalize, scaling): V2-Lite's gate, V3's routing at 2048,
# V4-Flash's (sqrt(softplus) scores, hidden 4096)
ROUTINGS = [(64, 2048, 6, 1, 1, "softmax", False, False, 1.0), (256, 2048, 8, 8, 4, "sigmoid", True, True, 2.5),
            (256, 4096, 6, 1, 1, "sqrtsoftplus", True, True, 1.5)]


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("E,H,k,G,TG,scoring,bias,renorm,scaling", ROUTINGS)
def test_moe_gate_route_kernel_compiles_for_sm90(T, E, H, k, G, TG, scoring, bias, renorm, scaling):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, moe_gate_route

    launches = _sm90.record(moe_gate_route, moe_gate_route._launch, _meta(T, H), _meta(E, H),
                            _meta(E, dtype=torch.float32) if bias else None, k, G, TG, scoring, renorm, scaling,
                            pdl=True)
    assert len(launches) == 1 and launches[0][3]["PDL"]  # as an sm_90 device launches it
    _no_spills(launches)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("H", [16, 128])
def test_skinny_absorb_kernels_compile_for_sm90(T, H):
    """The kv_b_proj views' strides (nope 128, v 128, latent 512, rope 64)."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, skinny_absorb

    N = V = 128
    w = _meta(H * (N + V), 512).view(H, N + V, 512)
    launches = _sm90.record(skinny_absorb, skinny_absorb.launch_q, _meta(T, H, N), w[:, :N], _meta(T, H, 64), pdl=True)
    launches += _sm90.record(skinny_absorb, skinny_absorb.launch_out, _meta(T, H, 512), w[:, N:], pdl=True)
    assert len(launches) == 2 and all(launch[3]["PDL"] for launch in launches)  # as an sm_90 device launches them
    _no_spills(launches)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("which", ["decode", "prefill"])
def test_adapter_boundary_kernels_compile_for_sm90_with_pdl(which, pdl):
    """The FlashMLA / FlashInfer boundary kernels at V3's 128 heads: on an sm_90 device they are launched with PDL
    and wait for the library's kernel before any global read; without PDL neither instruction is there."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, finish

    if which == "decode":
        launches = _sm90.record(finish, finish.finish_decode_triton, _meta(4, 2, 128, 512),
                                _meta(4, 128, 2, dtype=torch.float32).transpose(1, 2),
                                _meta(4, dtype=torch.int32), 0.69, pdl=pdl)
    else:
        launches = _sm90.record(finish, finish.finish_prefill_triton, _meta(40, 128, 128),
                                _meta(40, 128, dtype=torch.float32), _meta(3, dtype=torch.int32),
                                _meta(3, dtype=torch.int32), True, 1.0, pdl=pdl)
    assert len(launches) == 1
    _no_spills(launches)
    kernel, _, args, kwargs = launches[0]
    assert kwargs["PDL"] is pdl and kwargs.get("launch_pdl", False) is pdl
    assert_pdl_order(_sm90.compile_sm90(kernel, args, kwargs).asm["ptx"], pdl, kernel.fn.__name__)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("M,K,Ns", [(1, 2048, (3072, 576)), (2, 7168, (1536, 576))])
def test_skinny_norm_linear_kernel_compiles_for_sm90(M, K, Ns, residual):
    """``mla::skinny_norm_linear``'s kernel at V2-Lite's and V3's input norm + first projections: no spills, the
    weight loads streamed through cp.async, and under PDL the wait before the trigger (the first weight tile and the
    norm's weight, which no kernel of a step writes, are requested before the wait, as ``mla::skinny_linear``'s)."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, skinny_norm_linear

    launches = _sm90.record(skinny_norm_linear, skinny_norm_linear._launch, _meta(M, K),
                            _meta(M, K) if residual else None, _meta(K), 1e-6, [_meta(n, K) for n in Ns], pdl=True)
    assert len(launches) == 1
    _no_spills(launches)
    kernel, _, args, kwargs = launches[0]
    ptx = _sm90.compile_sm90(kernel, args, kwargs).asm["ptx"]
    assert "cp.async" in ptx and kwargs["PDL"] and kwargs["launch_pdl"]
    assert -1 < ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("K", [2048, 7168])
def test_skinny_norm_linear_many_rows_kernel_compiles_for_sm90(K, residual):
    """Its add + norm kernel for more rows than the GEMV serves: no spills, and under PDL the wait before any global
    read (x and the residual may be the kernel before's outputs)."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, skinny_norm_linear

    launches = _sm90.record(skinny_norm_linear, skinny_norm_linear._many_rows, _meta(8, K),
                            _meta(8, K) if residual else None, _meta(K), 1e-6, [_meta(576, K)], pdl=True)
    assert len(launches) == 1 and launches[0][0].fn.__name__ == "_add_norm_kernel"
    _no_spills(launches)
    kernel, _, args, kwargs = launches[0]
    assert_pdl_order(_sm90.compile_sm90(kernel, args, kwargs).asm["ptx"], True, kernel.fn.__name__)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("E,H,k,G,TG,scoring,bias,renorm,scaling", [ROUTINGS[0], (256, 7168, *ROUTINGS[1][2:])])
def test_moe_norm_gate_route_kernel_compiles_for_sm90(T, E, H, k, G, TG, scoring, bias, renorm, scaling):
    """``mla::moe_norm_gate_route``'s launch (the gate route kernel with ``NORM``) at V2-Lite's gate and V3's: no
    spills, and under PDL the wait before the trigger (the gate's first tile and the norm's weight are requested
    before it; x and the residual, the kernels before's outputs, after)."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, moe_gate_route

    launches = _sm90.record(moe_gate_route, moe_gate_route._launch_norm, _meta(T, H), _meta(T, H), _meta(H), 1e-6,
                            _meta(E, H), _meta(E, dtype=torch.float32) if bias else None, k, G, TG, scoring, renorm,
                            scaling, pdl=True)
    assert len(launches) == 1 and launches[0][3]["PDL"] and launches[0][3]["NORM"]
    _no_spills(launches)
    kernel, _, args, kwargs = launches[0]
    ptx = _sm90.compile_sm90(kernel, args, kwargs).asm["ptx"]
    assert -1 < ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T,H", [(1, 16), (2, 16), (2, 128)])
def test_write_absorb_q_kernel_compiles_for_sm90(T, H, fp8):
    """``mla::write_latent_cache_absorb_q``'s one launch (the absorb programs rotating q_pe, the fused write's rows,
    a float or fp8 cache) at V2-Lite's and V3's widths: no spills; under PDL the wait before the trigger."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, write_absorb_q

    w = _meta(H * 256, 512).view(H, 256, 512)
    q = _meta(T, H, 192)
    cache = _meta(64, 64, 656, dtype=torch.uint8) if fp8 else _meta(64, 64, 576)
    kv = _meta(T, 576)
    launches = _sm90.record(write_absorb_q, write_absorb_q.launch, kv[:, :512], kv[:, 512:], _meta(512),
                            _meta(T, 32, dtype=torch.float32), _meta(T, 32, dtype=torch.float32),
                            _meta(T, dtype=torch.int64), cache, 1e-6, True, q[..., :128], w[:, :128], q[..., 128:],
                            pdl=True)
    assert len(launches) == 1 and launches[0][3]["PDL"] and launches[0][3]["FP8"] == fp8
    _no_spills(launches)
    kernel, _, args, kwargs = launches[0]
    ptx = _sm90.compile_sm90(kernel, args, kwargs).asm["ptx"]
    assert -1 < ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K,E", [(1, 1024, 4096, 0), (1, 4096, 2048, 0), (4, 1024, 4096, 8),
                                     (64, 1024, 4096, 0)])
def test_fp8_linear_serial_split_compiles_for_sm90(M, N, K, E, dtype, pdl, monkeypatch):
    """``mla::fp8_block_linear_serial_triton``'s launch at DeepSeek-V4-Flash projection shapes (q_a at 1 and 64
    rows, the shared expert's down, the grouped o_a): it splits K (64 rows: one or two row tiles of each slice), compiles with the arrival count (an acquire-release atomic add,
    the counter's reset) and the slices' volatile loads, without spills; with PDL on (as an sm_90 device launches)
    the launches of at most ``PDL_MAX_BYTES`` of codes wait before any global read, the 32 MB o_a has no PDL."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _pdl, _sm90, fp8_block_linear

    launches: list = []
    real = fp8_block_linear._fp8_linear_kernel
    monkeypatch.setattr(fp8_block_linear, "_fp8_linear_kernel", _sm90.recorder(launches)(real))
    monkeypatch.setattr(fp8_block_linear, "launch_kwargs", lambda *a, **k: dict(_pdl.ON if pdl else _pdl.OFF))
    lead = (E,) if E else ()
    fp8_block_linear._launch(torch.zeros(M, K, dtype=dtype), torch.zeros(*lead, N, K, dtype=torch.float8_e4m3fn),
                             torch.ones(*lead, N // 128, K // 128), False, serial=True)
    (_, grid, args, kwargs), = launches
    assert kwargs["SERIAL"] and kwargs["SPLIT_K"] > 1 and grid[0] == -(-M // kwargs["BLOCK_M"]) * kwargs["SPLIT_K"]
    compiled = _sm90.compile_sm90(real, args, kwargs)
    ptx = compiled.asm["ptx"]
    assert ptx.count("atom.") >= 2 and "ld.volatile" in ptx
    assert_pdl_order(ptx, pdl and max(E, 1) * N * K <= fp8_block_linear.PDL_MAX_BYTES, "_fp8_linear_kernel")
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"


@pytest.mark.parametrize("M,N1,N2", [(1, 1024, 512), (4, 2048, 2048), (64, 1024, 512)])
def test_fp8_linear_pair_compiles_for_sm90(M, N1, N2, monkeypatch):
    """``mla::fp8_block_linear_pair_triton``'s launch (V4-Flash's q_a + kv, the shared expert's gate + up; 64 rows
    split too): the kernel with the second weight's tiles compiles for sm_90 without spills, the pair's column tiles
    in one grid."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, fp8_block_linear

    launches: list = []
    real = fp8_block_linear._fp8_linear_kernel
    monkeypatch.setattr(fp8_block_linear, "_fp8_linear_kernel", _sm90.recorder(launches)(real))
    monkeypatch.setattr(fp8_block_linear, "wrap_triton", _sm90.recorder(launches))
    K = 4096
    w = lambda n: torch.zeros(n, K, dtype=torch.float8_e4m3fn)  # noqa: E731
    s = lambda n: torch.ones(n // 128, K // 128)  # noqa: E731
    fp8_block_linear._launch(torch.zeros(M, K, dtype=torch.bfloat16), w(N1), s(N1), False, serial=True,
                             pair=(w(N2), s(N2)))
    (_, grid, args, kwargs), = launches
    assert kwargs["PAIR"] and grid[1] == -(-N1 // kwargs["BLOCK_N"]) + -(-N2 // kwargs["BLOCK_N"])
    compiled = _sm90.compile_sm90(real, args, kwargs)
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"
