"""Sink + sliding-window decode (``patch(..., sparse="sink_window")``) against dense decode on long contexts:
cache memory per sequence and decode-step time, one run.

    python benchmarks/bench_sink_window.py --out OUT_DIR [--ctx 8192,131072] [--batches 1,16] [--window 4096]
    python benchmarks/bench_sink_window.py --device cpu --tiny --out /tmp/bsw      # CPU smoke test

The model: a DeepSeek-V2-Lite-dims attention slice (random weights; hidden 2048, 16 heads, kv_lora 512 + rope
64, ``--layers`` layers, dense MLP), bf16 on CUDA. Every sequence decodes one token at position ``ctx`` over a
context already in the cache (random rows). Dense: every block of the context is held. Sink + window: only the
blocks the rule reads (the first ``--sink`` positions and the last ``--window``) are held; every other table
entry points at one null block, as the engine's windowed ``BlockManager`` leaves it (``release_outside``).
Rows: dense / sink_window, each eager and compiled (``torch.compile(fullgraph=True)``; Inductor on CUDA,
aot_eager on CPU). Per row: ms per step (median of ``--iters``, CUDA events on a GPU) and cache bytes per
sequence (held blocks x block bytes x layers; on CUDA also the allocator's bytes for the whole cache). Writes
``bench_sink_window.json`` / ``.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_v4_decode import timed  # noqa: E402  (median CUDA-event step time, first call timed alone)

FULL = dict(layers=1, hidden=2048, heads=16, kv_lora=512, rope=64, nope=128, v=128, inter=2048, vocab=32768,
            batches="1,16", ctx="8192,131072", sink=4, window=4096, block_size=64, warmup=3, iters=20)
TINY = dict(layers=1, hidden=64, heads=2, kv_lora=32, rope=16, nope=16, v=16, inter=64, vocab=97,
            batches="1,2", ctx="256", sink=4, window=32, block_size=16, warmup=1, iters=3)


def build(a, dev: torch.device, dtype: torch.dtype, sparse: bool):
    """The patched model (dense, or sink + window), random weights from ``a.seed``."""
    from mla_compile.app import toy
    from mla_compile.models.model import patch

    hf = toy.toy_hf_model("v2-lite", seed=a.seed, dtype=dtype, device=dev, vocab_size=a.vocab,
                          hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                          num_attention_heads=a.heads, num_key_value_heads=a.heads, kv_lora_rank=a.kv_lora,
                          qk_nope_head_dim=a.nope, qk_rope_head_dim=a.rope, v_head_dim=a.v,
                          first_k_dense_replace=a.layers, max_position_embeddings=1 << 20)
    return patch(hf, sparse="sink_window", sink=a.sink, window=a.window) if sparse else patch(hf)


def tables(a, batch: int, ctx: int, sparse: bool) -> tuple[list[list[int]], int]:
    """Each sequence's block list for a decode at position ``ctx``, and the cache's block count. Sparse: only
    the blocks the rule reads are real, the rest point at block 0 (the windowed manager's null block)."""
    bs = a.block_size
    n = ctx // bs + 1
    if not sparse:
        return [list(range(b * n, (b + 1) * n)) for b in range(batch)], batch * n
    keep = [i for i in range(n) if i * bs < a.sink or (i + 1) * bs > ctx + 1 - a.window]
    out, at = [], 1
    for _ in range(batch):
        row = [0] * n
        for i in keep:
            row[i], at = at, at + 1
        out.append(row)
    return out, at


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke test)")
    p.add_argument("--batches")
    p.add_argument("--ctx")
    p.add_argument("--layers", type=int)
    p.add_argument("--sink", type=int)
    p.add_argument("--window", type=int)
    p.add_argument("--iters", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    from mla_compile.models.metadata import SeqChunk, mark_dynamic, plan_step

    start = time.time()
    info = dict(args=vars(args), device=str(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
                torch=torch.__version__)
    rows = []
    batches = [int(x) for x in args.batches.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    for kind in ("dense", "sink_window"):
        model = build(args, dev, dtype, kind == "sink_window")
        compiled = torch.compile(model, fullgraph=True, backend="inductor" if dev.type == "cuda" else "aot_eager")
        for ctx in ctxs:
            for b in batches:
                blocks, num_blocks = tables(args, b, ctx, kind == "sink_window")
                held = sum(len(set(r) - {0}) if kind == "sink_window" else len(r) for r in blocks) // b
                row_bytes = (args.kv_lora + args.rope) * torch.tensor([], dtype=dtype).element_size()
                base = dict(kind=kind, batch=b, ctx=ctx, blocks_per_seq=held,
                            cache_bytes_per_seq=held * args.block_size * row_bytes * args.layers)
                try:
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                        before = torch.cuda.memory_allocated(dev)
                    model.allocate_cache(num_blocks, args.block_size)
                    for attn in model.attentions:
                        attn.kv_cache.normal_()  # a context already in the cache
                    if dev.type == "cuda":
                        base["cache_bytes_allocated"] = torch.cuda.memory_allocated(dev) - before
                    ids = torch.randint(0, args.vocab, (b,)).tolist()
                    step = plan_step([SeqChunk(blk, [t], ctx) for blk, t in zip(blocks, ids)], [], args.block_size,
                                     max_blocks=len(blocks[0])).to(dev)
                    mark_dynamic(step.input_ids, step.positions, step.meta)
                    args_in = (step.input_ids, step.positions, step.meta)
                except Exception as exc:
                    base["error"] = f"{type(exc).__name__}: {exc}"[:400]
                    rows.append(base)
                    print(f"{kind} B={b} ctx={ctx}: {base['error']}", flush=True)
                    continue
                for impl, fn in (("eager", model), ("compiled", compiled)):
                    row = dict(base, impl=impl)
                    try:
                        with torch.no_grad():
                            row.update(timed(lambda: fn(*args_in), dev, args.warmup, args.iters))
                        row["tok_s"] = b / (row["ms"] / 1e3)
                    except Exception as exc:  # keep measuring; the reason goes into the table
                        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                        traceback.print_exc(limit=4)
                    rows.append(row)
                    cell = row.get("error") or f"{row['ms']:.3f} ms ({row['tok_s']:.0f} tok/s)"
                    print(f"[{time.time() - start:7.1f}s] {kind:11s} {impl:8s} B={b:<4d} ctx={ctx:<7d} "
                          f"{row['cache_bytes_per_seq'] / 2**20:9.2f} MiB/seq  {cell}", flush=True)
                    with open(os.path.join(args.out, "bench_sink_window.json"), "w") as f:
                        json.dump(dict(info=info, rows=rows), f, indent=1, default=str)
                model.allocate_cache(1, args.block_size)  # give the context's cache back before the next
        del model, compiled
    lines = [f"sink + window vs dense decode ({info['device']}, {args.layers} layer(s), sink {args.sink}, "
             f"window {args.window}, block size {args.block_size})"]
    for r in rows:
        cell = r.get("error") or f"{r['ms']:.3f} ms  {r['tok_s']:.0f} tok/s"
        lines.append(f"{r['kind']:11s} {r.get('impl', '-'):8s} B={r['batch']:<4d} ctx={r['ctx']:<7d} "
                     f"{r['cache_bytes_per_seq'] / 2**20:9.2f} MiB/seq  {cell}")
    with open(os.path.join(args.out, "bench_sink_window.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
