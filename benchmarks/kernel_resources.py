"""Compile the Triton kernels for sm_90 on a machine without a GPU and print their resource use.

Runs each op's ``_launch`` on small CPU tensors with ``wrap_triton`` replaced by a recorder, then
compiles every recorded launch (same constexprs, warps and stages as the shapes given) with
Triton's bundled ptxas for ``cuda:90`` and reads registers, spills (stack, LDL/STL), shared memory
the matrix instructions (HGMMA = wgmma, HMMA = mma.sync) and the global loads (LDGSTS = cp.async,
UTMALDG = TMA, LDG = synchronous loads into registers) off the cubin. No device time needed.

    python benchmarks/kernel_resources.py            # DeepSeek shapes, default configs
    python benchmarks/kernel_resources.py --time     # CUDA: time the decode candidates (A/B, same run)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile.ops.triton import cache_write, decode, gather, merge, prefill

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "i32", torch.int64: "i64"}
_OPTIONS = ("num_warps", "num_stages")


class _Recorder:
    launches: list = []

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            _Recorder.launches.append((self.kernel, grid, args, kwargs))
        return record


def _signature(kernel, args, kwargs):
    bound = dict(zip(kernel.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = bound[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # CUDA allocations are 256-byte aligned
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and v != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32"
    return sig, consts, attrs


def report(launch) -> str:
    """Compile one recorded launch for sm_90; one line of resource figures."""
    kernel, grid, args, kwargs = launch
    sig, consts, attrs = _signature(kernel, args, kwargs)
    opts = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=opts)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res).group(1)
    stack = re.search(r"STACK:(\d+)", res).group(1)
    ops = " ".join(f"{op}={len(re.findall(op, sass))}" for op in ("HGMMA", "HMMA", "LDL", "STL"))
    loads = {op: len(re.findall(r"\b%s\b" % op, sass)) for op in ("LDGSTS", "UTMALDG", "LDG")}
    ops += " " + " ".join(f"{op}={n}" for op, n in loads.items())
    shown = {k: v for k, v in consts.items() if k.isupper()}
    return (f"{kernel.__name__:24s} grid={tuple(grid)} {opts} regs={regs} stack={stack} "
            f"smem={compiled.metadata.shared} {ops} {shown}")


def _record(module, fn, *args, **kwargs):
    saved = module.wrap_triton
    module.wrap_triton = _Recorder
    _Recorder.launches = []
    try:
        fn(*args, **kwargs)
    finally:
        module.wrap_triton = saved
    return list(_Recorder.launches)


# (B, H, L, config) for ``--time``: the previous defaults next to the current heuristic ({}) and the
# alternatives the sm_90 report left open (BLOCK_N 32 / 5 stages: 128 registers, two CTAs per SM,
# so the split count must fill 2 x 132 slots: 4 splits = 512 programs = 1.94 waves).
DECODE_CANDIDATES = (
    (128, 128, 4096, dict(BLOCK_N=64, num_stages=2)),  # default before decode-h128 (639 us, run 6)
    (128, 128, 4096, {}),
    (128, 16, 8192, dict(BLOCK_N=64, num_stages=3)),  # default before decode-h128 (521 us, run 6)
    (128, 16, 8192, {}),
    (128, 16, 8192, dict(BLOCK_N=32, num_stages=5, SPLITS=4)),
    (128, 16, 8192, dict(BLOCK_N=32, num_stages=5, SPLITS=6)),
    (128, 16, 8192, dict(BLOCK_N=64, num_stages=5, SPLITS=6)),
)
# (B, H, L, config) of the fp8 cache (``--time-fp8``): the default, deeper pipelines, narrower tiles, fewer warps.
FP8_CANDIDATES = tuple((128, 16, 8192, cfg) for cfg in (
    {}, dict(num_stages=4), dict(num_stages=5), dict(BLOCK_N=32, num_stages=3), dict(BLOCK_N=32, num_stages=5),
    dict(num_warps=4), dict(BLOCK_N=32, num_warps=4, num_stages=4), dict(SPLITS=6), dict(BLOCK_H=32)))


def _fp8_cache(blocks: int, device: str) -> torch.Tensor:
    """A random 656-byte-row cache: e4m3 codes of either sign (no NaN codes), 4 group scales, bf16 rope."""
    codes = torch.randint(0, 0x7E, (blocks, 64, 512), dtype=torch.uint8, device=device)
    codes |= (torch.rand(blocks, 64, 512, device=device) < 0.5).to(torch.uint8) << 7
    scales = (torch.rand(blocks, 64, 4, device=device) * 0.01 + 0.001).view(torch.uint8)
    rope = torch.randn(blocks, 64, 64, device=device).to(torch.bfloat16).view(torch.uint8)
    return torch.cat([codes, scales, rope], -1).contiguous()


def time_decode(candidates=DECODE_CANDIDATES, device: str = "cuda", dtype=torch.bfloat16, reps: int = 50,
                fp8: bool = False) -> None:
    """Per-call time of ``decode._launch`` for each (B, H, L, config), one line each, plus max |error| against
    the first config of the same shape. CUDA: CUDA-graph replay of ``reps`` calls; otherwise a host timer."""
    import time

    from torch._library.triton import set_wrap_triton_enabled

    cuda = device == "cuda"
    first: dict = {}
    for B, H, L, cfg in candidates:
        torch.manual_seed(0)
        blocks = B * triton.cdiv(L, 64)
        cache = _fp8_cache(blocks, device) if fp8 else torch.randn(blocks, 64, 576, device=device, dtype=dtype) * 0.5
        table = torch.randperm(blocks, device=device).view(B, -1).int().contiguous()
        lens = torch.full((B,), L, dtype=torch.int32, device=device)
        q = torch.randn(B, 1, H, 576, device=device, dtype=dtype)
        call = lambda: decode._launch(q, cache, table, lens, 1 / math.sqrt(192), 512, config=dict(cfg), fp8=fp8)  # noqa: E731
        with set_wrap_triton_enabled(False):  # direct launches, as the autotune op's body
            out, _ = call()
            if cuda:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(reps):
                        call()
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                us = start.elapsed_time(end) * 1e3 / reps
            else:
                t0 = time.perf_counter()
                call()
                us = (time.perf_counter() - t0) * 1e6
        err = (out.float() - first.setdefault((B, H, L), out).float()).abs().max().item()
        picked = decode._pick(H, B, table.shape[1] * 64, 512, q.device, dict(cfg), fp8=fp8)
        print(f"decode{' fp8' if fp8 else ''} B={B} H={H} L={L} {picked}: {us:.1f} us, max |out - first config| {err:.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true", help="CUDA: time DECODE_CANDIDATES instead of compiling")
    ap.add_argument("--time-fp8", action="store_true", help="CUDA: time FP8_CANDIDATES (the fp8 cache)")
    args = ap.parse_args()
    if args.time or args.time_fp8:
        if args.time:
            time_decode()
        if args.time_fp8:
            time_decode(FP8_CANDIDATES, fp8=True)
        return
    bf = torch.bfloat16
    cache = torch.zeros(64, 64, 576, dtype=bf)
    launches = []
    decode.num_sms = lambda device: 132  # an H200's count, so split launches appear as they would there
    for B, H, L in ((128, 128, 4096), (128, 16, 8192)):
        q = torch.zeros(B, 1, H, 576, dtype=bf)
        bt = torch.zeros(B, L // 64, dtype=torch.int32)
        sl = torch.zeros(B, dtype=torch.int32)
        launches += _record(decode, decode._launch, q, cache, bt, sl, 1 / math.sqrt(192), 512)
    T = 8 * 128
    q, k, v = torch.zeros(T, 128, 192, dtype=bf), torch.zeros(T, 128, 192, dtype=bf), torch.zeros(T, 128, 128, dtype=bf)
    cu = torch.arange(0, T + 1, 128, dtype=torch.int32)
    launches += _record(prefill, prefill._launch, q, k, v, cu, cu, 1 / math.sqrt(192), True)
    o, lse = torch.zeros(T, 128, 512, dtype=bf), torch.zeros(T, 128)
    launches += _record(merge, merge._launch, o, lse, o, lse)
    launches += _record(cache_write, cache_write._launch, torch.zeros(T, 512, dtype=bf), torch.zeros(T, 64, dtype=bf),
                        torch.zeros(T, dtype=torch.int32), cache)
    launches += _record(gather, gather._launch, cache, torch.zeros(8, 16, dtype=torch.int32), cu[:9],
                        torch.zeros(8, dtype=torch.int32), torch.zeros(T, 576, dtype=bf))
    for launch in launches:
        print(report(launch), flush=True)


if __name__ == "__main__":
    main()
