"""Time every registered backend of every ranked op on this GPU and write the timing file "auto" reads.

    python benchmarks/bench_backends.py --out ops/backend_timings/h200.json   # on the GPU
    python benchmarks/bench_backends.py --dry-run                             # CPU: list the grid
    python benchmarks/bench_backends.py --check ops/backend_timings/h200.json # CPU: validate a file
    python benchmarks/bench_backends.py --only v4_attention --out ops/backend_timings/h200.json  # one op's rows

For each op the selector ranks by time (decode, decode_fp8, sparse_decode, prefill, merge, v4_attention: the
ones whose public functions pass their heads), each shape of :data:`GRID` and each backend the registry declares
for the op, the backend is timed through our op (``ops.<op>(..., backend=name)``) when the selector says
it serves the shape: the median GPU time of one call in a replayed CUDA graph (``bench_kernels.graph_ms``),
or the eager time (``bench_kernels.bench``) for backends that cannot be captured. FlashInfer's host plans are made
before timing, and so is the step schedule of a decode backend that takes one (FlashMLA and what runs it:
``ops.decode_step_schedule``), as the model makes it once a step for all its layers. "autotune" is left out (it is a
compile-time choice among the others). The file (format: :mod:`mla_compile.ops.timings`) records the GPU, its compute
capability and the package versions.
``--only OP,...`` times those ops alone; with ``--out`` naming an existing file of the same GPU, that file's
rows of the other ops are kept (its rows of these ops are replaced).

``v4_attention`` shapes: ``batch`` decode rows (one query row per sequence) at position 8192 with V4 dims (heads
of 512, rope 64, window 128, CSA top-512 of the ctx / 4 entries, HCA all ctx / 128 entries, as
``bench_v4_decode.py --attention``), one shape per layer kind, ``context`` = the slots each row lists
(:data:`V4_SLOTS`), the timing class the V4 model's calls name; at 16, 32, 64 and 128 heads (a rank's share of
V4-Flash's 64 or V4-Pro's 128 when tensor parallelism splits the heads, and the whole of each).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
from dataclasses import dataclass

import torch

import mla_compile  # noqa: F401  (registers every op and backend)
from mla_compile.ops import timings
from mla_compile.ops.registry import backends_for, priority, split_part, split_rows
from mla_compile.ops.select import cache_layout, facts_for, select

PAGE, DC, DR = 64, 512, 64
D, W = DC + DR, 656
SCALE = 1 / math.sqrt(192)
PACKAGES = ("torch", "triton", "sgl-flash-mla", "flashinfer-python", "flash-attn")
SKIP = ("autotune",)


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: ``batch`` sequences (decode, prefill) or tokens (merge), ``context`` tokens per
    sequence (sparse decode: the top-k), ``cache`` "bfloat16" or "fp8"."""

    op: str
    heads: int
    batch: int
    context: int
    cache: str = "bfloat16"

    def key(self) -> dict:
        return dict(op=self.op, dtype="bfloat16", cache=self.cache, heads=timings.bucket("heads", self.heads),
                    batch=timings.bucket("batch", self.batch), context=timings.bucket("context", self.context, self.op))


# v4_attention's layer kinds at position V4_CTX by the slots a query row lists: window 128, CSA window + top-512,
# HCA window + the 8192 / 128 entries
V4_CTX, V4_WINDOW = 8192, 128
V4_SLOTS = {"sliding": V4_WINDOW, "CSA": V4_WINDOW + 512, "HCA": V4_WINDOW + V4_CTX // 128}
V4_KIND = {slots: kind for kind, slots in V4_SLOTS.items()}

GRID: tuple[Shape, ...] = (
    *(Shape(op, h, b, L, cache) for op, cache in (("decode", "bfloat16"), ("decode_fp8", "fp8"))
      for h in (16, 128) for b in (2, 16, 128) for L in (4096, 8192)),
    *(Shape("sparse_decode", h, 128, 2048, cache) for h in (16, 128) for cache in ("bfloat16", "fp8")),
    *(Shape("prefill", h, n, L) for h in (16, 128) for n, L in ((8, 4096), (2, 1024))),
    *(Shape("merge", h, 1024, 1024) for h in (16, 128)),
    # 64 heads: V4-Flash, 128: V4-Pro; 16 and 32: a rank's heads when tensor parallelism splits them (8 counts as 16)
    *(Shape("v4_attention", h, b, slots) for h in (16, 32, 64, 128) for slots in V4_SLOTS.values()
      for b in (1, 8, 64, 256)),
)


def facts(s: Shape, planned: bool, **cap):
    """The selector's facts for ``s`` on the CUDA device (``cap=(major, minor)`` to assume one, as tests do)."""
    paged = s.op in ("decode", "decode_fp8", "sparse_decode", "v4_attention")
    width = W if s.cache == "fp8" else DC if s.op == "v4_attention" else D
    dims = {"prefill": (192, 128), "merge": (DC,), "v4_attention": (DC,)}.get(s.op, (DC, DR))
    align, packed = cache_layout((PAGE * width, width, 1), width) if paged else (None, None)
    # v4_attention: the listed slots, as the V4 model names them for its sliding and CSA layers
    context = s.context if s.op == "v4_attention" else None
    # a dense decode's block tables hold context / PAGE pages a sequence (bench_fp8_sparse._caches): its capacity
    capacity = s.context if s.op in ("decode", "decode_fp8") else None
    return facts_for("cuda", torch.bfloat16, cache_dtype=torch.uint8 if s.cache == "fp8" else torch.bfloat16,
                     block_size=PAGE if paged else None, num_heads=s.heads, head_dims=dims, query_len=1,
                     planned=planned, cache_align=align, packed_rows=packed, context=context, capacity=capacity,
                     **cap)


def shapes(only: tuple[str, ...] | None = None) -> list[Shape]:
    """The shapes of :data:`GRID`, of the ops ``only`` names (None: every op)."""
    return [s for s in GRID if only is None or s.op in only]


def grid(only: tuple[str, ...] | None = None) -> list[tuple[Shape, str]]:
    """Every (shape, backend) pair to try: each shape with every declared backend of its op."""
    return [(s, name) for s in shapes(only) for name in priority(s.op) if name not in SKIP]


def _v4_inputs(s: Shape, dev: str) -> tuple:
    """``v4_attention``'s arguments for shape ``s`` (its layer kind from its slots) with
    ``bench_v4_decode.attention_case``, the inputs of BENCHMARKS.md's V4 attention rows."""
    from types import SimpleNamespace

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_v4_decode import attention_case

    a = SimpleNamespace(seed=0, window=V4_WINDOW, head_dim=DC, block_size=PAGE, csa=4, hca=128, idx_topk=512,
                        heads=s.heads, rope=DR)
    return attention_case(a, V4_KIND[s.context], s.batch, V4_CTX, torch.device(dev), torch.bfloat16)


def _inputs(s: Shape):
    """(call(backend, plan) -> outputs, make_plan() or None) for shape ``s`` on the GPU."""
    from mla_compile import ops

    dev = "cuda"
    if s.op == "v4_attention":
        args = _v4_inputs(s, dev)
        return (lambda name, plan: ops.v4_attention(*args, DC ** -0.5, backend=name)), None
    if s.op == "merge":
        oa, ob = (torch.randn(s.batch, s.heads, DC, device=dev, dtype=torch.bfloat16) for _ in range(2))
        la, lb = (torch.randn(s.batch, s.heads, device=dev) for _ in range(2))
        return (lambda name, plan: ops.merge_attn_states(oa, la, ob, lb, backend=name)), None
    if s.op == "prefill":
        lens = torch.full((s.batch,), s.context, dtype=torch.int32, device=dev)
        cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).int()
        T = s.batch * s.context
        q, k = (torch.randn(T, s.heads, 192, device=dev, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(T, s.heads, 128, device=dev, dtype=torch.bfloat16)

        def plan():
            from mla_compile.ops.adapters.flashinfer import plan_flashinfer_prefill
            return plan_flashinfer_prefill(cu.cpu(), cu.cpu(), num_heads=s.heads, head_dim_qk=192, head_dim_v=128,
                                           scale=SCALE, causal=True, dtype=torch.bfloat16)
        return (lambda name, p: ops.prefill(q, k, v, cu, cu, SCALE, causal=True, backend=name, plan=p)), plan
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_fp8_sparse import _caches

    bf16, fp8, table, lens = _caches(s.batch, s.context)
    cache = fp8 if s.cache == "fp8" else bf16
    q = torch.randn(s.batch, 1, s.heads, D, device=dev, dtype=torch.bfloat16)
    if s.op == "sparse_decode":
        idx = torch.randint(0, cache.shape[0] * PAGE, (s.batch, 1, s.context), device=dev, dtype=torch.int32)
        return (lambda name, p: ops.sparse_decode(q, cache, idx, SCALE, backend=name)), None
    if s.op == "decode_fp8":
        return (lambda name, p: ops.decode_fp8(q, cache, table, lens, SCALE, backend=name)), None

    def plan():
        from mla_compile.ops.adapters.flashinfer import plan_flashinfer_decode
        return plan_flashinfer_decode(table.cpu(), lens.cpu(), num_heads=s.heads, block_size=PAGE, scale=SCALE,
                                      dtype=torch.bfloat16, use_cuda_graph=True)
    schedules: dict[str, tuple | None] = {}

    def decode(name, p):
        # a backend that takes a step schedule runs as in the model: on the schedule made once a step (here once,
        # before the first call, outside the timed graph: a step's one scheduler launch is shared by its layers)
        if name not in schedules:
            schedules[name] = ops.decode_step_schedule(lens, s.heads, name)
        return ops.decode(q, cache, table, lens, SCALE, backend=name, plan=p, schedule=schedules[name])
    return decode, plan


def measure(only: tuple[str, ...] | None = None) -> dict:
    """Time the grid (of the ops ``only`` names; None: all) on this GPU; returns the timing file's contents."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_kernels as bk  # CUDA-graph replay timing (graph_ms) and do_bench (bench)

    rows: dict[tuple, dict] = {}
    autos: list[tuple] = []
    overheads: list[tuple] = []
    for s in shapes(only):
        call, make_plan = _inputs(s)
        f = facts(s, planned=True)  # outside the try: a bug here stops the run instead of skipping every backend
        for name in (n for n in priority(s.op) if n not in SKIP):
            try:
                select(s.op, f, requested=name)  # a ValueError says why it cannot serve
                spec = backends_for(s.op)[name]
                plan = make_plan() if spec.needs_plan else None
                fn = lambda: call(name, plan)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                capturable = spec.cuda_graph != "none"
                ms = bk.graph_ms(fn) if capturable else bk.bench(fn)
            except Exception as exc:  # cannot serve / not installed / failed: reported, not timed
                print(f"  {s} {name}: skipped ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
                continue
            row = rows.setdefault(tuple(s.key().items()), dict(s.key(), us={}, shape=str(s), source="bench_backends"))
            row["us"][name] = round(ms * 1e3, 1)
            print(f"  {s} {name}: {ms * 1e3:.1f} us", flush=True)
        us = rows.get(tuple(s.key().items()), {}).get("us", {})
        autos.append(_time_auto(s, f, call, make_plan, us, bk))
        if s.op == "decode":
            overheads.extend(_adapter_overhead(s, us, bk))
        if s.op == "prefill":
            overheads.extend(_prefill_overhead(s, us, bk))
        if s.op in ("decode_fp8", "sparse_decode") and "flashmla" in us:
            overheads.extend(_flashmla_kept_schedule(s, call, bk))
        torch.cuda.empty_cache()
    _report_auto(autos)
    _report_overhead(overheads)
    cap = torch.cuda.get_device_capability()
    return dict(format=timings.FORMAT, gpu=torch.cuda.get_device_name(), capability=list(cap),
                versions={p: _version(p) for p in PACKAGES}, seeded=False,
                source="benchmarks/bench_backends.py: CUDA-graph replay of one call per backend (eager where it "
                       "cannot be captured)", rows=list(rows.values()))


def _time_auto(s: Shape, f, call, make_plan, us: dict, bk) -> tuple:
    """(shape, auto's choice for a graph that serves every batch (the model's case), its time in us or None,
    the fastest backend timed on this shape, its time): "auto" judged against this run's own timings."""
    name = select(s.op, f).name
    best = min(us, key=us.get) if us else None
    if name in us:
        return s, name, us[name], best, us.get(best)
    try:
        spec = backends_for(s.op)[name]
        plan = make_plan() if spec.needs_plan else None
        fn = lambda: call(name, plan)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        ms = bk.graph_ms(fn) if _capturable(s, spec) else bk.bench(fn)
    except Exception as exc:
        print(f"  {s} auto ({name}): failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
        return s, name, None, best, us.get(best)
    return s, name, round(ms * 1e3, 1), best, us.get(best)


def _capturable(s: Shape, spec) -> bool:
    """Whether a call of ``spec`` at shape ``s`` can be CUDA-graph captured: a split is judged by the part that
    serves this shape (a split is declared as able as its weakest part, but only one part runs per call, and
    timing a captured part eagerly would charge it the launch overhead its rivals do not pay)."""
    if spec.tiers:
        rows = s.batch * s.context if split_rows(s.op) == "tokens" else s.batch
        spec = backends_for(s.op)[split_part(spec.tiers, rows)]
    return spec.cuda_graph != "none"


def _report_auto(autos: list[tuple]) -> None:
    """Print, per shape, "auto"'s choice and its time against the fastest backend of the same run."""
    print("\nauto against the fastest backend of this run (batch unknown to auto, as in a compiled graph; a decode's "
          "block-table capacity known):")
    within = 0
    for s, name, t, best, tb in autos:
        ratio = t / tb if t and tb else float("nan")
        within += ratio <= 1.03
        print(f"  auto {s.op:13s} {s.cache:8s} H={s.heads:<3d} B={s.batch:<4d} L={s.context:<5d} {name:40s} "
              f"{t if t is not None else '-':>8} us  fastest {best} {tb} us  {ratio:.3f}x", flush=True)
    print(f"auto within 1.03x of the fastest on {within} of {len(autos)} shapes", flush=True)


def _adapter_overhead(s: Shape, us: dict, bk) -> list[tuple]:
    """(shape, peer, ours us, direct us) for FlashMLA (on a step schedule and scheduling per call:
    :func:`_flashmla_rows`) and FlashInfer bf16 decode: the peer called directly
    (its documented call, inputs already in its layout, FlashInfer planned once) against our adapter's time
    in this run, both as CUDA-graph replays."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_fp8_sparse import _caches

    bf16, _, table, lens = _caches(s.batch, s.context)
    q = torch.randn(s.batch, 1, s.heads, D, device="cuda", dtype=torch.bfloat16)
    out = []
    if "flashmla" in us:
        try:
            out.extend(_flashmla_rows(s, us["flashmla"], q, bf16.unsqueeze(2), table, lens, bk))
        except Exception as exc:
            print(f"  {s} FlashMLA direct: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
    if "flashinfer" in us:
        try:
            import flashinfer
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, use_cuda_graph=True, qo_indptr=torch.arange(
                s.batch + 1, device="cuda", dtype=torch.int32), kv_indptr=torch.empty(
                s.batch + 1, device="cuda", dtype=torch.int32), kv_indices=torch.empty(
                table.numel(), device="cuda", dtype=torch.int32), kv_len_arr=torch.empty(
                s.batch, device="cuda", dtype=torch.int32))
            indptr = torch.arange(s.batch + 1, dtype=torch.int32) * table.shape[1]
            w.plan(torch.arange(s.batch + 1, dtype=torch.int32), indptr, table.reshape(-1).cpu(), lens.cpu(),
                   s.heads, DC, DR, PAGE, False, SCALE, torch.bfloat16, torch.bfloat16)
            q_nope, q_pe = q[:, 0, :, :DC].contiguous(), q[:, 0, :, DC:].contiguous()
            direct = lambda: w.run(q_nope, q_pe, bf16[..., :DC], bf16[..., DC:], return_lse=True)  # noqa: E731
            out.append((s, "flashinfer", us["flashinfer"], round(bk.graph_ms(direct) * 1e3, 1)))
        except Exception as exc:
            print(f"  {s} FlashInfer direct: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
    return out


def _flashmla_rows(s: Shape, scheduled_us: float, q, k_cache, table, lens, bk) -> list[tuple]:
    """FlashMLA's adapter rows: (shape, "flashmla", our op on the step's schedule (this run's "flashmla" row, as the
    model runs it), FlashMLA called directly with ``get_mla_decoding_metadata``'s schedule assigned onto its
    ``FlashMLASchedMeta``), and (shape, "flashmla (per-call schedule)", our op scheduling inside the call, FlashMLA
    called directly with a fresh meta): both sides of each row alike."""
    import flash_mla

    from mla_compile import ops

    cache, lens = k_cache.squeeze(2), lens.to(torch.int32)
    tiles, splits = flash_mla.get_mla_decoding_metadata(lens, s.heads, 1, h_q=s.heads, use_legacy=True)

    def direct(scheduled: bool):
        meta, _ = flash_mla.get_mla_metadata()
        if scheduled:  # the step's schedule; else FlashMLA schedules inside the call
            meta.tile_scheduler_metadata, meta.num_splits = tiles, splits
        return flash_mla.flash_mla_with_kvcache(q, k_cache, table, lens, DC, meta, softmax_scale=SCALE, causal=False,
                                                use_legacy=True)
    ours = bk.graph_ms(lambda: ops.decode(q, cache, table, lens, SCALE, backend="flashmla"))
    direct_us = {sched: round(bk.graph_ms(lambda sched=sched: direct(sched)) * 1e3, 1) for sched in (True, False)}
    return [(s, "flashmla", scheduled_us, direct_us[True]),
            (s, "flashmla (per-call schedule)", round(ours * 1e3, 1), direct_us[False])]


def _flashmla_kept_schedule(s: Shape, call, bk) -> list[tuple]:
    """(shape, "flashmla kept schedule", us with ``REUSE_SPARSE_SCHEDULE`` on, us with it off): the fp8 / sparse
    adapter given the schedule its eager warm-up call got back (the graph then holds no scheduler kernel), against
    the same adapter scheduling itself in every call; the flag is restored after."""
    from mla_compile.ops.adapters import flashmla as fm

    was = fm.REUSE_SPARSE_SCHEDULE
    fn = lambda: call("flashmla", None)  # noqa: E731
    us = {}
    try:
        for reuse in (False, True):
            fm.REUSE_SPARSE_SCHEDULE = reuse
            fm._SPARSE_SCHEDULES.clear()
            fn()
            torch.cuda.synchronize()
            us[reuse] = round(bk.graph_ms(fn) * 1e3, 1)
    except Exception as exc:
        print(f"  {s} flashmla kept schedule: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
        return []
    finally:
        fm.REUSE_SPARSE_SCHEDULE = was
        fm._SPARSE_SCHEDULES.clear()
    return [(s, "flashmla kept schedule", us[True], us[False])]


def _prefill_overhead(s: Shape, us: dict, bk, rounds: int = 3) -> list[tuple]:
    """(shape, "flashinfer prefill", ours us, direct us): our op with backend "flashinfer" (planned by
    ``plan_flashinfer_prefill``) against FlashInfer's ragged prefill called directly (planned once, LSE returned) on
    the same inputs, both timed eagerly (it is not captured) in ``rounds`` alternating rounds, each side its fastest
    round: an eager multi-ms kernel drifts by a few percent over a run, more than the bound at large shapes."""
    if "flashinfer" not in us:
        return []
    try:
        import flashinfer

        from mla_compile import ops
        from mla_compile.ops.adapters.flashinfer import plan_flashinfer_prefill
        T = s.batch * s.context
        q, k = (torch.randn(T, s.heads, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(T, s.heads, 128, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(s.batch + 1, dtype=torch.int32) * s.context
        w = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
        w.plan(cu, cu, s.heads, s.heads, 192, head_dim_vo=128, causal=True, sm_scale=SCALE,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        plan = plan_flashinfer_prefill(cu, cu, num_heads=s.heads, head_dim_qk=192, head_dim_v=128, scale=SCALE,
                                       causal=True, dtype=torch.bfloat16)
        cu_dev = cu.cuda()
        sides = (lambda: ops.prefill(q, k, v, cu_dev, cu_dev, SCALE, causal=True, backend="flashinfer", plan=plan),
                 lambda: w.run(q, k, v, return_lse=True))
        best = [math.inf, math.inf]
        for _ in range(rounds):
            best = [min(b, bk.bench(side)) for b, side in zip(best, sides)]
        return [(s, "flashinfer prefill", round(best[0] * 1e3, 1), round(best[1] * 1e3, 1))]
    except Exception as exc:
        print(f"  {s} FlashInfer prefill direct: failed ({type(exc).__name__}: {str(exc)[:160]})", flush=True)
        return []


def _report_overhead(rows: list[tuple]) -> None:
    """Print what each adapter adds over its peer's direct call; the bound is 3% or 2 us, the larger."""
    print("\nadapter overhead (ours through our op vs the peer called directly, same run):")
    ok = 0
    for s, peer, ours, direct in rows:
        bound = max(0.03 * direct, 2.0)
        ok += ours - direct <= bound
        print(f"  {peer:18s} H={s.heads:<3d} B={s.batch:<4d} L={s.context:<5d} ours {ours:8.1f} us  direct "
              f"{direct:8.1f} us  +{ours - direct:6.1f} us (bound {bound:.1f})", flush=True)
    print(f"adapters within max(3%, 2 us) of the direct call on {ok} of {len(rows)} shapes", flush=True)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def keep_other_ops(old: dict, new: dict, only: tuple[str, ...]) -> dict:
    """``new`` (this run's rows of the ops ``only`` names) with ``old``'s rows of every other op, when ``old``
    is a timing file of the same GPU (else SystemExit: rows of two GPUs never share a file). The file's
    versions are this run's; its source names both runs."""
    if old.get("capability") != new["capability"] or old.get("gpu") != new["gpu"]:
        raise SystemExit(f"--only: the existing file is of {old.get('gpu')} {old.get('capability')}, this GPU is "
                         f"{new['gpu']} {new['capability']}: write another file")
    kept = [r for r in old.get("rows", []) if r.get("op") not in only]
    print(f"kept {len(kept)} rows of other ops from the existing file")
    return dict(new, rows=kept + new["rows"],
                source=f"{old.get('source', '')}; rows of {', '.join(only)}: {new['source']} (--only)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="timing file to write (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="list the (op, backend, shape) grid; no GPU needed")
    ap.add_argument("--check", metavar="FILE", help="validate a timing file; no GPU needed")
    ap.add_argument("--only", metavar="OP[,OP]", help="these ops alone (e.g. v4_attention); an existing --out file "
                    "of the same GPU keeps its rows of the other ops")
    args = ap.parse_args(argv)
    ops_of_grid = sorted({s.op for s in GRID})
    only = tuple(o.strip() for o in args.only.split(",") if o.strip()) if args.only else None
    if only is not None and not only or set(only or ()) - set(ops_of_grid):
        ap.error(f"--only takes ops of the grid {ops_of_grid}, got {args.only!r}")
    if args.check:
        errors = timings.check(json.loads(open(args.check).read()))
        print("\n".join(errors) if errors else f"{args.check}: valid")
        return 1 if errors else 0
    if args.dry_run:
        pairs = grid(only)
        for s, name in pairs:
            print(f"{s.op:14s} {name:19s} heads {s.heads:3d} batch {s.batch:4d} context {s.context:5d} {s.cache}")
        print(f"{len(pairs)} (shape, backend) pairs over {len(shapes(only))} shapes")
        return 0
    if not args.out or not torch.cuda.is_available():
        ap.error("--out and a CUDA GPU are needed to measure (or use --dry-run / --check)")
    doc = measure(only)
    if not doc["rows"]:
        raise SystemExit("no backend could be timed on any shape: nothing written")
    if only is not None and os.path.exists(args.out):
        doc = keep_other_ops(json.loads(open(args.out).read()), doc, only)
    errors = timings.check(doc)
    if errors:
        raise SystemExit("measured file is invalid: " + "; ".join(errors))
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}: {len(doc['rows'])} shape classes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
