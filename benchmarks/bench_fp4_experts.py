"""Time DeepSeek-V4 FP4 expert weights on a GPU: ``mla::fp4_block_linear`` against bf16 (and fp8 blocks).

    python benchmarks/bench_fp4_experts.py --out OUT_DIR [--experts 256]

V4-Flash expert shapes (hidden 4096, expert intermediate 2048), batch (tokens) 1, 4 and 64, bf16 activations:
- one expert's GEMV / GEMM, gate (N 2048, K 4096) and down (N 4096, K 2048): fp4 Triton vs bf16 ``F.linear``
  and the fp8 block Triton kernel on the same weight;
- the routed experts of one MoE layer, 256 experts top-6 (``--tokens``, default 1, 8, 64, 256):
  ``mla::moe_experts_fp4`` fused ("triton": the picks' weights per (token, pick); "gluon": the same on the tensor
  cores), "grouped" (tokens sorted by expert, each hit expert read once, through ``mla::fp4_block_linear``'s sorted
  groups) and "auto", against bf16 ``torch._grouped_mm`` (``moe.experts_grouped``); ``--sweep`` adds the fused
  kernels' launch parameters (the Gluon kernels' rows and warps among them, per pick and sorted).
Times per call from a replayed CUDA graph (``bench_kernels.graph_ms``); GB/s counts the weight bytes read
(fp4: half a byte per weight plus a scale byte per 32). Writes ``bench_fp4_experts.json`` and ``.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  (graph_ms, bench, attempt, ceilings, table helpers)

import mla_compile  # noqa: E402,F401
from mla_compile.models.fp4_linear import FP4Experts  # noqa: E402
from mla_compile.models.moe import experts_grouped  # noqa: E402
from mla_compile.ops import fp4_block_linear, fp8_block_linear  # noqa: E402
from mla_compile.ops.moe_experts_fp4 import FUSED_MAX_TOKENS_FP4, moe_experts_fp4  # noqa: E402
from mla_compile.ops.triton import fp4_block_linear as tfp4  # noqa: E402
from mla_compile.ops.triton import moe_experts_fp4 as tmoe  # noqa: E402
from mla_compile.ops.triton import moe_experts_fp4_mma as tmma  # noqa: E402

DEV, HIDDEN, INTER, TOPK = "cuda", 4096, 2048, 6
SWEEP = False


def _fp4(*shape):
    """Random packed codes and scales near 2^-7 (real checkpoints' range) for a ``[..., N, K]`` weight."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=DEV)
    scale = torch.randint(117, 123, (*lead, n, k // 32), dtype=torch.uint8, device=DEV)
    return packed, scale


def rel_err(y, want) -> float:
    """``||y - want|| / ||want||`` in float64: a swept config's check against the reference."""
    y, want = y.double(), want.double()
    return float((y - want).norm() / want.norm())


def fp4_bytes(n, k):
    return n * k // 2 + n * k // 32


def linear_case(M, name, N, K):
    group = f"expert {name} M={M} N={N} K={K}"
    print(group, flush=True)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    packed, scale = _fp4(N, K)
    w_bf16 = (torch.randn(N, K, device=DEV) * 0.02).bfloat16()
    w_fp8 = w_bf16.to(torch.float8_e4m3fn)
    s_fp8 = torch.ones(-(-N // 128), -(-K // 128), device=DEV)
    flops = 2 * M * N * K
    bk.attempt(group, "fp4 triton", lambda: fp4_block_linear(x, packed, scale, backend="triton"), flops,
               fp4_bytes(N, K))
    bk.attempt(group, "bf16 F.linear", lambda: F.linear(x, w_bf16), flops, 2 * N * K)
    if SWEEP and M <= tfp4.GEMV_ROWS:  # GEMV tile configs, each checked against the reference op
        default = dict(tfp4.GEMV_CONFIG)
        want = fp4_block_linear(x.float(), packed, scale, backend="reference").double()
        for bn, bkk, warps in ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4), (16, 1024, 4), (16, 512, 8),
                               (32, 256, 4), (32, 512, 8)):
            tfp4.GEMV_CONFIG = dict(BLOCK_N=bn, BLOCK_K=bkk, STAGES=3, num_warps=warps)
            try:
                y = tfp4._launch(x, packed, scale).double()
                err = rel_err(y, want)
                bk.attempt(group, f"fp4 gemv BN{bn} BK{bkk} w{warps}",
                           bk.direct(lambda: tfp4._launch(x, packed, scale)), flops, fp4_bytes(N, K),
                           note=f"rel err {err:.1e}")
            finally:
                tfp4.GEMV_CONFIG = default
    if SWEEP and M > tfp4.GEMV_ROWS:  # tiled-kernel configs (4 or 8 warps), each checked against the reference
        default = tfp4._config
        want = fp4_block_linear(x.float(), packed, scale, backend="reference").double()
        for bm, bn, bkk, warps, stages, words in ((64, 32, 128, 4, 3, False), (64, 64, 256, 4, 3, False),
                                                  (64, 128, 128, 8, 3, False), (32, 64, 128, 4, 3, False),
                                                  (64, 64, 128, 4, 4, False), (64, 128, 128, 4, 3, True),
                                                  (64, 64, 128, 4, 3, True), (16, 128, 128, 4, 3, True)):
            c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bkk, IEEE=False, WORDS=words, F32=False, num_warps=warps,
                     num_stages=stages)
            tfp4._config = lambda m, ieee, device, c=c: c
            try:
                y = tfp4._launch(x, packed, scale).double()
                err = rel_err(y, want)
                bk.attempt(group, f"fp4 tiled BM{bm} BN{bn} BK{bkk} w{warps} s{stages}{' words' * words}",
                           bk.direct(lambda: tfp4._launch(x, packed, scale)), flops, fp4_bytes(N, K),
                           note=f"rel err {err:.1e}")
            finally:
                tfp4._config = default
    bk.attempt(group, "fp8 block triton", lambda: fp8_block_linear(x, w_fp8, s_fp8, backend="triton"), flops,
               N * K + 4 * s_fp8.numel())


def moe_case(T, E):
    group = f"routed experts T={T} E={E} top{TOPK}"
    print(group, flush=True)
    x = torch.randn(T, HIDDEN, device=DEV, dtype=torch.bfloat16)
    gen = torch.Generator(device=DEV).manual_seed(T)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=gen)[:TOPK] for _ in range(T)])
    weights = torch.rand(T, TOPK, device=DEV)
    hit = int(torch.unique(ids).numel())
    flops = 2 * T * TOPK * 3 * HIDDEN * INTER
    fp4 = FP4Experts(E, HIDDEN, INTER, torch.nn.SiLU(), backend="triton", device="meta")
    for proj, (rows, cols) in fp4.shapes(HIDDEN, INTER).items():
        packed, scale = _fp4(E, rows, cols)
        setattr(fp4, proj, torch.nn.Parameter(packed, requires_grad=False))
        setattr(fp4, proj + "_scale_inv", torch.nn.Parameter(scale, requires_grad=False))
    hit_bytes = hit * (2 * fp4_bytes(INTER, HIDDEN) + fp4_bytes(HIDDEN, INTER))
    bk.attempt(group, "fp4 fp4_block_linear sorted", lambda: fp4(x, weights, ids, grouped=True), flops, hit_bytes,
               note=f"{hit} experts hit")
    w = [getattr(fp4, p + s) for p in ("gate_proj", "up_proj", "down_proj") for s in ("", "_scale_inv")]
    picks = T * TOPK * (2 * fp4_bytes(INTER, HIDDEN) + fp4_bytes(HIDDEN, INTER))
    for name in ("triton", "gluon", "grouped", None):
        bk.attempt(group, f"fp4 moe_experts_fp4 {name or 'auto'}",
                   lambda name=name: moe_experts_fp4(x, weights, ids, *w, swiglu_limit=10.0, backend=name), flops,
                   picks if name in ("triton", "gluon") else hit_bytes, note=f"{hit} experts hit")
    if SWEEP:  # the fused kernels' launch parameters and the grouped path's variants, each checked against the
        # reference op
        want = moe_experts_fp4(x, weights, ids, *w, swiglu_limit=10.0, out_float32=True, backend="reference")

        def swept(label, backend):
            y = moe_experts_fp4(x, weights, ids, *w, swiglu_limit=10.0, out_float32=True, backend=backend)
            bk.attempt(group, label,
                       bk.direct(lambda: moe_experts_fp4(x, weights, ids, *w, swiglu_limit=10.0, backend=backend)),
                       flops, picks if backend in ("triton", "gluon") else hit_bytes,
                       note=f"rel err {rel_err(y, want):.1e}")

        with mock.patch.object(tfp4, "TILED_WORDS", not tfp4.TILED_WORDS):  # the tiled kernels' other decode
            swept(f"fp4 moe_experts_fp4 grouped, TILED_WORDS={tfp4.TILED_WORDS}", "grouped")
        if T * TOPK <= tfp4.GEMV_ROWS_SORTED * E:  # the grouped path's tiled kernels where it takes the GEMV
            with mock.patch.object(tfp4, "GEMV_ROWS_SORTED", 0):
                swept("fp4 moe_experts_fp4 grouped, tiled (GEMV_ROWS_SORTED=0)", "grouped")
        sorted_tiles = ((16, 128, 128, 4, 3), (16, 128, 128, 8, 3), (16, 64, 256, 4, 3), (16, 128, 256, 8, 3),
                        (16, 256, 128, 8, 3), (32, 128, 128, 8, 3), (16, 128, 128, 4, 4))
        for bm, bn, bkk, warps, stages in sorted_tiles if T > FUSED_MAX_TOKENS_FP4 else ():  # bf16 word decode
            c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bkk, IEEE=False, WORDS=True, F32=False, num_warps=warps,
                     num_stages=stages)
            with mock.patch.object(tfp4, "_config", lambda m, ieee, device, c=c: c):
                swept(f"fp4 grouped sorted BM{bm} BN{bn} BK{bkk} w{warps} s{stages}", "grouped")
        fused = ((512, 512, 2, 4, 3), (512, 512, 2, 4, 1), (512, 512, 2, 4, 4), (256, 256, 2, 4, 4),
                 (512, 1024, 1, 4, 3), (1024, 1024, 1, 4, 2), (512, 512, 1, 8, 3))
        for gk, dk, waves, warps, stages in fused if T <= FUSED_MAX_TOKENS_FP4 else ():
            with mock.patch.dict(tmoe.CONFIG, gate_up_k=gk, down_k=dk, waves=waves, num_warps=warps, stages=stages,
                                 pipelined_tokens=1 << 30):
                swept(f"fp4 fused gate_up_k{gk} down_k{dk} waves{waves} w{warps} s{stages}", "triton")
        gluon = ((16, 4, 4), (32, 4, 4), (16, 8, 8), (16, 4, 8), (32, 8, 8), (32, 8, 4), (16, 2, 2), (32, 2, 2),
                 (32, 4, 2), (16, 8, 4))
        for rows, gu_warps, dn_warps in gluon:  # the Gluon mma kernels' rows a warp and warps a program (per pick or
            # sorted, as the token count takes them; CONFIG's own, the per-pick table off)
            with mock.patch.dict(tmma.CONFIG, rows=rows, gate_up_warps=gu_warps, down_warps=dn_warps, per_pick=(),
                                 sorted=()):
                swept(f"fp4 gluon rows{rows} gate_up_w{gu_warps} down_w{dn_warps}", "gluon")
    fp4 = w = None  # the fp4 weights freed before the bf16 ones are made
    torch.cuda.empty_cache()
    gate_up = torch.empty(E, 2 * INTER, HIDDEN, device=DEV, dtype=torch.bfloat16)
    down = torch.empty(E, HIDDEN, INTER, device=DEV, dtype=torch.bfloat16)
    for e in range(0, E, 16):  # chunks bound the float32 temporaries
        gate_up[e:e + 16] = torch.randn(gate_up[e:e + 16].shape, device=DEV) * 0.02
        down[e:e + 16] = torch.randn(down[e:e + 16].shape, device=DEV) * 0.02
    bk.attempt(group, "bf16 torch._grouped_mm", lambda: experts_grouped(x, weights, ids, gate_up, down, F.silu),
               flops, hit * 3 * HIDDEN * INTER * 2, note=f"{hit} experts hit")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--sweep", action="store_true", help="also time the fp4 kernels' tile configs")
    ap.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[1, 8, 64, 256],
                    help="token counts of the routed-experts rows")
    ap.add_argument("--linears", type=int, default=1, help="0: skip the one-expert linear rows")
    args = ap.parse_args()
    global SWEEP
    SWEEP = args.sweep
    os.makedirs(args.out, exist_ok=True)
    bk.ceilings()
    sections = [lambda m=m, c=c: linear_case(m, *c) for m in ((1, 4, 64) if args.linears else ())
                for c in (("gate", INTER, HIDDEN), ("down", HIDDEN, INTER))]
    sections += [lambda t=t: moe_case(t, args.experts) for t in args.tokens]
    bk.run_sections(sections, os.path.join(args.out, "bench_fp4_experts.json"))
    text = "\n".join(f"{r.get('group', '')}: {bk._fmt(r)}" for r in bk.ROWS)
    with open(os.path.join(args.out, "bench_fp4_experts.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
