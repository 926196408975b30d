"""Attention core of a decode step with and without ``mla_compile.lowerings``, one run.

For each head count and batch: norm + rope + cache write of the new token and the absorbed decode over
``--context`` cached tokens (DeepSeek 512 + 64), compiled in three variants: ``static`` (backend
auto, no passes), ``passes`` (+ the fusion pass) and ``lowered`` (decode backend "autotune" + the pass).
Times are CUDA-event medians of ``--iters``; outputs are compared with the static variant. Prints a
table and the autotune choices; ``--json`` writes them. (Layer-level, not the whole model.)

    python benchmarks/bench_lowerings.py --heads 16 128 --batches 1 32 128 --context 4096 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def _time(fn, iters: int) -> float:
    if not torch.cuda.is_available():
        import time
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _fixture(B, H, context, block_size, dtype, dev, variant):
    """The attention core of one decode layer: norm + rope + cache write of the new token, then the
    absorbed decode over ``context`` cached tokens (DeepSeek dims 512 + 64)."""
    import mla_compile
    from mla_compile.ops.fused_kv_write import rms_norm
    from mla_compile.models.rope import apply_rope

    nb = -(-(context + 1) // block_size)
    g = torch.Generator(device=dev).manual_seed(B)
    cache = torch.randn(B * nb + 1, block_size, 576, device=dev, generator=g).to(dtype)
    bt = torch.arange(B * nb, device=dev, dtype=torch.int32).view(B, nb)
    sl = torch.full((B,), context + 1, device=dev, dtype=torch.int32)
    slots = (bt[:, context // block_size].long() * block_size + context % block_size)
    kv_a = torch.randn(B, 576, device=dev, generator=g).to(dtype)
    w = torch.randn(512, device=dev, generator=g).to(dtype)
    cos, sin = torch.randn(B, 32, device=dev, generator=g), torch.randn(B, 32, device=dev, generator=g)
    q = torch.randn(B, 1, H, 576, device=dev, generator=g).to(dtype)
    backend = "autotune" if variant == "lowered" else None
    torch._dynamo.mark_static_address(cache)

    def step(q, kv_a, w, cos, sin, slots, bt, sl):
        latent, k_pe = kv_a.split([512, 64], -1)
        mla_compile.ops.write_latent_cache(rms_norm(latent, w, 1e-6), apply_rope(k_pe, cos, sin, True), slots, cache)
        return mla_compile.ops.decode(q, cache, bt, sl, 0.07, kv_lora_rank=512, backend=backend)[0]

    return step, (q, kv_a, w, cos, sin, slots, bt, sl)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import mla_compile.lowerings as lowerings
    from mla_compile.ops import _compile_log

    dev = args.device
    rows, mark = [], _compile_log.mark()
    for H in args.heads:
      for B in args.batches:
        ref = None
        for variant, options in (("static", {}), ("passes", lowerings.compile_options(True)),
                                 ("lowered", lowerings.compile_options(True))):
            step, inputs = _fixture(B, H, args.context, args.block_size, getattr(torch, args.dtype), dev, variant)
            torch._dynamo.reset()
            with torch._inductor.config.patch(dict(options, force_disable_caches=True)):
                compiled = torch.compile(step, fullgraph=True)
                out = compiled(*inputs)
                for _ in range(3):
                    compiled(*inputs)
                ms = _time(lambda: compiled(*inputs), args.iters)
            same = None if ref is None else bool(torch.allclose(out.float(), ref.float(), atol=5e-2, rtol=5e-2))
            ref = out if ref is None else ref
            rows.append(dict(heads=H, batch=B, variant=variant, ms=round(ms, 4), equal_to_static=same))
            print(f"H={H:3d} B={B:4d} {variant:8s} {ms:8.3f} ms  equal_to_static={same}", flush=True)
    choices = [r.__dict__ for r in _compile_log.records_since(mark)]
    for c in choices:
        print(f"autotune {c['shapes']}: {c['winner']} ({c['winner_backend']}) {c['timings_ms']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, autotune=choices, torch=torch.__version__), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
