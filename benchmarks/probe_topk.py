"""Probe: the lightning indexer's top-k, ``topk_positions`` (Triton, per num_warps, its row limit lifted) against
``select_topk`` (torch.topk on the same keys, eager kernels), per row count (decode batches to prefill chunks);
median of 10 replays of a CUDA graph of 20 calls.

    python benchmarks/probe_topk.py
"""
import torch
from mla_compile.ops.sparse_index import select_topk
from mla_compile.ops.triton.lightning_index import topk_positions

def t(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) / 20 * 1e3)
    return sorted(ts)[5]

import mla_compile.ops.triton.lightning_index as li

li.TOPK_MAX_T = 1 << 20  # the probe's rows: every count
for L, k in ((1024, 512), (2048, 512), (4096, 2048)):
    for T in (1, 8, 64, 256, 1024, 4096, 16384):
        s = torch.randn(T, L, device="cuda")
        row = [f"L={L} k={k} T={T:5d}  torch {t(lambda: select_topk(s, k)):8.1f} us"]
        for nw in (4, 8, 16):
            row.append(f"triton nw={nw} {t(lambda: topk_positions(s, k, num_warps=nw)):8.1f}")
        print("  ".join(row), flush=True)
