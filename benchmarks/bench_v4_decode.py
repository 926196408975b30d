"""Decode-step latency of a DeepSeek-V4-Flash-dims slice through mla_compile (random weights), one run.

    python benchmarks/bench_v4_decode.py --out OUT_DIR [--batches 1,64,256] [--ctx 8192,131072] [--backend triton]
    python benchmarks/bench_v4_decode.py --device cpu --tiny --out /tmp/bv4      # CPU smoke test
    python benchmarks/bench_v4_decode.py --attention --out OUT_DIR [--attn-backends triton,flashmla]

The slice: hidden 4096, 64 heads of 512 (rope 64), q_lora 1024, o_groups 8 x 1024, 256 experts top-6
(moe 2048, sqrtsoftplus; the first layer hash-routed), mHC 4 streams, window 128, CSA rate 4 with the
indexer (64 heads x 128, top-512), HCA rate 128; ``--layers`` repeats of (sliding, CSA, HCA), bf16 on CUDA.
Every sequence decodes one token at position ``ctx`` over a context already in the caches (random rows:
the window's token rows, every compressed entry and indexer key, the compressors' ring state). Only the
window's token blocks are real: older positions map to one shared block that the step never reads.
Rows: ours eager, ours compiled (``torch.compile(fullgraph=True)``), ours compiled + CUDA graph (one
captured step replayed). A step's time is the median over ``--iters`` of CUDA events around the step.
HF is not measured: its eager attention materializes [S, S] scores at prefill and its V4 model cannot
compile whole (``_can_compile_fullgraph = False``). Also written: cache bytes per sequence at each
context and at 1M tokens (``mla_compile.models.v4_cache``). Writes ``bench_v4_decode.json`` / ``.txt`` under ``--out``.

``--attention`` times the ``v4_attention`` op alone instead, per backend (our Triton kernel, FlashMLA's sparse
kernel): one decode row per sequence at position ``ctx`` with V4-Flash dims (64 heads of 512, rope 64), for each
layer kind: sliding (the 128-row window), CSA (window + top-512 of the ``ctx / 4`` compressed entries) and HCA
(window + all ``ctx / 128`` entries); the median per-call time of a replayed CUDA graph of one call (eager
medians on CPU). Writes ``bench_v4_attention.json`` / ``.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import torch

FULL = dict(layers=1, hidden=4096, heads=64, head_dim=512, rope=64, q_lora=1024, experts=256, topk=6, moe=2048,
            vocab=129280, o_groups=8, o_lora=1024, idx_heads=64, idx_dim=128, idx_topk=512, window=128, csa=4,
            hca=128, hc=4, batches="1,64,256", ctx="8192,131072", block_size=64, warmup=3, iters=20)
TINY = dict(layers=1, hidden=64, heads=4, head_dim=64, rope=16, q_lora=32, experts=8, topk=2, moe=32, vocab=512,
            o_groups=2, o_lora=16, idx_heads=4, idx_dim=32, idx_topk=8, window=8, csa=4, hca=16, hc=2,
            batches="1,4", ctx="64,256", block_size=16, warmup=1, iters=3)


def build_model(a, dev: torch.device, dtype: torch.dtype):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * a.layers
    cfg = DeepseekV4Config(
        vocab_size=a.vocab, hidden_size=a.hidden, moe_intermediate_size=a.moe, num_hidden_layers=len(kinds),
        num_attention_heads=a.heads, head_dim=a.head_dim, q_lora_rank=a.q_lora, partial_rotary_factor=a.rope / a.head_dim,
        num_experts_per_tok=a.topk, n_routed_experts=a.experts, layer_types=kinds,
        compress_rates={"compressed_sparse_attention": a.csa, "heavily_compressed_attention": a.hca},
        mlp_layer_types=["hash_moe"] + ["moe"] * (len(kinds) - 1), hc_mult=a.hc, sliding_window=a.window,
        o_groups=a.o_groups, o_lora_rank=a.o_lora, index_n_heads=a.idx_heads, index_head_dim=a.idx_dim,
        index_topk=a.idx_topk, max_position_embeddings=1 << 20)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            hf = DeepseekV4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(dev).manual_seed(a.seed)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, a.experts, b.shape, generator=gen, device=dev))
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(generator=gen)
    return hf


class Contexts:
    """Block tables for ``max_batch`` sequences at ``ctx`` tokens: the window's token blocks are real, older
    positions share block 0 (never read); every compressed entry has its own row."""

    def __init__(self, a, model, max_batch: int, ctx: int, dev: torch.device):
        bs = a.block_size
        self.bs, self.ctx, self.dev = bs, ctx, dev
        nb = -(-(ctx + 1) // bs)
        live = -(-a.window // bs) + 1  # blocks that can hold the window's positions
        first = max(nb - live, 0)
        self.table = torch.zeros(max_batch, nb, dtype=torch.int32)
        self.table[:, first:] = 1 + torch.arange(max_batch * (nb - first), dtype=torch.int32).view(max_batch, -1)
        self.num_blocks = 1 + max_batch * (nb - first)
        self.entry = {}
        counts = {}
        for r in model.rates:
            ne = -(-((ctx + 1) // r) // bs) or 1
            self.entry[r] = torch.arange(max_batch * ne, dtype=torch.int32).view(max_batch, ne)
            counts[r] = max_batch * ne
        model.allocate_cache(self.num_blocks, bs, counts, max_batch)
        gen = torch.Generator(dev).manual_seed(a.seed + 1)
        with torch.no_grad():
            for attn in model.attn:
                for t in [attn.kv_cache, attn.comp_cache, attn.index_cache] + [x for p in attn.state.values() for x in p]:
                    if t is not None:
                        t.normal_(generator=gen)

    def step(self, batch: int, ids: torch.Tensor):
        from mla_compile.models.v4_model import V4Metadata

        pos = torch.full((batch,), self.ctx, dtype=torch.int32)
        table = self.table[:batch]
        slots = table[:, self.ctx // self.bs].long() * self.bs + self.ctx % self.bs
        meta = V4Metadata(torch.arange(batch, dtype=torch.int32), torch.full((batch,), self.ctx + 1, dtype=torch.int32),
                          table.clone(), slots, torch.arange(batch, dtype=torch.int32),
                          {r: t[:batch].clone() for r, t in self.entry.items()}, torch.arange(batch))
        return ids[:batch].to(self.dev), pos.to(self.dev), meta.to(self.dev)


def timed(fn, dev: torch.device, warmup: int, iters: int) -> dict:
    """``{"ms": median of ``iters`` timed calls of ``fn`` (CUDA events on a GPU), "first_call_s": the first call
    alone (compile included)}``, after ``warmup`` calls."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return dict(ms=statistics.median(times), first_call_s=first)


def attention_case(a, kind: str, batch: int, ctx: int, dev: torch.device, dtype: torch.dtype) -> tuple:
    """``v4_attention``'s arguments for ``batch`` decode rows at position ``ctx``: each sequence's window rows
    and compressed entries are its own contiguous region of the caches (random values), CSA picks ``idx_topk``
    distinct visible entries at random, HCA lists every visible entry."""
    gen = torch.Generator().manual_seed(a.seed)
    W, D, bs = a.window, a.head_dim, a.block_size
    nb = -(-batch * W // bs)
    kv = torch.randn(nb, bs, D, generator=gen).to(dtype)
    ws = (torch.arange(batch)[:, None] * W + torch.arange(W)[None, :]).to(torch.int32)
    rate = {"sliding": 0, "CSA": a.csa, "HCA": a.hca}[kind]
    if rate == 0:
        comp, cs = kv, ws[:, :0]
    else:
        n = (ctx + 1) // rate
        comp = torch.randn(-(-batch * n // bs), bs, D, generator=gen).to(dtype)
        if kind == "CSA":
            k = min(a.idx_topk, n)
            cs = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(batch)])
        else:
            cs = torch.arange(n)[None, :].expand(batch, n)
        cs = (cs + torch.arange(batch)[:, None] * n).to(torch.int32)
    q = torch.randn(batch, a.heads, D, generator=gen).to(dtype)
    sinks = torch.randn(a.heads, generator=gen)
    pos = torch.full((batch,), ctx, dtype=torch.int32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, a.rope, 2, dtype=torch.float32) / a.rope))
    return tuple(t.to(dev) for t in (q, kv, ws, comp, cs, sinks, pos, inv_freq))


def attention_main(a, dev: torch.device) -> int:
    """The ``--attention`` run: ``v4_attention`` per backend, layer kind, batch and context."""
    from mla_compile.ops import v4_attention

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    backends = a.attn_backends.split(",") if dev.type == "cuda" else ["reference"]
    start, rows = time.time(), []
    for ctx in (int(x) for x in a.ctx.split(",")):
        for kind in ("sliding", "CSA", "HCA"):
            for b in (int(x) for x in a.batches.split(",")):
                args = attention_case(a, kind, b, ctx, dev, dtype)
                for name in backends:
                    row = dict(backend=name, kind=kind, batch=b, ctx=ctx, heads=a.heads, head_dim=a.head_dim,
                               slots=args[2].shape[1] + args[4].shape[1])
                    call = lambda: v4_attention(*args, a.head_dim ** -0.5, backend=name)  # noqa: E731
                    try:
                        if time.time() - start > a.budget_s:
                            row["skipped"] = "time budget"
                        elif dev.type == "cuda":
                            for _ in range(2):
                                call()
                            torch.cuda.synchronize()
                            graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(graph):
                                call()
                            row.update(timed(graph.replay, dev, a.warmup, a.iters))
                        else:
                            row.update(timed(call, dev, a.warmup, a.iters))
                    except Exception as exc:  # keep measuring; the reason goes into the table
                        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                        traceback.print_exc(limit=4)
                    rows.append(row)
                    cell = row.get("skipped") or row.get("error") or f"{row['ms'] * 1e3:9.1f} us"
                    print(f"[{time.time() - start:6.1f}s] {kind:7s} B={b:<4d} ctx={ctx:<7d} {name:10s} {cell}",
                          flush=True)
                del args
    info = dict(args=vars(a), device=str(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
                torch=torch.__version__)
    with open(os.path.join(a.out, "bench_v4_attention.json"), "w") as f:
        json.dump(dict(info=info, rows=rows), f, indent=1, default=str)
    lines = [f"v4_attention per call ({info['device']}, {a.heads} heads x {a.head_dim}, window {a.window}, "
             f"CSA top-{a.idx_topk} of ctx/{a.csa}, HCA ctx/{a.hca}; CUDA-graph replay median)"]
    for r in rows:
        cell = r.get("skipped") or r.get("error") or f"{r['ms'] * 1e3:9.1f} us"
        lines.append(f"{r['kind']:7s} B={r['batch']:<4d} ctx={r['ctx']:<7d} slots={r['slots']:<5d} "
                     f"{r['backend']:10s} {cell}")
    with open(os.path.join(a.out, "bench_v4_attention.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke test)")
    p.add_argument("--batches")
    p.add_argument("--ctx")
    p.add_argument("--layers", type=int)
    p.add_argument("--backend", default=None, help="V4 ops' backend (reference, triton; default: the model's)")
    p.add_argument("--iters", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=1e9)
    p.add_argument("--attention", action="store_true", help="time the v4_attention op per backend instead")
    p.add_argument("--attn-backends", default="triton,flashmla", help="backends --attention compares on CUDA")
    args = p.parse_args(argv)
    if args.attention and args.ctx is None and not args.tiny:
        args.ctx = "8192"  # the op alone: V4-Flash at 8k unless asked
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)
    if args.attention:
        return attention_main(args, dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    start = time.time()
    from mla_compile.models.model import patch
    from mla_compile.models.v4_cache import V4CacheLayout, V4Dims

    hf = build_model(args, dev, dtype)
    model = patch(hf, backend=args.backend)
    layout = V4CacheLayout(V4Dims.from_hf(hf.config), "bf16")
    batches = [int(x) for x in args.batches.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    ids = torch.randint(0, args.vocab, (max(batches),))
    rows = []
    info = dict(args=vars(args), device=str(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
                torch=torch.__version__, bytes_per_seq_1m=layout.sequence_bytes(1 << 20),
                bytes_per_token=layout.model_bytes_per_token)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if dev.type == "cuda" else "aot_eager")
    for ctx in ctxs:
        contexts = Contexts(args, model, max(batches), ctx, dev)
        for b in batches:
            step_in = contexts.step(b, ids)
            for impl in ("ours eager", "ours compiled", "ours graph"):
                row = dict(impl=impl, batch=b, ctx=ctx, cache_bytes_per_seq=layout.sequence_bytes(ctx))
                if time.time() - start > args.budget_s:
                    row["skipped"] = "time budget"
                elif impl == "ours graph" and dev.type != "cuda":
                    row["skipped"] = "needs CUDA"
                else:
                    try:
                        with torch.no_grad():
                            if impl == "ours eager":
                                row.update(timed(lambda: model(*step_in), dev, args.warmup, args.iters))
                            elif impl == "ours compiled":
                                row.update(timed(lambda: compiled(*step_in), dev, args.warmup, args.iters))
                            else:
                                for _ in range(2):
                                    compiled(*step_in)
                                torch.cuda.synchronize()
                                graph = torch.cuda.CUDAGraph()
                                with torch.cuda.graph(graph):
                                    compiled(*step_in)
                                row.update(timed(graph.replay, dev, args.warmup, args.iters))
                        row["tok_s"] = b / (row["ms"] / 1e3)
                    except Exception as exc:  # keep measuring; the reason goes into the table
                        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                        traceback.print_exc(limit=4)
                rows.append(row)
                cell = row.get("skipped") or row.get("error") or f"{row['ms']:.3f} ms ({row['tok_s']:.0f} tok/s)"
                print(f"[{time.time() - start:7.1f}s] {impl:14s} B={b:<4d} ctx={ctx:<7d} {cell}", flush=True)
                with open(os.path.join(args.out, "bench_v4_decode.json"), "w") as f:
                    json.dump(dict(info=info, rows=rows), f, indent=1, default=str)
        del contexts
    lines = [f"V4 decode step ({info['device']}, {args.layers} x (sliding, CSA, HCA), backend {args.backend or 'default'})",
             f"cache bytes per token of context {layout.model_bytes_per_token:.0f}; "
             f"per sequence at 1M tokens {layout.sequence_bytes(1 << 20) / 2**30:.3f} GiB (bf16)"]
    for r in rows:
        cell = r.get("skipped") or r.get("error") or f"{r['ms']:.3f} ms  {r['tok_s']:.0f} tok/s"
        lines.append(f"{r['impl']:14s} B={r['batch']:<4d} ctx={r['ctx']:<7d} {cell}")
    with open(os.path.join(args.out, "bench_v4_decode.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
