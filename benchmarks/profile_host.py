"""Where the host time of an eager op call goes: FlashInfer prefill through our op against the direct call.

    python benchmarks/profile_host.py --heads 16 --batch 2 --context 1024 --calls 200   # on the GPU

Times ``--calls`` eager calls of ``ops.prefill(..., backend="flashinfer", plan=...)`` and of FlashInfer's
``wrapper.run`` (the same plan facts, inputs already in its layout): the host time to issue the calls (no sync
inside the loop) and the wall time per call (synchronized at the end), then profiles the calls of our op with
cProfile and prints the functions with the most own time and the most cumulative time. For shapes whose GPU
time is below the host time of a call, the difference of the two issue times is what the adapter adds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import time

import torch

import mla_compile  # noqa: F401  (registers every op and backend)
from mla_compile import ops


def _issue_us(fn, calls: int) -> tuple[float, float]:
    """(host us per call to issue ``calls`` calls, wall us per call until the GPU finished them)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()

    from mla_compile.ops.adapters.flashinfer import plan_flashinfer_prefill

    scale, T = 1 / math.sqrt(192), a.batch * a.context
    q, k = (torch.randn(T, a.heads, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(T, a.heads, 128, device="cuda", dtype=torch.bfloat16)
    cu_host = torch.arange(a.batch + 1, dtype=torch.int32) * a.context
    cu = cu_host.cuda()
    plan = plan_flashinfer_prefill(cu_host, cu_host, num_heads=a.heads, head_dim_qk=192, head_dim_v=128,
                                   scale=scale, dtype=torch.bfloat16, causal=True)
    ours = lambda: ops.prefill(q, k, v, cu, cu, scale, causal=True, backend="flashinfer", plan=plan)  # noqa: E731
    direct = lambda: plan.wrapper.run(q, k, v, return_lse=True)  # noqa: E731
    for fn in (ours, direct):
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    for name, fn in (("ours", ours), ("direct", direct), ("ours", ours), ("direct", direct)):
        host, wall = _issue_us(fn, a.calls)
        print(f"{name:7s} H={a.heads} {a.batch}x{a.context}: host {host:8.1f} us/call  wall {wall:8.1f} us/call",
              flush=True)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(a.calls):
        ours()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
        print(f"\n--- ours, {a.calls} calls, by {key} ---\n" + s.getvalue(), flush=True)


if __name__ == "__main__":
    main()
