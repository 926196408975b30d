"""Probe: the sm_90 Gluon fp8 decodes at more than 32 query rows (head blocks re-read the cache)."""
import os, sys
sys.path.insert(0, "benchmarks")
import torch
import bench_fp8_sparse as bf
import bench_kernels as bk
from mla_compile.ops import decode, decode_fp8
from mla_compile.ops.triton import fp8_decode_tma as tma, fp8_decode_wgmma as wg, fp8_decode_gluon as mma

B = 128
bk.ceilings()
for B, S, H, L in [(128, 1, 64, 4096), (128, 1, 128, 4096), (4, 1, 128, 8192), (1, 1, 128, 32768), (64, 2, 128, 2048)]:
    group = f"B={B} s_q={S} H={H} L={L}"
    bf16, fp8, table, lens = bf._caches(B, L)
    q = torch.randn(B, S, H, bf.D, device="cuda", dtype=torch.bfloat16)
    ref, lref = decode(q.double() if False else q, bf16, table, lens, bf.SCALE, backend="triton")
    o8, l8 = decode_fp8(q, fp8, table, lens, bf.SCALE, backend="triton")
    for name, fn in [("triton bf16", lambda: decode(q, bf16, table, lens, bf.SCALE, backend="triton")),
                     ("triton fp8", lambda: decode_fp8(q, fp8, table, lens, bf.SCALE, backend="triton")),
                     ("tma fp8", lambda: tma.launch(q, fp8, table, lens, bf.SCALE, 512)),
                     ("wgmma fp8", lambda: wg.launch(q, fp8, table, lens, bf.SCALE, 512)),
                     ("mma fp8", lambda: mma.launch(q, fp8, table, lens, bf.SCALE, 512))]:
        try:
            o, l = fn()
            err = float((o.float() - o8.float()).norm() / o8.float().norm())
            lerr = float((l - l8).abs().max())
            print(f"{group} {name}: rel vs triton fp8 {err:.2e} lse {lerr:.1e}", flush=True)
        except Exception as exc:
            print(f"{group} {name}: FAILED {exc!r}"[:300], flush=True)
            continue
        bk.attempt(group, name, fn, 2 * B * S * H * L * 1088, B * L * 656)
    del bf16, fp8
    torch.cuda.empty_cache()
for r in bk.ROWS:
    print(r.get("group"), bk._fmt(r))
