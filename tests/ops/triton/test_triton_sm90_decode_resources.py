"""The dense decode kernel's default configs, compiled for sm_90 on the CPU (Triton's front end and bundled
ptxas, no GPU): no register spills, shared memory within an H200's 227 KB, and the pipelining that
``_pick`` relies on: two KV buffers for the 16-row mma.sync kernel (5 stages; at 3 it had one, so a
tile's load never overlapped the previous tile's math), page tiles (one block-table entry per tile,
affine row addresses: about half the registers of the per-row gather) and, for the 64-row wgmma kernel,
no per-row block-table loads in the loop (the gather at 2 stages had 55 plain loads, a synchronous one
per tile). Marked ``sm90_compile``: skipped without Triton or under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import math

import pytest
import torch
from _triton_test_util import SM90_COMPILE

pytestmark = SM90_COMPILE

_SMEM_LIMIT = 232448  # sm_90 opt-in shared memory per block
_ROW = 576 * 2  # one bf16 cache row [latent 512 | k_pe 64]


def _split_launch(H: int, L: int):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import _sm90, decode

    B, bf = 128, torch.bfloat16
    launches = _sm90.record(decode, decode._launch, torch.zeros(B, 1, H, 576, dtype=bf),
                            torch.zeros(8, 64, 576, dtype=bf), torch.zeros(B, L // 64, dtype=torch.int32),
                            torch.zeros(B, dtype=torch.int32), 1 / math.sqrt(192), 512, sms=132)
    kernel, _, args, kwargs = next(la for la in launches if la[0].__name__ == "_decode_split_kernel")
    return kernel, args, kwargs


@pytest.mark.parametrize("H, L, block_h", [(16, 8192, 16), (128, 4096, 64)])
def test_decode_default_config_pipelines_kv(H, L, block_h):
    kernel, args, kwargs = _split_launch(H, L)
    from mla_compile.ops.triton import _sm90

    if _sm90.cuobjdump() is None:
        pytest.skip("no cuobjdump in the Triton wheel")
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    smem = compiled.metadata.shared
    q_bytes, tile = block_h * _ROW, kwargs["BLOCK_N"] * _ROW
    res = _sm90.resources(compiled)
    assert res["stack"] == 0, "register spills"
    assert smem <= _SMEM_LIMIT
    assert smem >= q_bytes + 2 * tile, f"fewer than two KV buffers: {smem} B of shared memory"
    assert kwargs["PAGE_TILES"], "the DeepSeek shapes (block size 64) take the page-tile loop"
    assert res["LDG"] <= 24, f"{res['LDG']} plain loads: per-row block-table loads in the loop?"
    if block_h == 16:
        assert res["regs"] <= 160, f"{res['regs']} registers (page tiles: ~127; the per-row gather: 218)"
