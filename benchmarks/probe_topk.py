"""Probe: the lightning indexer's top-k, ``topk_positions`` (Triton, per num_warps, its row limit lifted) against
``select_topk`` (torch.topk on the same keys, eager kernels), per row count (decode batches to prefill chunks);
median of 10 replays of a CUDA graph of up to 20 calls.

    python benchmarks/probe_topk.py
"""
import torch
from bench_kernels import graph_ms  # this folder: on the path when run as a script

import mla_compile.ops.triton.lightning_index as li
from mla_compile.ops.sparse_index import select_topk
from mla_compile.ops.triton.lightning_index import topk_positions


def t(fn):
    """Microseconds per call (``bench_kernels.graph_ms``: replays of a CUDA graph of a few calls)."""
    return graph_ms(fn) * 1e3


li.TOPK_MAX_T = 1 << 20  # the probe's rows: every count
for L, k in ((1024, 512), (2048, 512), (4096, 2048)):
    for T in (1, 8, 64, 256, 1024, 4096, 16384):
        s = torch.randn(T, L, device="cuda")
        row = [f"L={L} k={k} T={T:5d}  torch {t(lambda: select_topk(s, k)):8.1f} us"]
        for nw in (4, 8, 16):
            row.append(f"triton nw={nw} {t(lambda: topk_positions(s, k, num_warps=nw)):8.1f}")
        print("  ".join(row), flush=True)
