"""The mHC kernels compiled for sm_90 on the CPU (Triton's front end and bundled ptxas, no GPU): ``mla::hc_sinkhorn``
at V4's 4 streams keeps a token's matrix in one thread (no shared memory: no cross-warp sums in the rounds), no
width it takes spills; ``mla::hc_pre``'s two kernels do not spill; with the Python floats
typed fp64 (as Inductor's launches of user kernels type them) every kernel still computes in fp32. Marked
``sm90_compile``."""

from __future__ import annotations

import pytest
import torch
from _triton_test_util import SM90_COMPILE, assert_fp32_under_fp64_floats

pytestmark = SM90_COMPILE


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_hc_sinkhorn_compiles_for_sm90(n):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, hc_sinkhorn

    launches = _sm90.record(hc_sinkhorn, hc_sinkhorn._launch, torch.zeros(100, n, n), 20, 1e-6)
    assert len(launches) == 1
    kernel, _, args, kwargs = launches[0]
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    assert_fp32_under_fp64_floats(kernel, args, kwargs)
    if n == 4:
        assert compiled.metadata.shared == 0, "the rounds' sums leave the thread"
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"


@pytest.mark.parametrize("T,n,D,dtype", [(1, 4, 4096, torch.bfloat16), (64, 4, 4096, torch.float32),
                                         (3, 8, 700, torch.bfloat16)])
def test_hc_pre_compiles_for_sm90(T, n, D, dtype):
    """``mla::hc_pre``'s two kernels at V4-Flash's 4 x 4096 streams and off it: no spills, fp32 under fp64 floats."""
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, hc_pre

    M = 2 * n + n * n
    launches = _sm90.record(hc_pre, hc_pre._launch, torch.zeros(T, n, D, dtype=dtype),
                            torch.zeros(M, n * D, dtype=dtype), torch.zeros(M), torch.zeros(3), 20, 1e-6, 1e-6)
    assert len(launches) == 2
    for kernel, _, args, kwargs in launches:
        compiled = _sm90.compile_sm90(kernel, args, kwargs)
        if _sm90.cuobjdump() is not None:
            assert _sm90.resources(compiled)["stack"] == 0, f"register spills in {kernel.fn.__name__}"
        assert_fp32_under_fp64_floats(kernel, args, kwargs)
