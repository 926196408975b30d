"""The fp4 block-linear kernels compiled for sm_90 on the CPU (Triton's front end and bundled ptxas, no GPU) at
DeepSeek-V4-Flash expert shapes (hidden 4096, expert intermediate 2048), bf16 and fp32, dense and sorted
groups: they compile, and where cuobjdump is bundled, without register spills. Marked ``sm90_compile``."""

from __future__ import annotations

import pytest
import torch
from _triton_test_util import SM90_COMPILE

pytestmark = SM90_COMPILE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,N,K,E", [(1, 2048, 4096, 0), (64, 4096, 2048, 0), (16, 2048, 4096, 8)])
def test_fp4_linear_compiles_for_sm90(M, N, K, E, dtype):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, fp4_block_linear

    lead = (E,) if E else ()
    launches = _sm90.record(fp4_block_linear, fp4_block_linear._launch, torch.zeros(M, K, dtype=dtype),
                            torch.zeros(*lead, N, K // 2, dtype=torch.uint8),
                            torch.zeros(*lead, N, K // 32, dtype=torch.uint8))
    assert len(launches) == 1
    kernel, _, args, kwargs = launches[0]
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    assert compiled.metadata.shared <= 232448
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_sorted_groups_compile_for_sm90(dtype):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, fp4_block_linear

    E, N, K = 8, 4096, 2048
    offs = torch.arange(1, E + 1, dtype=torch.int32) * 16
    launches = _sm90.record(fp4_block_linear, fp4_block_linear._launch_sorted, torch.zeros(128, K, dtype=dtype),
                            torch.zeros(E, N, K // 2, dtype=torch.uint8),
                            torch.zeros(E, N, K // 32, dtype=torch.uint8), offs)
    kernel, _, args, kwargs = launches[0]
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"
