"""Time fp8-cache and sparse decode on a GPU: our Triton kernels against the bf16 path and FlashMLA.

    python benchmarks/bench_fp8_sparse.py --out OUT_DIR [--quick | --dense-only | --sparse-only | --index-only]

Sections (all with kv_lora_rank 512 + rope 64, page 64, scale 1/sqrt(192), bf16 queries):
- dense decode B=128, L=8192, H=16 (memory-bound): Triton bf16 cache vs Triton fp8 cache (the issue's
  goal: fp8 >= 1.7x faster than bf16), FlashMLA bf16 and FlashMLA fp8 (its sparse V3.2 kernel over
  causal slot lists, heads padded to 64: its dense fp8 kernel reads another format), our Gluon fp8 kernels
  ("gluon", and "gluon64" with 64 query rows a program, on sm_90, then one row per opt-in variant of its
  kernel: ``fp8_decode_gluon64.VARIANTS`` each alone, RESCALE_SKIP+MAX_XCHG and all together, and the
  defaults with the output's TMA store); also H=128
  at L=4096 and B=1 H=128 at L=8192;
- fp8 cache write of 4096 tokens (Triton vs the torch reference);
- sparse decode B=128, topk 2048 over L=8192 contexts, H=16 and 128: Triton on bf16 and fp8 caches, our
  Gluon sparse kernel ("gluon64", on sm_90, fp8 and bf16 caches; then on fp8 each of its flags flipped,
  2 / 4 splits and the output's TMA store), FlashMLA fp8 sparse;
- the V3.2 lightning indexer (64 index heads x 128, top 2048) for a decode step (B=128 queries over
  L=8192 contexts) and a prefill chunk (2048 queries of one 8192-token sequence), bf16 and fp8 index-key
  caches, Triton vs the torch reference; and the index-key cache write of 4096 tokens.
Times are per call from a replayed CUDA graph (``bench_kernels.graph_ms``); GB/s counts the cache bytes
the op must read. Writes ``bench_fp8_sparse.json`` and ``.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  (graph_ms, bench, attempt, ceilings, table helpers)

import mla_compile  # noqa: E402,F401
from mla_compile.ops import (decode, decode_fp8, lightning_index, sparse_decode, write_index_cache,  # noqa: E402
                             write_latent_cache_fp8)
from mla_compile.ops.fp8_cache import gluon_eligible, quantize_fp8_rows  # noqa: E402
from mla_compile.ops.fp8_index import quantize_fp8_index  # noqa: E402

DEV, PAGE, DC, DR = "cuda", 64, 512, 64
D, W = DC + DR, 656
SCALE = 1 / math.sqrt(192)


def _caches(B, L, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    nblk = -(-L // PAGE)
    pages = B * nblk
    bf16 = (torch.randn(pages, PAGE, D, device=DEV, generator=gen) * 0.5).bfloat16()
    fp8 = torch.empty(pages, PAGE, W, dtype=torch.uint8, device=DEV)
    for p0 in range(0, pages, 1024):  # quantize in chunks to bound the temporaries
        rows = bf16[p0:p0 + 1024].reshape(-1, D)
        fp8[p0:p0 + 1024] = quantize_fp8_rows(rows[:, :DC], rows[:, DC:]).view(-1, PAGE, W)
    table = torch.randperm(pages, device=DEV, generator=gen).view(B, nblk).int().contiguous()
    lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
    return bf16, fp8, table, lens


def dense_case(B, H, L):
    group = f"decode B={B} L={L} H={H}"
    print(group, flush=True)
    bf16, fp8, table, lens = _caches(B, L)
    q = torch.randn(B, 1, H, D, device=DEV, dtype=torch.bfloat16)
    flops = 2 * B * H * L * (D + DC)
    out_bytes = B * H * DC * 2
    bk.attempt(group, "triton bf16 cache", lambda: decode(q, bf16, table, lens, SCALE, backend="triton"),
               flops, B * L * D * 2 + out_bytes)
    bk.attempt(group, "triton fp8 cache", lambda: decode_fp8(q, fp8, table, lens, SCALE, backend="triton"),
               flops, B * L * W + out_bytes)
    if gluon_eligible(q, fp8, DC):
        bk.attempt(group, "gluon fp8 cache (auto)", lambda: decode_fp8(q, fp8, table, lens, SCALE, backend="gluon"),
                   flops, B * L * W + out_bytes)
    o_bf, _ = decode(q, bf16, table, lens, SCALE, backend="triton")
    o_f8, _ = decode_fp8(q, fp8, table, lens, SCALE, backend="triton")
    _gluon64_row(group, q, fp8, table, lens, o_f8, flops, B * L * W + out_bytes)
    rel = float((o_f8.float() - o_bf.float()).norm() / o_bf.float().norm())
    print(f"  fp8 vs bf16 output: {rel:.3%} normwise", flush=True)
    try:
        import flash_mla  # noqa: F401
        bk.attempt(group, "FlashMLA bf16", lambda: decode(q, bf16, table, lens, SCALE, backend="flashmla"),
                   flops, B * L * D * 2 + out_bytes)
        bk.attempt(group, "FlashMLA fp8 (sparse kernel)", lambda: decode_fp8(q, fp8, table, lens, SCALE, backend="flashmla"),
                   flops, B * L * W + out_bytes)
        # the same call with a block table 4x wider than the lengths (a serving table's capacity): the V3.2 kernel
        # runs over the table's whole width (why "auto" skips this backend)
        wide = torch.cat([table, table.repeat(1, 3)], dim=1)
        bk.attempt(group, "FlashMLA fp8, table 4x the lengths",
                   lambda: decode_fp8(q, fp8, wide, lens, SCALE, backend="flashmla"), flops, B * L * W + out_bytes)
    except ImportError as exc:
        print(f"  FlashMLA unavailable: {exc!r}", flush=True)
    rows = {r["impl"]: r for r in bk.ROWS if r.get("group") == group and "us" in r}
    if "triton bf16 cache" in rows and "triton fp8 cache" in rows:
        speedup = rows["triton bf16 cache"]["us"] / rows["triton fp8 cache"]["us"]
        print(f"  fp8 speedup over bf16 (Triton): {speedup:.2f}x (goal >= 1.7x)", flush=True)
        bk.ROWS.append({"group": group, "impl": "fp8 speedup (triton)", "speedup": speedup, "rel_err": rel})
    if "triton bf16 cache" in rows and "gluon fp8 cache (auto)" in rows:
        o_gl, _ = decode_fp8(q, fp8, table, lens, SCALE, backend="gluon")
        rel_gl = float((o_gl.float() - o_bf.float()).norm() / o_bf.float().norm())
        speedup = rows["triton bf16 cache"]["us"] / rows["gluon fp8 cache (auto)"]["us"]
        print(f"  fp8 speedup over bf16 (Gluon fp8 vs Triton bf16): {speedup:.2f}x (goal >= 1.7x)", flush=True)
        bk.ROWS.append({"group": group, "impl": "fp8 speedup (gluon)", "speedup": speedup, "rel_err": rel_gl})


def _time_rows(group, rows, o_ref, flops, nbytes):
    """Time each ``(impl, call)`` of ``rows`` (a call returns ``(out, lse)``), its output's normwise difference from
    ``o_ref`` (the Triton fp8 kernel's) in the note; a failing call becomes a row and the others still run."""
    for impl, call in rows:
        try:
            o, _ = call()
            torch.cuda.synchronize()
            note = f"rel diff vs triton fp8 {float((o.float() - o_ref.float()).norm() / o_ref.float().norm()):.2e}"
        except Exception as exc:
            note = f"{type(exc).__name__}: {exc}"[:200]
        bk.attempt(group, impl, call, flops, nbytes, note=note)


def _gluon64_row(group, q, fp8, table, lens, o_f8, flops, nbytes):
    """Backend "gluon64" (64 query rows a program, ``ops/triton/fp8_decode_gluon64.py``) where its kernel serves
    the call (its ``DEFAULTS``), then its kernel's variants (``launch`` with none of the ``VARIANTS`` flags, each
    alone, the two that serve any scale together, then all of them), each output's normwise difference from the
    Triton fp8 kernel's in the note."""
    from mla_compile.ops.triton import fp8_decode_gluon64

    if not fp8_decode_gluon64.eligible(q, fp8, DC):
        print("  gluon64: not eligible here (needs sm_90)", flush=True)
        return
    rows = [("gluon64 fp8 cache (64 rows a program)",
             lambda: decode_fp8(q, fp8, table, lens, SCALE, backend="gluon64"))]
    flags = fp8_decode_gluon64.VARIANTS
    sets = [(), *((k,) for k in flags), ("RESCALE_SKIP", "MAX_XCHG"), flags]  # RESCALE_SKIP+MAX_XCHG: any scale
    configs = [("+".join(on) or "no variant", {k: k in on for k in flags}) for on in sets]
    configs += [("defaults + TMA_OUT (one split's rows by TMA)", {"TMA_OUT": True})]
    for name, config in configs:
        rows.append((f"gluon64 fp8 cache {name}", lambda config=config: fp8_decode_gluon64.launch(
            q, fp8, table, lens, SCALE, DC, config=config)))
    _time_rows(group, rows, o_f8, flops, nbytes)


def write_case(T=4096):
    group = f"fp8 cache write T={T}"
    print(group, flush=True)
    pages = 2 * T // PAGE
    cache = torch.zeros(pages, PAGE, W, dtype=torch.uint8, device=DEV)
    lat = torch.randn(T, DC, device=DEV, dtype=torch.bfloat16)
    kpe = torch.randn(T, DR, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(pages * PAGE, device=DEV)[:T].int()
    nbytes = T * (DC + DR) * 2 + T * W
    for name in ("triton", "reference"):
        bk.attempt(group, name, lambda n=name: write_latent_cache_fp8(lat, kpe, slots, cache, backend=n), 0, nbytes)


def sparse_case(B, H, L, topk):
    group = f"sparse decode B={B} topk={topk} L={L} H={H}"
    print(group, flush=True)
    bf16, fp8, table, lens = _caches(B, L, seed=1)
    q = torch.randn(B, 1, H, D, device=DEV, dtype=torch.bfloat16)
    pos = torch.rand(B, L, device=DEV).topk(topk, dim=-1).indices  # distinct random positions
    idx = (table.long().gather(1, pos // PAGE) * PAGE + pos % PAGE).int()[:, None].contiguous()
    flops = 2 * B * H * topk * (D + DC)
    out_bytes = B * H * DC * 2
    bk.attempt(group, "triton bf16 cache", lambda: sparse_decode(q, bf16, idx, SCALE, backend="triton"),
               flops, B * topk * D * 2 + out_bytes)
    bk.attempt(group, "triton fp8 cache", lambda: sparse_decode(q, fp8, idx, SCALE, backend="triton"),
               flops, B * topk * W + out_bytes)
    _sparse_gluon64_rows(group, q, fp8, idx, flops, B * topk * W + out_bytes)
    _sparse_gluon64_rows(group, q, bf16, idx, flops, B * topk * D * 2 + out_bytes, kind="bf16")
    try:
        import flash_mla  # noqa: F401
        bk.attempt(group, "FlashMLA fp8 sparse", lambda: sparse_decode(q, fp8, idx, SCALE, backend="flashmla"),
                   flops, B * topk * W + out_bytes)
    except ImportError as exc:
        print(f"  FlashMLA unavailable: {exc!r}", flush=True)


def _sparse_gluon64_rows(group, q, cache, idx, flops, nbytes, kind="fp8"):
    """Backend "gluon64" of the sparse decode (``ops/triton/sparse_decode_gluon64.py``, sm_90) on the ``kind``
    cache where its kernel serves the call, then (fp8) its kernel with each flag of ``VARIANTS`` away from its
    default, and with 2 and 4 splits; each output's normwise difference from the Triton kernel's on the same cache
    in the note."""
    from mla_compile.ops.triton import sparse_decode_gluon64 as g

    if not g.eligible(q, cache, idx, DC):
        print("  sparse gluon64: not eligible here (needs sm_90)", flush=True)
        return
    o_ref, _ = sparse_decode(q, cache, idx, SCALE, backend="triton")
    rows = [(f"gluon64 {kind} sparse", lambda: sparse_decode(q, cache, idx, SCALE, backend="gluon64"))]
    configs = [(f"{k}={not g.DEFAULTS[k]}", {k: not g.DEFAULTS[k]}) for k in g.VARIANTS]  # each flag flipped alone
    configs += [(f"SPLITS={n}", {"SPLITS": n}) for n in (2, 4)] + [("TMA_OUT=True", {"TMA_OUT": True})]
    for name, config in configs if kind == "fp8" else ():
        rows.append((f"gluon64 {kind} sparse {name}", lambda config=config: g.launch(q, cache, idx, SCALE, DC,
                                                                                      config=config)))
    _time_rows(group, rows, o_ref, flops, nbytes)


IDX_H, IDX_D, TOPK = 64, 128, 2048  # DeepSeek-V3.2's indexer


def index_case(B, L, T_per_seq=1):
    """Lightning indexer over B sequences of L tokens, T_per_seq query tokens each (the last ones)."""
    T = B * T_per_seq
    group = f"lightning index T={T} (B={B} x {T_per_seq}) L={L}"
    print(group, flush=True)
    gen = torch.Generator(device=DEV).manual_seed(2)
    nblk = -(-L // PAGE)
    pages = B * nblk
    keys = torch.randn(pages, PAGE, IDX_D, device=DEV, generator=gen).bfloat16()
    caches = {"bf16": keys, "fp8": quantize_fp8_index(keys)}
    table = torch.randperm(pages, device=DEV, generator=gen).view(B, nblk).int().contiguous()
    lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
    q = torch.randn(T, IDX_H, IDX_D, device=DEV, generator=gen).bfloat16()
    w = torch.randn(T, IDX_H, device=DEV, generator=gen) / IDX_H ** 0.5
    qseq = torch.arange(B, device=DEV, dtype=torch.int32).repeat_interleave(T_per_seq)
    qpos = (L - T_per_seq + torch.arange(T_per_seq, device=DEV, dtype=torch.int32)).repeat(B)
    flops = 2 * T * L * IDX_H * IDX_D
    got = {}
    for kind, cache in caches.items():
        row = cache.shape[-1] * cache.element_size()
        nbytes = B * L * row + T * L * 4 * 2 + T * TOPK * 4  # keys once, scores written + read, slots
        for name in ("triton", "reference"):
            fn = (lambda c=cache, n=name: lightning_index(q, w, c, table, lens, qseq, qpos, topk=TOPK, backend=n))
            bk.attempt(group, f"{name} {kind} keys", fn, flops, nbytes)
            got[kind, name] = fn()
    _kernel_split(lambda: lightning_index(q, w, caches["bf16"], table, lens, qseq, qpos, topk=TOPK, backend="triton"))
    for kind in caches:  # the same selection up to score rounding: report the overlap of the two sets
        a, b = got[kind, "triton"].long(), got[kind, "reference"].long().sort(-1).values
        same = (b.gather(1, torch.searchsorted(b, a).clamp(max=b.shape[1] - 1)) == a).float().mean().item()
        print(f"  {kind} keys: triton vs reference top-k overlap {same:.4f}", flush=True)


def _kernel_split(fn, calls=3, top=8):
    """Print where one call's GPU time goes (torch.profiler, per kernel, us per call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))
    for e in rows[:top]:
        us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / calls
        print(f"    {us:9.1f} us/call  {e.key[:90]}", flush=True)


def index_write_case(T=4096):
    group = f"index cache write T={T}"
    print(group, flush=True)
    pages = 2 * T // PAGE
    k = torch.randn(T, IDX_D, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(pages * PAGE, device=DEV)[:T].int()
    for kind, cache in (("bf16", torch.zeros(pages, PAGE, IDX_D, dtype=torch.bfloat16, device=DEV)),
                        ("fp8", torch.zeros(pages, PAGE, IDX_D + 4, dtype=torch.uint8, device=DEV))):
        nbytes = T * IDX_D * 2 + T * cache.shape[-1] * cache.element_size()
        for name in ("triton", "reference"):
            bk.attempt(group, f"{name} {kind}", lambda n=name, c=cache: write_index_cache(k, slots, c, backend=n),
                       0, nbytes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="only the H=16 dense and sparse cases")
    ap.add_argument("--index-only", action="store_true", help="only the lightning indexer and its cache write")
    ap.add_argument("--sparse-only", action="store_true",
                    help="only the sparse decodes: B=128 topk 2048 over L=8192, H=16 and H=128")
    ap.add_argument("--dense-only", action="store_true",
                    help="only the dense fp8 decodes: B=128 L=8192 H=16, B=128 L=4096 H=128, B=1 L=8192 H=128")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bk.ceilings()
    sections = [lambda: dense_case(128, 16, 8192), lambda: sparse_case(128, 16, 8192, 2048), write_case]
    index = [lambda: index_case(128, 8192), lambda: index_case(1, 8192, 2048), index_write_case]
    sections = index if args.index_only else sections + index
    if not args.quick and not args.index_only:
        sections += [lambda: dense_case(128, 128, 4096), lambda: dense_case(1, 128, 8192),
                     lambda: sparse_case(128, 128, 8192, 2048)]
    if args.dense_only:
        sections = [lambda: dense_case(128, 16, 8192), lambda: dense_case(128, 128, 4096),
                    lambda: dense_case(1, 128, 8192)]
    if args.sparse_only:
        sections = [lambda: sparse_case(128, 16, 8192, 2048), lambda: sparse_case(128, 128, 8192, 2048)]
    bk.run_sections(sections, os.path.join(args.out, "bench_fp8_sparse.json"))
    lines = [bk._fmt(r) if "speedup" not in r else f"{r['impl']:30s} {r['speedup']:.2f}x (rel err {r['rel_err']:.2%})"
             for r in bk.ROWS]
    text = "\n".join(f"{r.get('group', '')}: {line}" for r, line in zip(bk.ROWS, lines))
    with open(os.path.join(args.out, "bench_fp8_sparse.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
