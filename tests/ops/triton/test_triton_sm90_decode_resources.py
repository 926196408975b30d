"""The dense decode kernel's default configs, compiled for sm_90 on the CPU (Triton's front end and bundled
ptxas, no GPU): no register spills, shared memory within an H200's 227 KB, and the pipelining that
``_pick`` relies on: two KV buffers for the 16-row mma.sync kernel (5 stages; at 3 it had one, so a
tile's load never overlapped the previous tile's math) and, for the 64-row wgmma kernel, a
block table in shared memory (cp.async) instead of a synchronous load in the loop (3 stages, not 2).
Skipped without Triton or under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import tempfile

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs triton, not the interpreter")

_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}
_OPTIONS = ("num_warps", "num_stages")
_SMEM_LIMIT = 232448  # sm_90 opt-in shared memory per block
_ROW = 576 * 2  # one bf16 cache row [latent 512 | k_pe 64]


def _split_launch(H: int, L: int):
    import mla_compile  # noqa: F401
    from mla_compile.ops.triton import decode

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((self.kernel, a, k))

    saved_wrap, saved_sms = decode.wrap_triton, decode.num_sms
    decode.wrap_triton, decode.num_sms = Recorder, (lambda device: 132)
    try:
        B, bf = 128, torch.bfloat16
        decode._launch(torch.zeros(B, 1, H, 576, dtype=bf), torch.zeros(8, 64, 576, dtype=bf),
                       torch.zeros(B, L // 64, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
                       1 / math.sqrt(192), 512)
    finally:
        decode.wrap_triton, decode.num_sms = saved_wrap, saved_sms
    return next(la for la in launches if la[0].__name__ == "_decode_split_kernel")


def _compile(kernel, args, kwargs):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bound = dict(zip(kernel.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32"
            if v % 16 == 0 and v != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32"
    opts = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    return triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def _stack_bytes(compiled) -> int:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in the Triton wheel")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", res).group(1))


@pytest.mark.parametrize("H, L, block_h", [(16, 8192, 16), (128, 4096, 64)])
def test_decode_default_config_pipelines_kv(H, L, block_h):
    kernel, args, kwargs = _split_launch(H, L)
    compiled = _compile(kernel, args, kwargs)
    smem = compiled.metadata.shared
    q_bytes, tile = block_h * _ROW, kwargs["BLOCK_N"] * _ROW
    assert _stack_bytes(compiled) == 0, "register spills"
    assert smem <= _SMEM_LIMIT
    assert smem >= q_bytes + 2 * tile, f"fewer than two KV buffers: {smem} B of shared memory"
    if block_h == 64:
        assert smem > q_bytes + 2 * tile, "block table not staged in shared memory (synchronous load in the loop)"
