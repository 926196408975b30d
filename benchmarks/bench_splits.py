"""Split-KV launch settings of our latency-bound decodes against the peers, on the GPU.

    python benchmarks/bench_splits.py --out OUT_DIR [--tiles 4,2,1] [--block-c 0,128]

For the few-sequence decode shapes (bf16 and fp8 caches, 16 and 128 heads), times our Gluon decodes ("gluon",
and "gluon64" over fp8) at each ``--tiles`` value set for every kernel in ``_plan.SPLIT_TILES`` (the fewest key
tiles a split gets: fewer tiles, more splits; without ``--tiles``, the shipped per-kernel values) and each width
of the reduce kernel's programs (``decode.REDUCE["block_c"]``, at most ``max_rows`` rows; 0: one program a row),
and the peers once. Each time is the median per call of a replayed CUDA graph over enough input sets (each its
own cache, table and queries) that they do not fit in L2, as in a model step where every layer reads its own
cache. Every setting's output is compared with the reference op (float32) on the first set. Writes
``bench_splits.json`` and prints a table, best setting first per shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

import mla_compile  # noqa: F401  (registers every op and backend)
from mla_compile import ops
from mla_compile.ops.triton import _plan
from mla_compile.ops.triton import decode as tdecode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  (CUDA-graph replay timing)
from bench_fp8_sparse import _caches  # noqa: E402

PAGE, DC, DR = 64, 512, 64
D = DC + DR
SCALE = 1 / math.sqrt(192)
# (op, heads, batch, context)
SHAPES = [("decode", 16, 1, 4096), ("decode", 16, 2, 4096), ("decode", 16, 2, 8192), ("decode", 16, 8, 4096),
          ("decode", 128, 1, 4096), ("decode", 128, 2, 4096), ("decode", 128, 8, 4096),
          ("decode_fp8", 16, 2, 4096), ("decode_fp8", 16, 2, 8192), ("decode_fp8", 128, 1, 8192),
          ("decode_fp8", 128, 2, 4096), ("decode_fp8", 16, 16, 8192)]


def _sets(op, H, B, L):
    """Input sets ``(q, cache, table, lens)`` of one shape, enough of them to add up past the L2."""
    n = bk._rotation(B * L * (656 if op == "decode_fp8" else 2 * D), cap=16)
    out = []
    for i in range(n):
        bf16, fp8, table, lens = _caches(B, L, seed=i)
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        out.append((q, fp8 if op == "decode_fp8" else bf16, table, lens))
    return out


def _op(op):
    """The public op of ``op`` ("decode" or "decode_fp8")."""
    return ops.decode_fp8 if op == "decode_fp8" else ops.decode


def _call(op, backend, sets, plans=None):
    """One call of ``backend`` on every input set (with ``plans[i]`` for set i when given)."""
    fn = _op(op)

    def run():
        for i, (q, cache, table, lens) in enumerate(sets):
            kw = {"plan": plans[i]} if plans else {}
            fn(q, cache, table, lens, SCALE, backend=backend, **kw)
    return run


def _reference(op, s) -> tuple:
    """The reference op's ``(out, lse)`` (float32) on input set ``s``."""
    q, cache, table, lens = s
    return _op(op)(q.float(), cache if op == "decode_fp8" else cache.float(), table, lens, SCALE, backend="reference")


def _err(op, backend, s, ref) -> float:
    """The largest difference of ``backend``'s output and LSE on set ``s`` from ``ref``."""
    o, lse = _op(op)(*s, SCALE, backend=backend)
    return max((o.float() - ref[0]).abs().max().item(), (lse - ref[1]).abs().max().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiles", default="", help="SPLIT_TILES values for every kernel, e.g. 4,2,1 (default: shipped)")
    ap.add_argument("--block-c", default="0,128", help="reduce program widths (0: the whole row)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    tiles = [int(t) for t in a.tiles.split(",")] if a.tiles else [None]
    widths = [int(c) or None for c in a.block_c.split(",")]
    default = (dict(_plan.SPLIT_TILES), tdecode.REDUCE["block_c"])
    rows = []
    for op, H, B, L in SHAPES:
        sets = _sets(op, H, B, L)
        group = f"{op} H={H} B={B} L={L} ({len(sets)} sets)"
        print(group, flush=True)
        ref = _reference(op, sets[0])
        ours = ("gluon", "gluon64") if op == "decode_fp8" else ("gluon",)
        for backend in ours:
            for t in tiles:
                for c in widths:
                    tdecode.REDUCE["block_c"] = c
                    _plan.SPLIT_TILES.update({k: t or v for k, v in default[0].items()})
                    try:
                        err = _err(op, backend, sets[0], ref)
                        us = bk.graph_ms(_call(op, backend, sets)) / len(sets) * 1e3
                    except Exception as exc:
                        print(f"  {backend} tiles={t or 'shipped'} block_c={c}: FAILED {type(exc).__name__}: "
                              f"{str(exc)[:160]}")
                        continue
                    rows.append(dict(group=group, impl=f"{backend} tiles={t or 'shipped'} block_c={c}", us=us, err=err))
                    print(f"  {backend:8s} tiles={t or 'shipped'} block_c={c}: {us:7.1f} us  max err {err:.1e}",
                          flush=True)
        _plan.SPLIT_TILES.update(default[0])
        tdecode.REDUCE["block_c"] = default[1]
        peers = ("flashmla",) if op == "decode_fp8" else ("flashmla", "flashinfer")
        for backend in peers:
            try:
                plans = None
                if backend == "flashinfer":
                    from mla_compile.ops.adapters.flashinfer import plan_flashinfer_decode
                    plans = [plan_flashinfer_decode(t.cpu(), ln.cpu(), num_heads=H, block_size=PAGE, scale=SCALE,
                                                    dtype=torch.bfloat16, use_cuda_graph=True)
                             for _, _, t, ln in sets]
                us = bk.graph_ms(_call(op, backend, sets, plans)) / len(sets) * 1e3
            except Exception as exc:
                print(f"  {backend}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
                continue
            rows.append(dict(group=group, impl=backend, us=us))
            print(f"  {backend:8s}: {us:7.1f} us", flush=True)
        del sets, ref
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "bench_splits.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\nbest first, per shape (us):")
    for g in dict.fromkeys(r["group"] for r in rows):
        rs = sorted((r for r in rows if r["group"] == g), key=lambda r: r["us"])
        print(f"{g}: " + "; ".join(f"{r['impl']} {r['us']:.1f}" for r in rs))


if __name__ == "__main__":
    main()
