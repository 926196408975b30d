"""The fp8 block-linear kernel compiled for sm_90 on the CPU (Triton's front end and bundled ptxas, no GPU) at
DeepSeek-V3 shapes, weight-only and with the activation quantized, bf16 and fp32: it compiles, and where
cuobjdump is bundled, without register spills. Marked ``sm90_compile``: skipped without Triton or under
``TRITON_INTERPRET=1`` (run by test_sm90_compile_subprocess.py in CI)."""

from __future__ import annotations

import pytest
import torch
from _triton_test_util import SM90_COMPILE

pytestmark = SM90_COMPILE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("M,N,K,E", [(64, 2048, 7168, 0), (1, 576, 7168, 0), (32, 2048, 7168, 8)])
def test_fp8_linear_compiles_for_sm90(M, N, K, E, act_quant, dtype):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, fp8_block_linear

    w_shape = (E, N, K) if E else (N, K)
    s_shape = (*w_shape[:-2], -(-N // 128), -(-K // 128))
    launches = _sm90.record(fp8_block_linear, fp8_block_linear._launch, torch.zeros(M, K, dtype=dtype),
                            torch.zeros(w_shape, dtype=torch.float8_e4m3fn), torch.zeros(s_shape), act_quant)
    assert len(launches) == 1
    kernel, _, args, kwargs = launches[0]
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    assert compiled.metadata.shared <= 232448
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"


@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_sorted_groups_compile_for_sm90(act_quant):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, fp8_block_linear

    E, N, K = 8, 4096, 7168
    offs = torch.arange(1, E + 1, dtype=torch.int32) * 16
    x = torch.zeros(128, K, dtype=torch.bfloat16)
    launches = _sm90.record(fp8_block_linear, fp8_block_linear._launch_sorted, x,
                            torch.zeros(E, N, K, dtype=torch.float8_e4m3fn), torch.zeros(E, N // 128, K // 128),
                            act_quant, offs)
    kernel, _, args, kwargs = launches[0]
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    if _sm90.cuobjdump() is not None:
        assert _sm90.resources(compiled)["stack"] == 0, "register spills"
