"""The decode step with and without ``mla_compile.lowerings``, in one process, replays interleaved.

    python benchmarks/bench_lowered_step.py --out OUT_DIR [--batches 1,8,64,256] [--ctx 4096] [--iters 30]
    python benchmarks/bench_lowered_step.py --out OUT_DIR --b-passes-only     # B = static backends + passes
    MLA_COMPILE_PASSES=fuse_absorb_q,fuse_absorb_out python benchmarks/bench_lowered_step.py --out OUT_DIR \
        --b-passes-only                                                     # one pass (or a few) at a time
    python benchmarks/bench_lowered_step.py --out OUT_DIR --kv-cache fp8   # the 656-byte fp8 latent cache
    python benchmarks/bench_lowered_step.py --out /tmp/bls --device cpu --tiny --iters 2   # CPU smoke run

Issue #7's check ("the decode step with lowerings and passes is at least as fast as without, measured in
one run; outputs equal"). Two copies of ``bench_decode_step``'s seeded V2-Lite-shaped model (same weights,
same context latents, one shared ``MetadataBuilder``): **A** = the static backends (``--backend``, default
auto) compiled without passes; **B** = ``decode=autotune`` through the Inductor lowering, compiled with
the MLA fusion passes (``--b-passes-only``: B keeps A's backends and only adds the passes). Each is
captured by ``DecodeGraphRunner`` at the same sizes. Per batch: the first step's logits of A and B are
compared; then ``--iters`` graph replays of A and B alternate (one after the other, so clock and cache
drift hit both alike) and the median GPU time of each (CUDA events) is reported, with B/A. Also: the
passes that fired (and sites left alone, with the reason) and each autotune decision with its timings.
Writes ``bench_lowered_step.json`` and ``.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_step as bds  # noqa: E402  (build_hf, Workload, parse_args: the same model and workload)


def _compiled(args, dev, dtype, wl, backend: str, passes: bool):
    from mla_compile.models.model import patch
    import mla_compile.lowerings as lowerings

    model = patch(bds.build_hf(args, dev, dtype), backend=backend)
    fp8 = args.kv_cache == "fp8"
    for i, cache in enumerate(model.allocate_cache(wl.num_blocks, wl.bs, dtype="fp8" if fp8 else None)):
        bds.fill_cache(cache, wl.latents(i), wl.dc, fp8)
    return torch.compile(model, fullgraph=True, options=lowerings.compile_options(passes=True) if passes else None)


def _replay_ms(graph) -> float:
    """One replay's GPU time; on CPU (no capture) ``graph`` is an uncaptured step, timed by the host clock."""
    if callable(graph):
        t = time.perf_counter()
        graph()
        return (time.perf_counter() - t) * 1e3
    return bds.replay_ms(graph)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b-passes-only", action="store_true", help="B = A's static backends + the fusion passes")
    ap.add_argument("--b-backend", default="decode=autotune", help="B's backend (default decode=autotune)")
    own, rest = ap.parse_known_args(argv)
    args = bds.parse_args(rest)
    fresh = None
    if not args.warm_cache:  # a fresh Inductor cache: passes and autotuning run (a cache hit skips both)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh = tempfile.mkdtemp(prefix="bench_lowered_inductor_")
    from torch._dynamo.utils import counters

    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from mla_compile.ops import _compile_log

    os.makedirs(args.out, exist_ok=True)
    dev, dtype = torch.device(args.device), args.torch_dtype
    t0 = time.perf_counter()
    import mla_compile  # noqa: F401  (registers the ops)
    from mla_compile.models.config import preset

    mla = preset("deepseek-v2-lite")  # the latent dims (512 + 64), which the toy model keeps
    torch.manual_seed(args.seed)
    wl = bds.Workload(args, dev, dtype, mla.kv_lora_rank, mla.qk_rope_head_dim)
    b_backend = args.backend if own.b_passes_only else own.b_backend
    a = _compiled(args, dev, dtype, wl, args.backend, passes=False)
    b = _compiled(args, dev, dtype, wl, b_backend, passes=True)
    builder = MetadataBuilder(max_batch=wl.max_batch, max_blocks_per_seq=wl.nb, max_tokens=wl.max_batch,
                              block_size=wl.bs, device=dev)
    sizes = sorted({max(x, 2) for x in args.batch_list})
    mark, passes0, skipped0 = _compile_log.mark(), dict(counters["mla_passes"]), dict(counters["mla_passes_skipped"])
    runners = {}
    for name, fn in (("A", a), ("B", b)):
        runners[name] = DecodeGraphRunner(fn, builder, capture_sizes=sizes)
        runners[name].capture()
    rows = []
    for batch in args.batch_list:
        ctx = max(args.ctx_list)
        chunks = wl.chunks(batch, ctx, 0)
        la = runners["A"].decode(chunks).float().clone()
        lb = runners["B"].decode(chunks).float().clone()  # stages the same metadata for this size: A replays it too
        rel = float((la - lb).norm() / la.norm())
        graphs = {k: (r.graphs[r.graph_size(batch)][0] if r.enabled else (lambda r=r: r.decode(chunks)))
                  for k, r in runners.items()}
        for g in graphs.values():  # warm both
            _replay_ms(g)
        times = {"A": [], "B": []}
        for _ in range(args.iters):
            for k in ("A", "B"):
                times[k].append(_replay_ms(graphs[k]))
        ma, mb = statistics.median(times["A"]), statistics.median(times["B"])
        spread = {k: (min(v), max(v)) for k, v in times.items()}
        rows.append(dict(batch=batch, ctx=ctx, a_ms=ma, b_ms=mb, b_over_a=mb / ma, logits_rel_err=rel,
                         a_range=spread["A"], b_range=spread["B"]))
        print(f"B={batch:4d} ctx={ctx}: A {ma:.3f} ms, B {mb:.3f} ms, B/A {mb / ma:.3f}, logits rel err {rel:.1e}",
              flush=True)
    info = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "A": f"backend {args.backend}, no passes", "B": f"backend {b_backend}, fusion passes",
        "passes_fired": {k: v - passes0.get(k, 0) for k, v in counters["mla_passes"].items()},
        "passes_skipped": {k: v - skipped0.get(k, 0) for k, v in counters["mla_passes_skipped"].items()},
        "autotune": [{"op": r.op, "shapes": r.shapes, "winner": r.winner, "timings_ms": r.timings_ms}
                     for r in _compile_log.records_since(mark)],
        "total_s": round(time.perf_counter() - t0, 1),
    }
    lines = [f"{info['device']}, torch {info['torch']}, {args.kv_cache} latent cache; A = {info['A']}; B = {info['B']}",
             f"passes fired in B: {info['passes_fired'] or 'none'}"
             + (f"; left alone: {info['passes_skipped']}" if info["passes_skipped"] else ""),
             *[f"autotune {r['op']} {r['shapes']}: {r['winner']}  "
               + ", ".join(f"{k} {v:.4f}" for k, v in r["timings_ms"].items() if v is not None) for r in info["autotune"]],
             "graph replay, median of interleaved replays (ms):",
             f"{'batch':>6} {'A':>9} {'B':>9} {'B/A':>7} {'A min-max':>17} {'B min-max':>17} {'logits rel err':>15}"]
    lines += [f"{r['batch']:>6} {r['a_ms']:9.3f} {r['b_ms']:9.3f} {r['b_over_a']:7.3f} "
              f"{r['a_range'][0]:8.3f}-{r['a_range'][1]:<8.3f} {r['b_range'][0]:8.3f}-{r['b_range'][1]:<8.3f} "
              f"{r['logits_rel_err']:15.1e}" for r in rows]
    text = "\n".join(lines)
    with open(os.path.join(args.out, "bench_lowered_step.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "bench_lowered_step.json"), "w") as f:
        json.dump({"info": info, "rows": rows, "argv": sys.argv[1:]}, f, indent=1)
    if fresh is not None:
        shutil.rmtree(fresh, ignore_errors=True)
    print("\n" + text)


if __name__ == "__main__":
    main()
