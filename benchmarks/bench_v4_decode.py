"""Decode-step latency of a DeepSeek-V4-Flash-dims slice through mla_compile (random weights), one run.

    python benchmarks/bench_v4_decode.py --out OUT_DIR [--batches 1,64,256] [--ctx 8192,131072] [--backend triton]
        [--impls "ours eager,ours compiled,ours graph,hf eager,hf compiled"] [--budget-s S] [--regional-compile]
        [--profile-replay] [--weights float|fp8|fp4]
    python benchmarks/bench_v4_decode.py --device cpu --tiny --out /tmp/bv4      # CPU smoke test
    python benchmarks/bench_v4_decode.py --attention --out OUT_DIR [--attn-backends triton,flashmla]
    torchrun --nproc-per-node P benchmarks/bench_v4_decode.py --parallel tp|dp --out OUT_DIR --impls "ours graph"

The slice: hidden 4096, 64 heads of 512 (rope 64), q_lora 1024, o_groups 8 x 1024, 256 experts top-6
(moe 2048, sqrtsoftplus; the first layer hash-routed), mHC 4 streams, window 128, CSA rate 4 with the
indexer (64 heads x 128, top-512), HCA rate 128; ``--layers`` repeats of (sliding, CSA, HCA), bf16 on CUDA
(``--dtype``). ``--weights fp8`` / ``fp4``: the formats V4-Flash ships (:func:`quantize_like_release`: fp8 block
projections and shared expert, fp8 or fp4 routed experts; ours' rows only).
Every sequence decodes one token at position ``ctx`` over a context already in the caches (random rows:
the window's token rows, every compressed entry and indexer key, the compressors' ring state). Only the
window's token blocks are real: older positions map to one shared block that the step never reads.
Rows (``--impls``): ours eager, ours compiled (``torch.compile(fullgraph=True)``), ours compiled + CUDA graph (one
captured step replayed), and HF's ``DeepseekV4ForCausalLM`` on the same weights: "hf eager" and "hf compiled"
(``torch.compile(hf)`` in its default mode: HF's V4 has no static cache and ``_can_compile_fullgraph = False``, its
compressors' state lives in the dynamic cache's Python objects). HF gets no prefill (its eager attention would
materialize [S, S] scores): its ``DynamicCache`` is filled with the context our caches hold (:func:`hf_cache`), so
both decode the same step, and the first step's logits are compared: the norm error over the batch and the median /
max row's (:func:`row_errors`; in bf16 a few rows whose MoE or indexer top-k flips near a tie carry most of the norm
error, so it grows with B). HF rebinds its cache tensors each step; restoring them before every call makes each timed
call the same step at ``ctx`` (for "hf compiled" its best case: no recompiles). The first "hf compiled" row also runs
``--hf-next-steps`` real consecutive steps from its context and reports the graphs each compiled: Dynamo guards on the
sizes of the compressors' partial-window buffers, so a step with a buffer length not seen before recompiles. An HF row
is skipped, with the reason in the table, when its step would not fit in the GPU's free memory
(:func:`hf_decode_bytes`: ``repeat_kv`` makes 64-head copies of the shared KV head as keys and as values) or in what
is left of ``--budget-s``. A step's time is the median over ``--iters`` of CUDA events around the step. Also written:
cache bytes per sequence at each context and at 1M tokens (``mla_compile.models.v4_cache``). Writes
``bench_v4_decode.json`` / ``.txt`` under ``--out``; the text ends with a table of our compiled and graph steps
against HF's, with the speedup.

``--parallel`` (under ``torchrun``, ``P`` processes, one GPU each; ours' rows only): the slice sharded as
``ParallelConfig(tp=P, ep=P)`` ("tp": every rank the whole batch, the heads split over the ranks) or ``tp=P,
dp_attention=P, ep=P`` ("dp": every rank ``B / P`` of the sequences with all the heads; a batch ``P`` does not divide
is skipped), the routed experts split whole over the ranks either way (``mla_compile.parallel.v4``). ``B`` is the
global batch; a row's time is the slowest rank's median and its tokens/s ``B`` over it. Every rank builds the whole
slice from the same seed before taking its part; rank 0 writes the files.

``--attention`` times the ``v4_attention`` op alone instead, per backend (our Triton kernel, FlashMLA's sparse
kernel): one decode row per sequence at position ``ctx`` with V4-Flash dims (64 heads of 512, rope 64), for each
layer kind: sliding (the 128-row window), CSA (window + top-512 of the ``ctx / 4`` compressed entries) and HCA
(window + all ``ctx / 128`` entries); the median per-call time of a replayed CUDA graph of one call (eager
medians on CPU). Writes ``bench_v4_attention.json`` / ``.txt``.
"""

from __future__ import annotations

import argparse
import inspect
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
            o_groups=2, o_lora=16, idx_heads=16, idx_dim=32, idx_topk=8, window=8, csa=4, hca=16, hc=2,
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
    torch.manual_seed(a.seed)  # HF initializes its weights from the global generator
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
        for name, prm in hf.named_parameters():  # HF initializes the compressors' position biases to zero
            if name.endswith("position_bias"):
                prm.normal_(generator=gen)
    return hf


FP8_PROJECTIONS = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_a_proj",
                   "self_attn.o_b_proj", "self_attn.compressor.indexer.q_b_proj", "mlp.shared_experts.gate_proj",
                   "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")  # fp8 in V4-Flash's release


def quantize_like_release(hf, weights: str, seed: int) -> int:
    """``--weights fp8|fp4``: the layers' projections V4-Flash ships in fp8 (:data:`FP8_PROJECTIONS`) become
    ``FP8BlockLinear`` / ``FP8GroupedLinear`` (e4m3 codes, 128 x 128 block scales) and the routed experts
    ``FP8Experts`` or ``FP4Experts`` (e2m1 + ue8m0 per 32), with random codes of the float weights' spread (a timing
    model, as the float weights are random), on the model's device; the float ones are freed. Returns the bytes of
    the quantized tensors."""
    from mla_compile.models.fp4_linear import FP4Experts
    from mla_compile.models.fp8_linear import FP8BlockLinear, FP8Experts, fp8_form

    dev = hf.lm_head.weight.device
    gen = torch.Generator(dev).manual_seed(seed + 7)

    def fp8_fill(module):  # codes ~ N(0, 8) in e4m3, block scales 0.0025: weights ~ N(0, 0.02)
        for name, p in module.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.copy_((torch.randn(p.shape, generator=gen, device=dev) * 8).to(p.dtype))
            else:
                p.fill_(0.0025)
        return module

    total = 0
    with torch.no_grad():
        for layer in hf.model.layers:
            for name in FP8_PROJECTIONS:
                parent_name, _, attr = name.rpartition(".")
                try:
                    parent = layer.get_submodule(parent_name)
                except AttributeError:
                    continue  # a layer kind without it (the indexer: CSA only)
                new = fp8_form(getattr(parent, attr), dev)
                if new is not None:  # groups of partial blocks stay float (the loader dequantizes them)
                    setattr(parent, attr, fp8_fill(new))
            old = layer.mlp.experts
            E, H, I = old.down_proj.shape
            limit = getattr(hf.config, "swiglu_limit", None)
            if weights == "fp4":
                new = FP4Experts(E, H, I, old.act_fn, swiglu_limit=limit, device=dev)
                for name, p in new.named_parameters():  # random e2m1 nibbles; scales 2^-7: |w| <= 6 * 2^-7
                    if name.endswith("_scale_inv"):
                        p.fill_(120)
                    else:
                        p.copy_(torch.randint(0, 256, p.shape, generator=gen, device=dev, dtype=torch.uint8))
            else:
                new = fp8_fill(FP8Experts(E, H, I, old.act_fn, swiglu_limit=limit, device=dev))
            layer.mlp.experts = new
        for m in hf.modules():
            if isinstance(m, (FP8BlockLinear, FP8Experts, FP4Experts)):
                total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return total


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


OURS_IMPLS = ("ours eager", "ours compiled", "ours graph")
HF_IMPLS = ("hf eager", "hf compiled")
# first-call seconds assumed for an HF row before one has run (the budget guard); later rows use the measured one
HF_FIRST_CALL_GUESS_S = {("hf eager", "cuda"): 5.0, ("hf compiled", "cuda"): 90.0,
                         ("hf eager", "cpu"): 1.0, ("hf compiled", "cpu"): 30.0}
_HF_STATE = ("buffer_kv", "buffer_gate", "compressed_kv", "entry_count", "overlap_kv", "overlap_gate")


def profile_graph(args, graph, suffix: str) -> None:
    """Kernels of one captured step by GPU time (``torch.profiler`` over replays) to ``profile_replay{suffix}.txt``
    and ``.csv``, and their critical path to ``critical_path{suffix}.txt``: ``bench_decode_step``'s tables, per layer
    over ``3 * --layers`` layers."""
    import bench_decode_step as bds

    trace = os.path.join(args.out, f"trace_replay{suffix}.json")
    averages = bds.replay_profile(graph, trace)
    kernels = sum(a.count for a in averages if a.device_type == torch.autograd.DeviceType.CUDA) / bds.REPLAYS
    layers = 3 * args.layers
    with open(os.path.join(args.out, f"profile_replay{suffix}.txt"), "w") as f:
        f.write(f"graph replay, {bds.REPLAYS} replays: {kernels:.0f} GPU ops a replay, {kernels / layers:.1f} a layer "
                f"({layers} layers)\n")
        f.write(averages.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70) + "\n")
    bds.write_kernel_csv(os.path.join(args.out, f"profile_replay{suffix}.csv"), averages)
    try:
        text = bds.critical_path_text(trace, bds.REPLAYS, layers)
    except (OSError, ValueError) as exc:  # a trace the profiler left incomplete: the tables above stand
        text = f"critical path: not computed ({exc})"
    with open(os.path.join(args.out, f"critical_path{suffix}.txt"), "w") as f:
        f.write(text + "\n")
    os.remove(trace)  # tens of MB; the critical path above is what it was for


def hf_cache_kw(hf) -> str:
    """The name HF's forward takes the cache by: ``past_key_values`` (transformers 5.17), ``cache`` (newer)."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


@torch.no_grad()
def hf_cache(hf, model, contexts: Contexts, batch: int):
    """An HF ``DynamicCache`` holding the context our caches hold for sequences ``0..batch-1`` (all at
    ``contexts.ctx`` tokens), copied out of them, so both models decode the same step over the same context.

    Per layer: the sliding window's last ``sliding_window - 1`` token rows (HF keeps W - 1 and appends the new
    one); for CSA / HCA the ``ctx // rate`` compressed entries (and the indexer's keys), the raw ``kv`` /
    ``gate`` projections of the tokens since the last closed window (HF's buffer: our ring rows ``pos % R``),
    and for CSA the overlap state: the Ca half of the last closed window's rows, its gate with the
    ``position_bias`` added (as HF stores it). Both rope layouts are V4's interleaved one: rows copy as is."""
    from transformers import DynamicCache

    cfg, ctx, bs = hf.config, contexts.ctx, contexts.bs
    dev = model.lm_head.weight.device

    def rows(store: torch.Tensor, table: torch.Tensor, first: int, n: int) -> torch.Tensor:
        p = torch.arange(first, first + n, device=dev)
        slots = table.to(dev)[:batch, p // bs].long() * bs + p % bs  # [B, n]
        return store.reshape(-1, store.shape[-1])[slots]

    cache = DynamicCache(config=cfg)
    if len(cache.layers) != len(model.attn):
        raise RuntimeError(f"HF DynamicCache has {len(cache.layers)} layers for {len(model.attn)} attention layers")
    for layer, attn in zip(cache.layers, model.attn):
        keep = min(ctx, cfg.sliding_window - 1)
        k = rows(attn.kv_cache, contexts.table, ctx - keep, keep).unsqueeze(1)  # [B, 1, keep, D]
        layer.lazy_initialization(k, k)
        # as a step leaves them (a compiled HF guards on strides and aliasing): a full window is the last
        # W - 1 rows of the step's [B, 1, W, D] concatenation; keys and values one tensor in compressed layers
        layer.keys = window_like_hf(k, ctx >= cfg.sliding_window - 1)
        layer.values = layer.keys if attn.rate else window_like_hf(k, ctx >= cfg.sliding_window - 1)
        layer.cumulative_length = ctx
        if not attn.rate:
            continue
        r, E = attn.rate, ctx // attn.rate
        comp = attn.hf.compressor
        for name, store, mod in (("compressor", attn.comp_cache, comp),
                                 ("indexer", attn.index_cache, getattr(comp, "indexer", None))):
            if name not in attn.state:
                continue
            skv, sg = (t[:batch] for t in attn.state[name])  # state_slot[b] = b
            ring = skv.shape[1]
            layer.compressed_kv[name] = rows(store, contexts.entry[r], 0, E)
            layer.entry_count[name] = E
            buf = torch.arange(E * r, ctx, device=dev) % ring
            layer.buffer_kv[name], layer.buffer_gate[name] = skv[:, buf], sg[:, buf]
            if hasattr(layer, "overlap_kv") and E > 0:
                last = torch.arange((E - 1) * r, E * r, device=dev) % ring
                c = skv.shape[-1] // 2
                layer.overlap_kv[name] = skv[:, last, :c].clone()
                layer.overlap_gate[name] = sg[:, last, :c] + mod.position_bias[:, :c]
    return cache


def window_like_hf(k: torch.Tensor, full: bool) -> torch.Tensor:
    """``k [B, 1, n, D]`` laid out as HF's sliding-window update leaves it: once the window is full, a view
    of the last ``n`` rows of a ``[B, 1, n + 1, D]`` tensor; before, contiguous."""
    if not full:
        return k.clone()
    buf = k.new_empty(k.shape[0], k.shape[1], k.shape[2] + 1, k.shape[3])
    buf[:, :, 1:] = k
    return buf[:, :, 1:]


def hf_snapshot(cache) -> list:
    """What an HF step changes in ``cache`` (it rebinds, never writes in place): restore with :func:`hf_restore`."""
    return [(l.keys, l.values, l.cumulative_length, {a: dict(getattr(l, a)) for a in _HF_STATE if hasattr(l, a)})
            for l in cache.layers]


def hf_restore(cache, snap: list) -> None:
    """Put back into ``cache`` what :func:`hf_snapshot` took (fresh dicts: a later step may rebind their entries)."""
    for l, (k, v, n, state) in zip(cache.layers, snap):
        l.keys, l.values, l.cumulative_length = k, v, n
        for a, d in state.items():
            setattr(l, a, dict(d))


def hf_decode_bytes(a, batch: int, ctx: int, elem: int) -> int:
    """Estimated bytes one HF eager decode step at position ``ctx`` needs beyond the weights: its cache (window
    rows, compressed entries, indexer keys) plus the largest layer's transients: ``repeat_kv`` materializes the
    shared KV head for all ``heads`` as keys and again as values over the window + compressed rows
    (``2 B H L D``), the scores and probabilities ``[B, H, L]`` (a few copies), the indexer's float32 scores
    ``[B, index_heads, ctx / csa]``."""
    ncsa, nhca = (ctx + 1) // a.csa, (ctx + 1) // a.hca
    cache = a.layers * batch * elem * (3 * a.window * a.head_dim + (ncsa + nhca) * a.head_dim + ncsa * a.idx_dim)
    L = a.window + max(ncsa, nhca)
    attn = 2 * batch * a.heads * L * a.head_dim * elem + 4 * batch * a.heads * L * 4
    index = 3 * batch * a.idx_heads * ncsa * 4
    return int(cache + attn + index)


def agreed(state, value: float) -> float:
    """Rank 0's ``value`` on every rank of ``state`` (itself without one): one decision (the budget) for all ranks."""
    if state is None:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gathered_floats(value: float) -> list[float]:
    """Every rank's ``value``, in rank order."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


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


def run_dtype(a, dev: torch.device) -> torch.dtype:
    """The ``--dtype`` of the run ("auto": bf16 on CUDA, float32 elsewhere)."""
    return {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32, "bf16": torch.bfloat16,
            "fp32": torch.float32}[a.dtype]


def attention_main(a, dev: torch.device) -> int:
    """The ``--attention`` run: ``v4_attention`` per backend, layer kind, batch and context."""
    from mla_compile.ops import v4_attention

    dtype = run_dtype(a, dev)
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
                    if name == "triton-widths":  # the Triton kernel split as for a symbolic row count
                        from mla_compile.ops.triton.v4_attention import _launch

                        call = lambda: _launch(*args, a.head_dim ** -0.5, config=dict(FEW=False))  # noqa: E731
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


def hf_row(impl: str, a, hf, run, model, contexts: Contexts, b: int, ids: torch.Tensor, dev: torch.device,
           ref: torch.Tensor | None, row: dict, next_steps: int = 0, deadline: float = float("inf")) -> None:
    """Measure one HF row into ``row``: HF's cache holding our context (:func:`hf_cache`), restored before
    every call so each timed call is the same decode step at position ``ctx``. ``first_call_s`` is the first
    call (the compile for "hf compiled"), ``rel_err_vs_ours_eager`` its logits against ours; for "hf compiled"
    also the graphs Dynamo compiled at the first call and while timing (0 = steady state), and ``next_steps``
    consecutive real steps from that context (positions ctx, ctx+1, ...: the cache grows, its Python ints
    change): each one's wall time and the graphs it compiled (a recompile shows as 1); a step is not started
    when one more first-call time would pass ``deadline`` (``time.time()``)."""
    from bench_decode_step import rel_err
    from torch._dynamo.utils import counters

    kw, ctx = hf_cache_kw(hf), contexts.ctx
    cache = hf_cache(hf, model, contexts, b)
    snap = hf_snapshot(cache)
    ids_hf = ids[:b].view(b, 1).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def call(pos: int = ctx, restore: bool = True) -> torch.Tensor:
        if restore:
            hf_restore(cache, snap)
        p = torch.full((b, 1), pos, dtype=torch.long, device=dev)
        return run(input_ids=ids_hf, position_ids=p, use_cache=True, **{kw: cache}).logits[:, -1]

    graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    g0 = graphs()
    sync()
    t0 = time.perf_counter()
    out = call()
    sync()
    first = time.perf_counter() - t0
    if ref is not None:
        row["rel_err_vs_ours_eager"] = rel_err(out.float(), ref.float())
        row.update(row_errors(out, ref))
    del out
    g1 = graphs()
    row.update(timed(call, dev, a.warmup, a.iters))
    row["first_call_s"] = first
    if impl == "hf compiled":
        row.update(graphs_first_call=g1 - g0, graphs_while_timing=graphs() - g1)
        if next_steps:
            steps, new_graphs = [], []
            hf_restore(cache, snap)
            for k in range(next_steps):
                if time.time() + first > deadline:
                    row["next_steps_cut"] = "time budget"
                    break
                g = graphs()
                sync()
                t0 = time.perf_counter()
                call(ctx + k, restore=False)
                sync()
                steps.append(time.perf_counter() - t0)
                new_graphs.append(graphs() - g)
            row.update(next_steps_s=steps, next_steps_graphs=new_graphs)
    hf_restore(cache, snap)
    del cache, snap


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-sequence relative errors of logits ``out [B, V]`` against ``ref [B, V]``: ``{"rel_err_row_median",
    "rel_err_row_max"}``. In bf16 with random weights a few rows carry most of the norm error (a router's
    top-k or the indexer's top-k picks a different expert / entry than the reference's near a tie), so the
    norm error over B rows grows with B while the median row's stays put."""
    o, r = out.float(), ref.float()
    e = (o - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)
    return dict(rel_err_row_median=float(e.median()), rel_err_row_max=float(e.max()))


def err_cell(r: dict) -> str:
    """The logits error of an HF row as printed: norm error over the batch, then the median / max row's."""
    cell = f"{r['rel_err_vs_ours_eager']:.1e}"
    if "rel_err_row_median" in r:
        cell += f" (row median {r['rel_err_row_median']:.1e}, max {r['rel_err_row_max']:.1e})"
    return cell


def summary(rows: list[dict], has_graph: bool) -> list[str]:
    """The closing table: per batch x context our compiled (+ graph) step against HF's, with the speedup."""
    cell = {(r["impl"], r["batch"], r["ctx"]): r for r in rows}
    ours = "ours graph" if has_graph else "ours compiled"
    lines = [f"{'B':>5s} {'ctx':>7s} {'ours compiled':>14s} {'ours graph':>11s} {'HF eager':>10s} {'HF compiled':>12s}"
             f"  {ours} vs HF compiled / eager"]
    for b, c in sorted({(r["batch"], r["ctx"]) for r in rows}, key=lambda t: (t[1], t[0])):
        ms = lambda impl: cell.get((impl, b, c), {}).get("ms")  # noqa: E731
        fmt = lambda v, w: f"{v:{w}.3f}" if v is not None else f"{'-':>{w}s}"  # noqa: E731
        o, he, hc = ms(ours), ms("hf eager"), ms("hf compiled")
        sp = lambda h: f"{h / o:.2f}x" if o and h else "-"  # noqa: E731
        lines.append(f"{b:5d} {c:7d} {fmt(ms('ours compiled'), 14)} {fmt(ms('ours graph'), 11)} {fmt(he, 10)} "
                     f"{fmt(hc, 12)}  {sp(hc)} / {sp(he)}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small dims (CPU smoke test)")
    p.add_argument("--batches")
    p.add_argument("--ctx")
    p.add_argument("--layers", type=int)
    p.add_argument("--backend", default=None, help="V4 ops' backend (reference, triton; default: the model's)")
    p.add_argument("--impls", default=",".join(OURS_IMPLS + HF_IMPLS),
                   help="rows to measure, comma-separated: " + ", ".join(OURS_IMPLS + HF_IMPLS))
    p.add_argument("--hf-next-steps", type=int, default=3,
                   help="first 'hf compiled' row: real consecutive steps from its context, timed with their recompiles")
    p.add_argument("--hf-compile-guess-s", type=float, default=None,
                   help="the budget guard's first-call time of 'hf compiled' until one is measured "
                        "(default: 90 on CUDA, 30 on CPU)")
    p.add_argument("--iters", type=int)
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="weights and caches (auto: bf16 on CUDA, float32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", choices=("float", "fp8", "fp4"), default="float",
                   help="float: every weight in --dtype; fp8 / fp4: V4-Flash's release formats (fp8 projections, fp8 "
                        "or fp4 routed experts; random codes)")
    p.add_argument("--regional-compile", action="store_true",
                   help="compile each layer as nested compile regions (patch(..., regional_compile=True))")
    p.add_argument("--budget-s", type=float, default=1e9)
    p.add_argument("--profile-replay", action="store_true",
                   help="profile each 'ours graph' row's replays (kernels by GPU time and the critical path, as "
                        "bench_decode_step --profile-replay) to profile_replay_b{B}_c{ctx}.txt / critical_path_...")
    p.add_argument("--parallel", choices=("none", "tp", "dp"), default="none",
                   help="under torchrun: heads split over the ranks (tp) or data-parallel attention (dp), EP "
                        "either way")
    p.add_argument("--attention", action="store_true", help="time the v4_attention op per backend instead")
    p.add_argument("--attn-backends", default="triton,flashmla",
                   help="backends --attention compares on CUDA (and 'triton-widths': the Triton kernel split from "
                        "the lists' widths only, as a symbolic row count gets it)")
    args = p.parse_args(argv)
    if args.attention and args.ctx is None and not args.tiny:
        args.ctx = "8192"  # the op alone: V4-Flash at 8k unless asked
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    bad = [x for x in impls if x not in OURS_IMPLS + HF_IMPLS]
    if bad:
        p.error(f"--impls: unknown {bad}; choose from {', '.join(OURS_IMPLS + HF_IMPLS)}")
    if args.weights != "float" and any(i in HF_IMPLS for i in impls):
        p.error(f"--weights {args.weights}: HF's model runs float weights only; pass --impls with ours' rows")
    if args.parallel != "none" and (args.attention or any(i in HF_IMPLS for i in impls)):
        p.error("--parallel: ours' rows of the decode step only (no --attention, no hf rows in --impls)")
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)
    if args.attention:
        return attention_main(args, dev)
    state, world, rank = None, 1, 0
    if args.parallel != "none":
        from mla_compile.parallel import ParallelConfig, init

        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp = world if args.parallel == "dp" else 1  # "tp": one attention group splitting the heads
        state = init(ParallelConfig(tp=world, dp_attention=dp, ep=world), device=None if dev.type == "cuda" else dev)
        dev, rank = state.device, state.rank
    dtype = run_dtype(args, dev)
    start = time.time()
    from mla_compile.models.model import patch
    from mla_compile.models.v4_cache import V4CacheLayout, V4Dims

    hf = build_model(args, dev, dtype)
    quantized_bytes = quantize_like_release(hf, args.weights, args.seed) if args.weights != "float" else 0
    model = patch(hf, backend=args.backend, regional_compile=args.regional_compile, parallel=state)
    share = world if args.parallel == "dp" else 1  # the global batch over the data-parallel ranks
    layout = V4CacheLayout(V4Dims.from_hf(hf.config), "bf16")
    batches = [int(x) for x in args.batches.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    ids = torch.randint(0, args.vocab, (max(batches),), generator=torch.Generator().manual_seed(args.seed))
    rows = []
    info = dict(args=vars(args), device=str(torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"),
                torch=torch.__version__, weights=args.weights, quantized_bytes=quantized_bytes,
                parallel=args.parallel, world_size=world,
                bytes_per_seq_1m=layout.sequence_bytes(1 << 20),
                bytes_per_token=layout.model_bytes_per_token)
    backend = "inductor" if dev.type == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    hf_compiled = None
    if any(i in HF_IMPLS for i in impls):
        import transformers

        info.update(transformers=transformers.__version__,
                    hf_experts_implementation=getattr(hf.config, "_experts_implementation", None),
                    hf_attn_implementation=getattr(hf.config, "_attn_implementation", None))
        # HF's V4 cannot compile whole (_can_compile_fullgraph = False: its compressor state lives in the
        # dynamic cache's Python objects, no static cache): torch.compile's default mode, graph breaks allowed
        hf_compiled = torch.compile(hf, backend=backend)
        for name in ("recompile_limit", "cache_size_limit"):  # consecutive steps and batch sizes recompile
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
    seen: dict = {}  # impl -> (first_call_s, ms) of its last measured row: the HF budget guard's estimate
    elem = torch.empty((), dtype=dtype).element_size()
    for ctx in ctxs:
        contexts = Contexts(args, model, max(max(batches) // share, 1), ctx, dev)
        for b in batches:
            step_in = contexts.step(max(b // share, 1), ids)
            ref = None
            for impl in impls:
                row = dict(impl=impl, batch=b, ctx=ctx, cache_bytes_per_seq=layout.sequence_bytes(ctx))
                elapsed = agreed(state, time.time() - start)  # rank 0's clock decides for every rank
                if b % share:
                    row["skipped"] = f"batch {b} does not split over {share} data-parallel ranks"
                elif elapsed > args.budget_s:
                    row["skipped"] = "time budget"
                elif impl == "ours graph" and dev.type != "cuda":
                    row["skipped"] = "needs CUDA"
                elif impl in HF_IMPLS:
                    guess = HF_FIRST_CALL_GUESS_S[impl, "cuda" if dev.type == "cuda" else "cpu"]
                    if impl == "hf compiled" and args.hf_compile_guess_s is not None:
                        guess = args.hf_compile_guess_s
                    first, ms = seen.get(impl, (guess, 0.0))
                    need_s = first + (args.warmup + args.iters) * ms / 1e3
                    need_b = hf_decode_bytes(args, b, ctx, elem)
                    free_b = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
                    if elapsed + need_s > args.budget_s:
                        row["skipped"] = f"time budget: ~{need_s:.0f} s needed, {args.budget_s - elapsed:.0f} s left"
                    elif free_b is not None and need_b > 0.9 * free_b:
                        rows_kv = f"{args.window} + {(ctx + 1) // args.csa}"
                        row["skipped"] = (f"memory: HF's step needs ~{need_b / 2**30:.1f} GiB (its cache and repeat_kv "
                                          f"of the shared KV head to {args.heads} heads, as keys and as values, over "
                                          f"{rows_kv} rows), {free_b / 2**30:.1f} GiB free")
                if "skipped" not in row:
                    try:
                        with torch.no_grad():
                            if impl == "ours eager":
                                row.update(timed(lambda: model(*step_in), dev, args.warmup, args.iters))
                                row["finite"] = bool(torch.isfinite(model(*step_in)).all())
                            elif impl == "ours compiled":
                                row.update(timed(lambda: compiled(*step_in), dev, args.warmup, args.iters))
                            elif impl == "ours graph":
                                for _ in range(2):
                                    compiled(*step_in)
                                torch.cuda.synchronize()
                                graph = torch.cuda.CUDAGraph()
                                with torch.cuda.graph(graph):
                                    compiled(*step_in)
                                row.update(timed(graph.replay, dev, args.warmup, args.iters))
                                if args.profile_replay and rank == 0:
                                    profile_graph(args, graph, f"_b{b}_c{ctx}")
                            else:
                                if ref is None:
                                    ref = model(*step_in)
                                nxt = args.hf_next_steps if impl == "hf compiled" and impl not in seen else 0
                                hf_row(impl, args, hf, hf if impl == "hf eager" else hf_compiled, model, contexts, b,
                                       ids, dev, ref, row, nxt, start + args.budget_s)
                                seen[impl] = (row["first_call_s"], row["ms"])
                        if state is not None:  # the slowest rank's step
                            row["ms_ranks"] = gathered_floats(row["ms"])
                            row["ms"] = max(row["ms_ranks"])
                        row["tok_s"] = b / (row["ms"] / 1e3)
                    except Exception as exc:  # keep measuring; the reason goes into the table
                        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                        traceback.print_exc(limit=4)
                    finally:
                        if dev.type == "cuda" and impl in HF_IMPLS:
                            torch.cuda.empty_cache()
                rows.append(row)
                cell = row.get("skipped") or row.get("error") or f"{row['ms']:.3f} ms ({row['tok_s']:.0f} tok/s)"
                if "rel_err_vs_ours_eager" in row:
                    cell += f"  first call {row['first_call_s']:.1f} s, logits rel. err. vs ours {err_cell(row)}"
                if rank == 0:
                    print(f"[{time.time() - start:7.1f}s] {impl:14s} B={b:<4d} ctx={ctx:<7d} {cell}", flush=True)
                    with open(os.path.join(args.out, "bench_v4_decode.json"), "w") as f:
                        json.dump(dict(info=info, rows=rows), f, indent=1, default=str)
            del ref
        del contexts
    if rank != 0:
        return 0
    where = "" if state is None else f", {args.parallel} over {world} ranks (B global)"
    lines = [f"V4 decode step ({info['device']}, {args.layers} x (sliding, CSA, HCA), backend {args.backend or 'default'}, "
             f"weights {args.weights}{where})",
             f"cache bytes per token of context {layout.model_bytes_per_token:.0f}; "
             f"per sequence at 1M tokens {layout.sequence_bytes(1 << 20) / 2**30:.3f} GiB (bf16)"]
    if hf_compiled is not None:
        lines.append(f"HF: transformers {info['transformers']}, {info['hf_attn_implementation']} attention, experts "
                     f"{info['hf_experts_implementation']}; 'hf compiled' = torch.compile(hf) default mode, "
                     "dynamic cache")
    for r in rows:
        cell = r.get("skipped") or r.get("error") or f"{r['ms']:.3f} ms  {r['tok_s']:.0f} tok/s"
        if "rel_err_vs_ours_eager" in r:
            cell += f"  (first call {r['first_call_s']:.1f} s; logits vs ours eager rel. err. {err_cell(r)}"
            if "graphs_while_timing" in r:
                cell += (f"; graphs compiled: first call {r['graphs_first_call']}, "
                         f"timed calls {r['graphs_while_timing']}")
            if r.get("next_steps_s"):
                cell += ("; real steps from ctx: " + ", ".join(f"{t:.2f} s ({g} new graphs)" for t, g in
                                                           zip(r["next_steps_s"], r["next_steps_graphs"])))
            cell += ")"
        lines.append(f"{r['impl']:14s} B={r['batch']:<4d} ctx={r['ctx']:<7d} {cell}")
    lines += summary(rows, dev.type == "cuda")
    with open(os.path.join(args.out, "bench_v4_decode.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
