"""Compile the Triton kernels for sm_90 on a machine without a GPU and print their resource use.

Runs each op's ``_launch`` on small CPU tensors with ``wrap_triton`` replaced by a recorder, then
compiles every recorded launch (same constexprs, warps and stages as the shapes given) with
Triton's bundled ptxas for ``cuda:90`` and reads registers, spills (stack, LDL/STL), shared memory
the matrix instructions (HGMMA = wgmma, HMMA = mma.sync) and the global loads (LDGSTS = cp.async,
UTMALDG = TMA, LDG = synchronous loads into registers) off the cubin. No device time needed.

    python benchmarks/kernel_resources.py            # DeepSeek shapes, default configs
    python benchmarks/kernel_resources.py --fp4      # V4-Flash's fp4 kernels: instructions a weight in the hot loop
    python benchmarks/kernel_resources.py --time     # CUDA: time the decode candidates (A/B, same run)

``--fp4``: the fp4 decode kernels are bound by issue, not bytes, at few tokens, so the instructions their hot loop
(the largest innermost SASS loop) issues per weight read is the figure to lower; it is counted here, without a GPU.
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile.ops.triton import _sm90, cache_write, decode, fp4_block_linear, gather, merge, moe_experts_fp4, prefill


def report(launch) -> str:
    """Compile one recorded launch for sm_90; one line of resource figures."""
    kernel, grid, args, kwargs = launch
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    r = _sm90.resources(compiled)
    _, consts, _ = _sm90.signature(kernel, args, kwargs)
    opts = {k: kwargs[k] for k in _sm90.OPTIONS if k in kwargs}
    ops = " ".join(f"{op}={r[op]}" for op in _sm90.COUNTED)
    shown = {k: v for k, v in consts.items() if k.isupper()}
    return (f"{kernel.__name__:24s} grid={tuple(grid)} {opts} regs={r['regs']} stack={r['stack']} "
            f"smem={r['smem']} {ops} {shown}")


# Weights one program reads a step of its hot loop, from the launch's constexprs and warps (the fp4 kernels of
# ``--fp4``)
WEIGHTS_A_STEP = {
    "_moe_fp4_gate_up_kernel": lambda c, w: 2 * c["BLOCK_N"] * c["BLOCK_K"],  # gate and up
    "_moe_fp4_down_kernel": lambda c, w: c["K"] * c["BLOCK_H"] * c["BLOCK_K"],  # every pick, unrolled
    "_fp4_gemv_kernel": lambda c, w: c["BLOCK_N"] * c["BLOCK_K"],
    "_fp4_linear_kernel": lambda c, w: c["BLOCK_N"] * c["BLOCK_K"],
    # two 128-column steps a warp a loop, the warps splitting K: gate and up together, a pick's down alone
    "_moe_fp4_mma_gate_up_kernel": lambda c, w: 2 * 2 * w * c["ROWS"] * 128,
    "_moe_fp4_mma_down_kernel": lambda c, w: 2 * w * c["ROWS"] * 128,
    "_moe_fp4_mma_sorted_gate_up_kernel": lambda c, w: 2 * 2 * w * c["ROWS"] * 128,
    "_moe_fp4_mma_sorted_down_kernel": lambda c, w: 2 * w * c["ROWS"] * 128,
}


def hot_loop(launch) -> str:
    """Compile one recorded launch for sm_90; one line on its largest innermost loop: instructions a step, weights a
    thread a step (:data:`WEIGHTS_A_STEP`), instructions a weight and the most frequent opcodes."""
    from collections import Counter

    kernel, grid, args, kwargs = launch
    compiled = _sm90.compile_sm90(kernel, args, kwargs)
    (sass,) = _sm90._cuobjdump(compiled, "-sass")
    loop = max(_sm90.innermost_loops(sass), key=len)
    _, consts, _ = _sm90.signature(kernel, args, kwargs)
    warps = compiled.metadata.num_warps
    per_thread = WEIGHTS_A_STEP[kernel.__name__](consts, warps) / (32 * warps)
    top = " ".join(f"{op}={n}" for op, n in Counter(_sm90.opcode(t) for t in loop).most_common(8))
    shown = {k: v for k, v in consts.items() if k.startswith(("BLOCK", "K", "STAGES", "WORDS", "ROWS"))}
    return (f"{kernel.__name__:24s} grid={tuple(grid)} regs={_sm90.resources(compiled)['regs']} {shown}: "
            f"{len(loop)} instructions a step, {per_thread:g} weights a thread, "
            f"{len(loop) / per_thread:.2f} a weight; {top}")


def fp4_launches() -> list:
    """The fp4 kernels at V4-Flash's routed-expert dims (hidden 4096, width 2048, top-6) on 132 SMs: the fused
    experts at 1 and 8 tokens (Triton, then the Gluon ``mma`` kernels at 1 and, sorted by expert, 64), the fp4 linear's
    GEMV at one row and its tiled word decode at 16 and 64 rows."""
    from mla_compile.ops.triton import moe_experts_fp4_mma

    H, I, E, k = 4096, 2048, 8, 6
    u8 = lambda *s: torch.zeros(*s, dtype=torch.uint8)  # noqa: E731
    launches = []
    experts = lambda T: (torch.zeros(T, H, dtype=torch.bfloat16), torch.rand(T, k),  # noqa: E731
                         torch.zeros(T, k, dtype=torch.int32), u8(E, I, H // 2), u8(E, I, H // 32), u8(E, I, H // 2),
                         u8(E, I, H // 32), u8(E, H, I // 2), u8(E, H, I // 32), True, 10.0)
    for T in (1, 8):
        launches += _sm90.record(moe_experts_fp4, moe_experts_fp4._launch, *experts(T), sms=132)
    for T in (1, 64):  # per (token, pick), then sorted by expert
        launches += _sm90.record(moe_experts_fp4_mma, moe_experts_fp4_mma.launch, *experts(T),
                                 gluon=tuple(n for n in dir(moe_experts_fp4_mma) if n.startswith("_moe_fp4_mma")))
    for M in (1, 16, 64):
        recorded = _sm90.record(fp4_block_linear, fp4_block_linear._launch, torch.zeros(M, H, dtype=torch.bfloat16),
                                u8(I, H // 2), u8(I, H // 32), sms=132)
        launches += [(kernel, grid, args, {**kw, "F32": False} if "F32" in kw else kw)  # as on a GPU
                     for kernel, grid, args, kw in recorded]
    return launches


# (B, H, L, config) for ``--time``: the previous defaults next to the current heuristic ({}) and the
# alternatives the sm_90 report left open (page tiles: fewer registers, so narrower tiles with deeper
# pipelines fit).
DECODE_CANDIDATES = (
    (128, 128, 4096, dict(PAGE_TILES=False, num_stages=3)),  # default before page tiles (630 us, run 23)
    (128, 128, 4096, {}),  # page tiles, 2 stages (526 us, run 24)
    (128, 128, 4096, dict(PAGE_TILES=True, BLOCK_N=32, num_stages=2)),  # 230 registers, fewer instructions
    (128, 128, 4096, dict(PAGE_TILES=True, BLOCK_N=32, num_stages=3)),
    (128, 16, 8192, dict(PAGE_TILES=False)),  # default before page tiles (449 us, run 23)
    (128, 16, 8192, {}),  # page tiles, 5 stages (308 us, run 24)
    (128, 16, 8192, dict(num_stages=6)),
    (128, 16, 8192, dict(BLOCK_N=32, num_stages=8)),  # 96 registers, 130 KB
    (128, 16, 8192, dict(BLOCK_N=32, num_stages=10)),
)
# (B, H, L, config) of the fp8 cache (``--time-fp8``): the H=16 default and deeper pipelines (run 23: 690 us,
# 4 stages equal, 2 stages 739), and for H=128 the 64-row wgmma default (run 23: 1788 us; sm_90: 848 B of
# spills) against 32-row mma.sync programs (40 B of spills, four programs per sequence sharing L2).
FP8_CANDIDATES = ((128, 16, 8192, {}), (128, 16, 8192, dict(num_stages=4)), (128, 128, 4096, {}),
                  (128, 128, 4096, dict(BLOCK_H=32)), (128, 128, 4096, dict(BLOCK_H=32, PAGE_TILES=True)))


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
        picked = decode._pick(H, B, table.shape[1] * 64, 512, q.device, dict(cfg), fp8=fp8, block_size=64)
        print(f"decode{' fp8' if fp8 else ''} B={B} H={H} L={L} {picked}: {us:.1f} us, max |out - first config| {err:.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true", help="CUDA: time DECODE_CANDIDATES instead of compiling")
    ap.add_argument("--time-fp8", action="store_true", help="CUDA: time FP8_CANDIDATES (the fp8 cache)")
    ap.add_argument("--fp4", action="store_true", help="the fp4 kernels' hot loops: instructions a weight")
    args = ap.parse_args()
    if args.fp4:
        for launch in fp4_launches():
            print(hot_loop(launch), flush=True)
        return
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
        launches += _sm90.record(decode, decode._launch, q, cache, bt, sl, 1 / math.sqrt(192), 512)
    T = 8 * 128
    q, k, v = torch.zeros(T, 128, 192, dtype=bf), torch.zeros(T, 128, 192, dtype=bf), torch.zeros(T, 128, 128, dtype=bf)
    cu = torch.arange(0, T + 1, 128, dtype=torch.int32)
    launches += _sm90.record(prefill, prefill._launch, q, k, v, cu, cu, 1 / math.sqrt(192), True)
    o, lse = torch.zeros(T, 128, 512, dtype=bf), torch.zeros(T, 128)
    launches += _sm90.record(merge, merge._launch, o, lse, o, lse)
    launches += _sm90.record(cache_write, cache_write._launch, torch.zeros(T, 512, dtype=bf), torch.zeros(T, 64, dtype=bf),
                        torch.zeros(T, dtype=torch.int32), cache)
    launches += _sm90.record(gather, gather._launch, cache, torch.zeros(8, 16, dtype=torch.int32), cu[:9],
                        torch.zeros(8, dtype=torch.int32), torch.zeros(T, 576, dtype=bf))
    for launch in launches:
        print(report(launch), flush=True)


if __name__ == "__main__":
    main()
