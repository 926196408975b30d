"""Does fp8 decode's cost follow the lengths or the block table's width? B sequences of L tokens each, the block
table W times wider than the lengths need (the extra entries point at real pages), per backend: time of one call in
a replayed CUDA graph (``bench_kernels.graph_ms``).   python benchmarks/probes/fp8_table_width.py [B H L]"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_kernels as bk  # noqa: E402
from bench_fp8_sparse import DEV, SCALE, D, _caches  # noqa: E402

from mla_compile.ops import decode_fp8  # noqa: E402


def main() -> None:
    B, H, L = (int(a) for a in (sys.argv[1:4] or (128, 128, 4096)))
    _, fp8, table, lens = _caches(B, L)
    q = torch.randn(B, 1, H, D, device=DEV, dtype=torch.bfloat16)
    print(f"fp8 decode B={B} H={H} L={L}: us per call (graph replay) by block-table width", flush=True)
    for wide in (1, 4):
        t = table.repeat(1, wide)  # the lengths use the first L / 64 entries; the rest are real pages
        row = []
        for name in ("gluon", "flashmla"):
            try:
                want = decode_fp8(q, fp8, table, lens, SCALE, backend=name)
                got = decode_fp8(q, fp8, t, lens, SCALE, backend=name)
                same = all(float((a.float() - b.float()).abs().max()) < 1e-3 for a, b in zip(got, want))
                us = bk.graph_ms(lambda: decode_fp8(q, fp8, t, lens, SCALE, backend=name)) * 1e3
                row.append(f"{name} {us:.1f} us{'' if same else ' (differs from width 1!)'}")
            except Exception as exc:  # noqa: BLE001
                row.append(f"{name} failed ({type(exc).__name__}: {str(exc)[:100]})")
        print(f"  table width {wide} x: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
