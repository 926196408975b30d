"""The ``mla::hc_sinkhorn`` kernel compiled for sm_90 on the CPU (Triton's front end and bundled ptxas, no GPU): at
V4's 4 streams a token's matrix is one thread's (no shared memory: no cross-warp sums in the rounds), no matrix
width it takes spills, and with ``eps`` typed fp64 (as Inductor's launches of user kernels type Python floats) the
rounds still run in fp32. Marked ``sm90_compile``."""

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
