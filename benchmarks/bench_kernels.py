"""Time the Triton MLA kernels against FlashMLA, FlashInfer and plain torch in one run.

    python benchmarks/bench_kernels.py --out OUT_DIR [--budget-s 300] [--quick]
    python benchmarks/bench_kernels.py --out OUT_DIR --prefill-sweep [--no-gluon]   # prefill kernels vs peers

Measures the two ceilings first (device-to-device copy bandwidth, counting bytes read plus written,
and a bf16 8192^3 matmul), then each kernel/shape. The main time is the median per-call time of a
replayed CUDA graph holding a few calls (GPU time without host dispatch); inputs that would fit in
the 60 MB L2 are rotated over several sets inside the graph so they are read from memory. "eager"
is ``triton.testing.do_bench`` on the Python call (L2 cleared before each run): it includes the
host-side dispatch, which dominates for small kernels. TFLOPS and effective GB/s (the fewest bytes
the op must move) come from the graph time, also as fractions of the ceilings. Peers that are not
installed, fail, or would overrun ``--budget-s`` are reported and skipped. Writes
``bench_kernels.json``, ``bench_kernels.txt`` and ``bench_kernels.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch._library.triton import set_wrap_triton_enabled
from triton.testing import do_bench

import mla_compile  # noqa: F401
from mla_compile.ops import decode, gather_latent_cache, merge_attn_states, prefill, write_latent_cache
from mla_compile.ops.triton import decode as tdecode
from mla_compile.ops.triton import prefill as tprefill

DEV, PAGE, DC, DR = "cuda", 64, 512, 64
D = DC + DR
SCALE = 1 / math.sqrt(192)
ROWS: list[dict] = []
CEIL: dict = {}
START = time.time()


def bench(fn, rep_ms=200) -> float:
    """Median milliseconds of ``fn`` (CUDA events, L2 cleared before each run, after warm-up)."""
    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def graph_ms(fn, target_ms=10.0, max_reps=20) -> float:
    """Median milliseconds per call of ``fn`` from 10 replays of a CUDA graph of a few calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        reps = max(1, min(max_reps, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def record(group, impl, ms, eager_ms, flops, nbytes, note=""):
    row = {"group": group, "impl": impl, "us": ms * 1e3, "eager_us": eager_ms * 1e3, "tflops": flops / ms / 1e9,
           "gbs": nbytes / ms / 1e6, "frac_bw": nbytes / ms / 1e6 / CEIL["copy_gbs"],
           "frac_mm": flops / ms / 1e9 / CEIL["mm_tflops"], "note": note}
    ROWS.append(row)
    print("  " + _fmt(row), flush=True)


def _fmt(r) -> str:
    if "error" in r:
        return f"{r['impl']:30s} FAILED {r['error'][:140]}"
    return (f"{r['impl']:30s} {r['us']:9.1f} us {r['eager_us']:9.1f} us {r['tflops']:6.1f} {r['gbs']:7.0f} "
            f"{100 * r['frac_bw']:5.1f}% {100 * r['frac_mm']:5.1f}%  {r['note']}")


def direct(fn):
    """``fn`` with ``wrap_triton`` off, as inside a triton_op's eager call: ``_launch`` called from plain
    Python would otherwise go through the higher-order-op dispatch (hundreds of us of host time)."""
    def run():
        with set_wrap_triton_enabled(False):
            return fn()
    return run


def attempt(group, impl, fn, flops, nbytes, note="", rep_ms=200, sets=1, graph=True):
    """Time ``fn`` (which makes ``sets`` calls over rotating inputs) both ways; failures become rows.

    ``graph=False`` for code that cannot be captured: a failed capture can leave the CUDA RNG in
    capture mode and break every later ``torch.randn``.
    """
    try:
        fn()
        torch.cuda.synchronize()
        eager = bench(fn, rep_ms) / sets
        if not graph:
            ms, note = eager, f"{note} [not capturable: time is eager]"
        else:
            try:
                ms = graph_ms(fn) / sets
            except Exception as exc:  # not capturable: report the eager time and why
                torch.cuda.synchronize()
                ms, note = eager, f"{note} [graph capture failed: {type(exc).__name__}; time is eager]"
        record(group, impl, ms, eager, flops, nbytes, note)
    except Exception as exc:  # keep measuring the rest; the reason goes into the table
        ROWS.append({"group": group, "impl": impl, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(f"  {impl:30s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        traceback.print_exc(limit=2)


_SHORT = {"BLOCK_H": "BH", "BLOCK_M": "BM", "BLOCK_N": "BN", "num_warps": "w", "num_stages": "s", "SPLITS": "sp"}


def cfg_name(c: dict) -> str:
    return "ours " + " ".join(f"{_SHORT.get(k, k)}{v}" for k, v in c.items())


def over_budget(budget_s):
    return time.time() - START > budget_s


def run_sections(sections, json_path: str) -> None:
    """Run each benchmark section in turn (a failing one prints its traceback and the rest still run), writing
    the ceilings and the rows measured so far to ``json_path`` after each, so a run cut short keeps them."""
    for section in sections:
        try:
            section()
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
        with open(json_path, "w") as f:
            json.dump({"ceilings": CEIL, "rows": ROWS}, f, indent=1)


def ceilings():
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    CEIL["copy_gbs"] = 2 * src.numel() / ms / 1e6
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    CEIL["mm_tflops"] = 2 * 8192**3 / ms / 1e9
    props = torch.cuda.get_device_properties(0)
    CEIL.update(device=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__)
    print(f"ceilings: copy {CEIL['copy_gbs']:.0f} GB/s (read+write), bf16 matmul {CEIL['mm_tflops']:.0f} TFLOPS, "
          f"{props.name}, {props.multi_processor_count} SMs", flush=True)


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, steps, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Program p sums the ``BLOCK``-element chunks p, p + P, ..., p + (steps - 1) P of ``x [n]`` (P programs) into
    ``out[p]``."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.range(0, steps, num_stages=STAGES):
        offs = (pid + j * tl.num_programs(0)) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


# (programs a SM, elements a chunk, stages, warps) of the streaming read; its row takes the fastest
READ_CONFIGS = ((4, 4096, 3, 4), (8, 2048, 3, 4), (2, 8192, 3, 8), (4, 8192, 2, 8))
# (elements a chunk, stages, warps) of the streaming read on a given number of programs, one an SM
READ_CONFIGS_FIXED = ((8192, 3, 8), (8192, 4, 8), (16384, 3, 8), (4096, 6, 4))


def read_floor(group, buf, nbytes, programs: int | None = None):
    """A row "read floor": the fastest of ``READ_CONFIGS`` of a plain Triton streaming read of ``buf`` (contiguous,
    the bytes an op must read; from memory where ``buf`` is larger than L2, from L2 where it fits, as the op's own
    replays read it), what one kernel reading that many bytes takes on this GPU. ``programs``
    (at most the SMs): the read on that many programs instead (``READ_CONFIGS_FIXED``), what a kernel of one
    program a sequence can take at best when the sequences are fewer than the SMs."""
    flat = buf.reshape(-1)
    assert flat.numel() < 2**31, "int32 offsets"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = READ_CONFIGS if programs is None else tuple((None, *c) for c in READ_CONFIGS_FIXED)
    best, name = None, ""
    for per_sm, block, stages, warps in configs:
        grid = per_sm * sms if programs is None else programs
        out = torch.empty(grid, dtype=torch.float32, device=DEV)

        def call(grid=grid, block=block, stages=stages, warps=warps, out=out):
            _stream_read_kernel[(grid,)](flat, out, flat.numel(), triton.cdiv(flat.numel(), grid * block),
                                         BLOCK=block, STAGES=stages, num_warps=warps)
        ms = graph_ms(call)
        if best is None or ms < best:
            best, name = ms, (f"{per_sm} a SM" if programs is None else f"{programs} programs") + \
                f", {block} a chunk, {stages} stages, {warps} warps"
    label = "read floor" if programs is None else f"read floor, {programs} programs"
    record(group, label, best, best, 0, nbytes, f"Triton streaming read of the {nbytes / 1e6:.0f} MB, {name}")


def decode_case(B, H, L, sweep, budget_s):
    group = f"decode B={B} L={L} H={H}"
    print(group, flush=True)
    nblk = triton.cdiv(L, PAGE)
    pages = B * nblk
    cache = torch.randn(pages, PAGE, D, device=DEV, dtype=torch.bfloat16) * 0.5
    table = torch.randperm(pages, device=DEV).view(B, nblk).int().contiguous()
    lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
    q = torch.randn(B, 1, H, D, device=DEV, dtype=torch.bfloat16)
    flops = 2 * B * H * L * (D + DC)
    nbytes = B * L * D * 2 + q.numel() * 2 + B * H * DC * 2 + B * H * 4
    ours = lambda: decode(q, cache, table, lens, SCALE, backend="triton")
    cfg = tdecode._pick(H, B, nblk * PAGE, DC, q.device, None, block_size=PAGE, dr=D - DC)
    read_floor(group, cache, B * L * D * 2)  # the cache bytes the call reads (the table holds every page once)
    if B < torch.cuda.get_device_properties(0).multi_processor_count:  # one program a sequence, unsplit: B SMs
        read_floor(group, cache, B * L * D * 2, programs=B)
    attempt(group, "triton (ours)", ours, flops, nbytes,
            note=cfg_name(cfg)[5:])
    for c in sweep:
        attempt(group, cfg_name(c), direct(lambda c=c: tdecode._launch(q, cache, table, lens, SCALE, DC, config=c)),
                flops, nbytes)
    out, lse = ours()

    def against_triton(call):
        """The note of a Gluon row: its largest differences from the Triton kernel's output (or why it failed)."""
        try:
            o2, l2 = call()
            return f"max|out-triton|={(o2.float() - out.float()).abs().max():.2e} " \
                   f"max|lse-triton|={(l2.float() - lse.float()).abs().max():.2e}"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:200]

    for name in ("gluon", "gluon-ws"):  # the sm_90 Gluon kernels, each checked against the Triton kernel
        def gl_call(name=name):
            return decode(q, cache, table, lens, SCALE, backend=name)
        attempt(group, f"{name} (ours)", gl_call, flops, nbytes, note=against_triton(gl_call))
    if torch.cuda.get_device_capability() == (9, 0):  # "gluon"'s other kernels: the PIPE schedule, 64 rows
        from mla_compile.ops.triton import decode_gluon
        variants = [{"PIPE": True, "SWAP": False}] + ([{"SWAP": False}] if H <= decode_gluon.SWAP_ROWS else [])
        if H <= decode_gluon.SWAP_ROWS:  # the swapped kernel persistent (decode_gluon_swap_persist), then the merge
            variants += [{"PERSIST": True}]
        swap = {"SWAP": True}
        if H > decode_gluon.SWAP_ROWS and B <= 16:  # the 16-row kernel at 128 heads: each row block reads the cache
            variants += [swap]
        if H > decode_gluon.SWAP_ROWS:  # the alternating warpgroups (decode_gluon_seesaw), 64 rows a program
            variants += [{"SEESAW": True}, {"SEESAW": True, "FOLD_FIRST": False}, {"SEESAW": True, "TMA_OUT": False},
                         {"SEESAW": True, "TMA_OUT": False, "TMA_Q": False}]
            if B < torch.cuda.get_device_properties(0).multi_processor_count // 2:  # split: the partial rows by TMA
                variants += [{"SEESAW": True, "TMA_OUT": True}]
            # one program an SM over balanced runs of tiles, then the merge (decode_gluon_seesaw_persist)
            variants += [{"SEESAW": True, "PERSIST": True}]
        if B <= 2:  # latency-bound: the swapped kernel at fixed split counts
            variants += [dict(swap, SPLITS=sp) for sp in (8, 32)]
        for cfg in variants:
            def variant(cfg=cfg):
                return decode_gluon.launch(q, cache, table, lens, SCALE, DC, config=cfg)
            name = " ".join(f"{k}={v}" for k, v in cfg.items())
            attempt(group, f"gluon {name} (ours)", variant, flops, nbytes, note=against_triton(variant))

    def torch_naive():
        kv = cache[table.long()].view(B, nblk * PAGE, D)[:, :L]
        p = torch.softmax(torch.einsum("bhd,bld->bhl", q[:, 0], kv).float() * SCALE, -1)
        return torch.einsum("bhl,bld->bhd", p.to(kv.dtype), kv[..., :DC])
    attempt(group, "torch gather+einsum", torch_naive, flops, nbytes, rep_ms=100)
    try:
        import flash_mla
        meta, _ = flash_mla.get_mla_metadata()
        k_cache = cache.view(pages, PAGE, 1, D)
        fm = lambda: flash_mla.flash_mla_with_kvcache(q, k_cache, table, lens, DC, meta, softmax_scale=SCALE,
                                                      causal=False, use_legacy=True)
        o2, l2 = fm()
        diff = f"max|out-ours|={(o2.float() - out.float()).abs().max():.2e} " \
               f"max|lse-ours|={(l2[:, :, 0].float() - lse[:, 0]).abs().max():.2e}"
        attempt(group, "FlashMLA", fm, flops, nbytes, note=diff)
    except Exception as exc:
        ROWS.append({"group": group, "impl": "FlashMLA", "error": repr(exc)[:300]})
        print(f"  FlashMLA unavailable: {exc!r:.200}", flush=True)
    if over_budget(budget_s):
        print("  FlashInfer skipped: time budget", flush=True)
        return
    try:
        import flashinfer
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=DEV))
        indptr = torch.arange(B + 1, device=DEV, dtype=torch.int32)
        w.plan(indptr, indptr * nblk, table.reshape(-1).contiguous(), lens, H, DC, DR, PAGE, False, SCALE,
               torch.bfloat16, torch.bfloat16)
        qn, qp = q[:, 0, :, :DC].contiguous(), q[:, 0, :, DC:].contiguous()
        fi = lambda: w.run(qn, qp, cache[..., :DC], cache[..., DC:], return_lse=True)
        o3, l3 = fi()
        diff = f"max|out-ours|={(o3.float() - out[:, 0].float()).abs().max():.2e} " \
               f"max|lse*ln2-ours|={(l3.float() * math.log(2) - lse[:, 0]).abs().max():.2e}"
        attempt(group, "FlashInfer MLA", fi, flops, nbytes, note=diff)
    except Exception as exc:
        ROWS.append({"group": group, "impl": "FlashInfer MLA", "error": repr(exc)[:300]})
        print(f"  FlashInfer unavailable: {exc!r:.200}", flush=True)
    through_ours(group, flops, nbytes, {
        "flashmla": lambda: lambda: decode(q, cache, table, lens, SCALE, backend="flashmla"),
        "flashinfer": lambda: _fi_decode(q, cache, table, lens, H),
    })


def _fi_decode(q, cache, table, lens, H):
    from mla_compile.ops.adapters.flashinfer import plan_flashinfer_decode
    plan = plan_flashinfer_decode(table.cpu(), lens.cpu(), num_heads=H, block_size=PAGE, scale=SCALE,
                                  dtype=torch.bfloat16, use_cuda_graph=True)
    return lambda: decode(q, cache, table, lens, SCALE, backend="flashinfer", plan=plan)


def through_ours(group, flops, nbytes, calls: dict):
    """Rows for our ops with a peer backend (``ops.decode(..., backend=name)``): the wrapper's overhead
    (custom op, LSE conversion, empty-row fix-up) shows against the raw library rows above."""
    for name, make in calls.items():
        try:
            fn = make()
            if isinstance(fn, tuple):  # (fn, capturable)
                fn, graph = fn
            else:
                graph = True
        except Exception as exc:
            ROWS.append({"group": group, "impl": f"ours via {name}", "error": repr(exc)[:300]})
            continue
        attempt(group, f"ours via {name}", fn, flops, nbytes, graph=graph)


GLUON_SWEEP = [dict(BLOCK_N=128, HEADS_FIRST=False), dict(WS=True, HEADS_FIRST=True),
               dict(WS=True, HEADS_FIRST=False), dict(WS=True, HEADS_FIRST=False, FOLD_SCALE=False),
               dict(WS=True, BLOCK_N=64, STAGES=3, HEADS_FIRST=False),
               dict(WS=True, KV_SPLIT=False, PIPE=False, HEADS_FIRST=False),
               # FA3's inter-warpgroup ping-pong: on the default (pipelined) consumers, on FA3's unpipelined
               # schedule (keys and values on barriers of their own) and on 64-key tiles in 3 slots
               dict(WS=True, HEADS_FIRST=False, PINGPONG=True),
               dict(WS=True, PIPE=False, HEADS_FIRST=False, PINGPONG=True),
               dict(WS=True, BLOCK_N=64, STAGES=3, HEADS_FIRST=False, PINGPONG=True),
               # persistent programs (one an SM looping over the work items, heads-fastest)
               dict(WS=True, PERSIST=True)]


def prefill_case(NS, LQ, H, sweep, budget_s, tma_sweep=(), gluon=True, gluon_sweep=None):
    """Causal prefill of ``NS`` sequences of ``LQ`` tokens at ``H`` heads: ours (and the ``sweep`` configs), the
    TMA kernel in each ``tma_sweep`` config and, on sm_90 with ``gluon``, the Gluon kernels in ``gluon_sweep``
    (default ``GLUON_SWEEP`` where ``tma_sweep`` is given, none otherwise; each with its largest difference from
    ours), then the peers (SDPA, FlashInfer; through our op unless sweeping)."""
    if gluon_sweep is None:
        gluon_sweep = GLUON_SWEEP if tma_sweep else ()
    group = f"prefill causal {NS}x{LQ} H={H} qk192/v128"
    print(group, flush=True)
    T = NS * LQ
    q = torch.randn(T, H, 192, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(T, H, 192, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(T, H, 128, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(NS + 1, device=DEV, dtype=torch.int32) * LQ
    flops = 2 * NS * H * (LQ * (LQ + 1) / 2) * (192 + 128)
    nbytes = (q.numel() + k.numel() + v.numel() + T * H * 128) * 2 + T * H * 4
    attempt(group, "triton (ours)", lambda: prefill(q, k, v, cu, cu, SCALE, causal=True, backend="triton"),
            flops, nbytes, note=cfg_name(tprefill._pick(192, 128, None))[5:])
    for c in sweep:
        attempt(group, cfg_name(c), direct(lambda c=c: tprefill._launch(q, k, v, cu, cu, SCALE, True, config=c)),
                flops, nbytes)
    if tma_sweep or gluon_sweep:
        from mla_compile.ops.triton import prefill_tma

        want = prefill(q, k, v, cu, cu, SCALE, causal=True, backend="triton")[0].float()
        cands = [(prefill_tma.config_name(c), lambda c=c: prefill_tma.launch(q, k, v, cu, cu, SCALE, True, config=c))
                 for c in tma_sweep]
        if gluon and torch.cuda.get_device_capability() == (9, 0):
            from mla_compile.ops.triton import prefill_gluon

            cands += [("gluon " + " ".join(f"{a}={b}" for a, b in c.items()),
                       lambda c=c: prefill_gluon.launch(q, k, v, cu, cu, SCALE, True, config=c)) for c in gluon_sweep]
        for name, fn in cands:
            try:
                got = fn()[0].float()
                note = f"max|d| vs ours {float((got - want).abs().max()):.1e}"
            except Exception as exc:
                ROWS.append({"group": group, "impl": name, "error": repr(exc)[:300]})
                print(f"  {name} failed: {exc!r:.200}", flush=True)
                continue
            attempt(group, name, fn, flops, nbytes, note=note)
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            qs, ks, vs = (x.view(NS, LQ, H, -1).transpose(1, 2) for x in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE)
            attempt(group, "torch SDPA cuDNN", cudnn, flops, nbytes, rep_ms=100)
        except Exception as exc:
            ROWS.append({"group": group, "impl": "torch SDPA cuDNN", "error": repr(exc)[:300]})
    qs, ks, vs = (x.view(NS, LQ, H, -1).transpose(1, 2) for x in (q, k, v))
    attempt(group, "torch SDPA (default backend)",
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE), flops, nbytes, rep_ms=100)
    if over_budget(budget_s):
        print("  FlashInfer prefill skipped: time budget", flush=True)
        return
    try:
        import flashinfer
        w = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=DEV), "NHD")
        w.plan(cu, cu, H, H, 192, head_dim_vo=128, causal=True, sm_scale=SCALE, q_data_type=torch.bfloat16)
        attempt(group, "FlashInfer ragged prefill", lambda: w.run(q, k, v), flops, nbytes)
    except Exception as exc:
        ROWS.append({"group": group, "impl": "FlashInfer ragged prefill", "error": repr(exc)[:300]})
        print(f"  FlashInfer prefill unavailable: {exc!r:.200}", flush=True)
    if tma_sweep:
        return
    through_ours(group, flops, nbytes, {
        "flashinfer": lambda: _fi_prefill(q, k, v, cu, H),
        "sdpa-cudnn": lambda: (lambda: prefill(q, k, v, cu, cu, SCALE, causal=True, backend="sdpa-cudnn"), False),
    })


def _fi_prefill(q, k, v, cu, H):
    from mla_compile.ops.adapters.flashinfer import plan_flashinfer_prefill
    plan = plan_flashinfer_prefill(cu.cpu(), cu.cpu(), num_heads=H, head_dim_qk=192, head_dim_v=128, scale=SCALE,
                                   dtype=torch.bfloat16, causal=True)
    return lambda: prefill(q, k, v, cu, cu, SCALE, causal=True, backend="flashinfer", plan=plan)


def skinny_cases():
    """``mla::skinny_linear`` (our GEMV, both weights in one launch) against ``F.linear`` per weight (cuBLAS) at the
    decode step's projections and few rows; 4 rotating weight sets, so the weights come from memory."""
    from mla_compile.ops import skinny_linear

    shapes = {"v2-lite q_proj+kv_a": (2048, (3072, 576)), "v2-lite o_proj": (2048, (2048,)),
              "v3 q_a+kv_a": (7168, (1536, 576)), "v3 o_proj": (16384, (7168,))}
    for name, (K, Ns) in shapes.items():
        sets = [[torch.randn(N, K, device=DEV, dtype=torch.bfloat16) / K ** 0.5 for N in Ns] for _ in range(4)]
        nbytes = sum(N * K * 2 for N in Ns)
        for M in (1, 2, 8, 16):
            group = f"linear {name} M={M}"
            print(group, flush=True)
            x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
            want = [torch.nn.functional.linear(x.double(), w.double()) for w in sets[0]]
            got = skinny_linear(x, sets[0], backend="triton")
            err = max(float((g.double() - r).norm() / r.norm()) for g, r in zip(got, want))
            flops = M * nbytes  # 2 M N K, with nbytes = 2 N K (bf16 weights)
            attempt(group, "skinny triton (ours)", lambda: [skinny_linear(x, ws, backend="triton") for ws in sets],
                    flops, nbytes, note=f"rel err {err:.1e}", sets=4)
            attempt(group, "F.linear (cuBLAS)", lambda: [[torch.nn.functional.linear(x, w) for w in ws] for ws in sets],
                    flops, nbytes, sets=4)


def _rotation(nbytes: int, cap: int = 256) -> int:
    """Input sets to rotate over so that ``nbytes`` each add up past the 60 MB L2 (weights come from memory)."""
    return max(4, min(cap, math.ceil((96 << 20) / nbytes)))


def few_token_cases():
    """The few-token decode kernels against what they replace, at 1 and 2 tokens: ``mla::moe_gate_route`` (router
    GEMV + routing, one launch) against ``torch.mm(out_dtype=float32)`` + ``mla::moe_route``'s kernel, and
    ``mla::skinny_absorb_q`` / ``_out`` (per-head GEMVs) against the einsum forms (cuBLAS bmm + copy) and
    ``mla::absorb_q`` / ``_out`` (bmm into place); weights rotated past L2."""
    from mla_compile.ops import moe_gate_route, moe_route, skinny_absorb_out, skinny_absorb_q
    from mla_compile.ops import absorb as absorb_ops
    from mla_compile.ops.triton import moe_gate_route as tmg
    from mla_compile.ops.triton import skinny_absorb as tsa

    routings = {"v2-lite 64x2048 softmax top-6": (64, 2048, 6, 1, 1, "softmax", False, False, 1.0),
                "v3 256x7168 sigmoid groups top-8": (256, 7168, 8, 8, 4, "sigmoid", True, True, 2.5),
                "v3 routing at 256x2048": (256, 2048, 8, 8, 4, "sigmoid", True, True, 2.5)}
    # the fused kernel's CONFIG (gate elements a program loads a step, most experts a program reads, warps; no
    # few-experts override)
    sweep = [dict(tile=t, max_slice=m, num_warps=w, few_experts=0) for t, m, w in (
        (8192, 1, 4), (8192, 2, 4), (4096, 1, 4), (2048, 1, 2), (4096, 1, 2), (8192, 1, 8), (8192, 4, 4))]
    for name, (E, H, k, G, TG, scoring, has_bias, renorm, scaling) in routings.items():
        nbytes = E * H * 2
        K = _rotation(nbytes)
        gates = [torch.randn(E, H, device=DEV, dtype=torch.bfloat16) / H ** 0.5 for _ in range(K)]
        bias = torch.randn(E, device=DEV) * 0.1 if has_bias else None
        kw = dict(bias=bias, num_group=G, topk_group=TG, scoring=scoring, renormalize=renorm, scaling=scaling)
        for T in (1, 2):
            group = f"router+route {name} T={T}"
            print(group, flush=True)
            x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            want = moe_route(torch.mm(x, gates[0].t(), out_dtype=torch.float32), k, backend="triton", **kw)[1]
            got = moe_gate_route(x, gates[0], k, backend="triton", **kw)[1]
            same = bool((got.sort(-1).values == want.sort(-1).values).all())
            fused = tmg.fusable(x, gates[0])
            attempt(group, "moe_gate_route triton (ours)",
                    lambda: [moe_gate_route(x, g, k, backend="triton", **kw) for g in gates], T * nbytes, nbytes,
                    note=f"{'fused kernel' if fused else 'mm + route inside the op'}; ids as mm+route: {same}",
                    sets=K)
            default = dict(tmg.CONFIG)
            for config in sweep:  # the fused kernel itself, also where the op does not take it
                tmg.CONFIG.update(config)
                attempt(group, f"fused kernel tile{config['tile']} slice<={config['max_slice']} "
                        f"w{config['num_warps']}",
                        lambda: [tmg._launch(x, g, bias, k, G, TG, scoring, renorm, scaling) for g in gates],
                        T * nbytes, nbytes, sets=K)
            tmg.CONFIG.update(default)
            attempt(group, "mm(out f32) + route kernel",
                    lambda: [moe_route(torch.mm(x, g.t(), out_dtype=torch.float32), k, backend="triton", **kw)
                             for g in gates], T * nbytes, nbytes, sets=K)
    for name, Hh in (("v2-lite H=16", 16), ("v3 H=128", 128)):
        N = V = 128
        kv_bytes = Hh * (N + V) * DC * 2
        K = _rotation(kv_bytes)
        views = [torch.randn(Hh * (N + V), DC, device=DEV, dtype=torch.bfloat16).view(Hh, N + V, DC) / DC ** 0.5
                 for _ in range(K)]
        w_uk = [w[:, :N] for w in views]
        w_uv = [w[:, N:] for w in views]
        nbytes = kv_bytes // 2
        for T in (1, 2):
            q_nope = torch.randn(T, Hh, N, device=DEV, dtype=torch.bfloat16)
            q_pe = torch.randn(T, Hh, DR, device=DEV, dtype=torch.bfloat16)
            lat = torch.randn(T, Hh, DC, device=DEV, dtype=torch.bfloat16)
            flops = T * nbytes  # 2 T H N C, with nbytes = 2 H N C (bf16 weights)
            group = f"absorb_q {name} T={T}"
            print(group, flush=True)
            want = torch.einsum("thn,hnc->thc", q_nope.double(), w_uk[0].double())
            err = float((skinny_absorb_q(q_nope, w_uk[0], q_pe, backend="triton")[..., :DC].double() - want).norm()
                        / want.norm())
            attempt(group, "skinny_absorb_q triton (ours)",
                    lambda: [skinny_absorb_q(q_nope, w, q_pe, backend="triton") for w in w_uk], flops, nbytes,
                    note=f"rel err {err:.1e}", sets=K)
            for block_c in (32, 128):  # the kernel's column tile (64 above)
                tsa.Q_BLOCK_C = block_c
                attempt(group, f"skinny_absorb_q triton BC{block_c}",
                        lambda: [skinny_absorb_q(q_nope, w, q_pe, backend="triton") for w in w_uk], flops, nbytes,
                        sets=K)
            tsa.Q_BLOCK_C = 64
            attempt(group, "einsum + cat (bmm + copy)",
                    lambda: [absorb_ops.absorb_q_reference(q_nope, w, q_pe) for w in w_uk], flops, nbytes, sets=K)
            attempt(group, "mla::absorb_q (bmm into place)",
                    lambda: [torch.ops.mla.absorb_q(q_nope, w, q_pe) for w in w_uk], flops, nbytes, sets=K)
            group = f"absorb_out {name} T={T}"
            print(group, flush=True)
            want = torch.einsum("thc,hvc->thv", lat.double(), w_uv[0].double()).reshape(T, -1)
            err = float((skinny_absorb_out(lat, w_uv[0], backend="triton").double() - want).norm() / want.norm())
            attempt(group, "skinny_absorb_out triton (ours)",
                    lambda: [skinny_absorb_out(lat, w, backend="triton") for w in w_uv], flops, nbytes,
                    note=f"rel err {err:.1e}", sets=K)
            for block_v in (8, 32):  # the kernel's value-row tile (16 above)
                tsa.OUT_BLOCK_V = block_v
                attempt(group, f"skinny_absorb_out triton BV{block_v}",
                        lambda: [skinny_absorb_out(lat, w, backend="triton") for w in w_uv], flops, nbytes, sets=K)
            tsa.OUT_BLOCK_V = 16
            attempt(group, "einsum + reshape (bmm + copy)",
                    lambda: [absorb_ops.absorb_out_reference(lat, w) for w in w_uv], flops, nbytes, sets=K)
            attempt(group, "mla::absorb_out (bmm into place)",
                    lambda: [torch.ops.mla.absorb_out(lat, w) for w in w_uv], flops, nbytes, sets=K)


def small_ops(t_merge=1024, t_write=8192, n_seqs=8, ctx=4096):
    """Merge, cache write and gather at serving sizes (smaller ones for a dry run)."""
    # merge: two [T, H, 512] partials + LSEs -> one (134 MB per partial: no rotation needed)
    T, H = t_merge, 128
    oa, ob = (torch.randn(T, H, DC, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    la, lb = (torch.randn(T, H, device=DEV) for _ in range(2))
    group = f"merge T={T} H={H} D={DC}"
    print(group, flush=True)
    nbytes = 3 * oa.numel() * 2 + 3 * la.numel() * 4
    attempt(group, "triton (ours)", lambda: merge_attn_states(oa, la, ob, lb, backend="triton"), 0, nbytes)
    attempt(group, "torch reference op", lambda: merge_attn_states(oa, la, ob, lb, backend="reference"), 0, nbytes)
    attempt(group, "ours via flashinfer", lambda: merge_attn_states(oa, la, ob, lb, backend="flashinfer"), 0, nbytes)
    # cache write: 8192 new tokens scattered into a 600 MB cache; 8 rotating input sets
    T, K = t_write, 8
    cache = torch.randn(64 * T // PAGE, PAGE, D, device=DEV, dtype=torch.bfloat16)
    sets = [(torch.randn(T, DC, device=DEV, dtype=torch.bfloat16), torch.randn(T, DR, device=DEV, dtype=torch.bfloat16),
             torch.randperm(cache.shape[0] * PAGE, device=DEV)[:T].int()) for _ in range(K)]
    group = f"cache write T={T} bf16"
    print(group, flush=True)
    nbytes = 2 * T * D * 2 + T * 4
    for backend in ("triton", "reference"):  # the reference's index_put_ failed capture on the H200
        attempt(group, "triton (ours)" if backend == "triton" else "torch reference op",
                lambda b=backend: [write_latent_cache(*x, cache, backend=b) for x in sets], 0, nbytes, sets=K,
                graph=backend == "triton")
    # gather: 8 sequences x 4096 context tokens into a workspace; 4 rotating tables/workspaces
    N, L, K = n_seqs, ctx, 4
    nblk = L // PAGE
    cache = torch.randn(K * N * nblk + 8, PAGE, D, device=DEV, dtype=torch.bfloat16)
    perm = torch.randperm(cache.shape[0], device=DEV)
    tables = [perm[i * N * nblk:(i + 1) * N * nblk].view(N, nblk).int() for i in range(K)]
    works = [torch.empty(N * L, D, device=DEV, dtype=torch.bfloat16) for _ in range(K)]
    cu = torch.arange(N + 1, device=DEV, dtype=torch.int32) * L
    starts = torch.zeros(N, device=DEV, dtype=torch.int32)
    group = f"gather {N}x{L} rows"
    print(group, flush=True)
    nbytes = 2 * works[0].numel() * 2
    for backend in ("triton", "reference"):
        attempt(group, "triton (ours)" if backend == "triton" else "torch reference op",
                lambda b=backend: [gather_latent_cache(cache, t, cu, starts, w, backend=b)
                                   for t, w in zip(tables, works)],
                0, nbytes, sets=K)


def table_text() -> str:
    lines = [f"device {CEIL.get('device')} ({CEIL.get('sms')} SMs), torch {CEIL.get('torch')}, triton "
             f"{CEIL.get('triton')}; ceilings: copy {CEIL.get('copy_gbs', 0):.0f} GB/s (read+write), "
             f"bf16 matmul {CEIL.get('mm_tflops', 0):.0f} TFLOPS",
             "time = CUDA-graph replay per call (GPU time); eager = do_bench on the Python call (with dispatch)"]
    group = None
    for r in ROWS:
        if r["group"] != group:
            group = r["group"]
            lines.append(f"\n{group}\n  {'impl':30s} {'time':>12s} {'eager':>12s} {'TFLOPS':>6s} {'GB/s':>7s} "
                         f"{'%bw':>6s} {'%mm':>6s}")
        lines.append("  " + _fmt(r))
    return "\n".join(lines)


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in ROWS))
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.2 * len(groups) + 1), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        rows = [r for r in ROWS if r["group"] == g and "us" in r]
        names = [r["impl"] for r in rows]
        colors = ["tab:orange" if n.startswith(("triton", "ours")) else "tab:blue" for n in names]
        ax.barh(names, [r["us"] for r in rows], color=colors)
        ax.set_title(g, fontsize=9)
        ax.set_xlabel("median GPU time per call (us, CUDA-graph replay), lower is better", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_kernels.{json,txt,png}")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip FlashInfer (JIT builds) past this")
    ap.add_argument("--quick", action="store_true", help="no config sweeps")
    ap.add_argument("--skinny", action="store_true", help="only mla::skinny_linear against F.linear at few rows")
    ap.add_argument("--few-tokens", action="store_true",
                    help="only the few-token kernels (mla::moe_gate_route, mla::skinny_absorb_q/out) against what "
                         "they replace, at 1 and 2 tokens")
    ap.add_argument("--decode", action="store_true",
                    help="only the decode sections (H=128 B=128, H=16 B=128, H=128 B=1, and H=128 B=66 L=512 with its "
                         "cache resident in L2: not rotated)")
    ap.add_argument("--prefill-sweep", action="store_true",
                    help="only causal prefill (8 x 4096 and 2 x 1024 tokens, 128 and 16 heads): our pointer, TMA and "
                         "(sm_90) Gluon kernels in each candidate configuration against FlashInfer and cuDNN SDPA")
    ap.add_argument("--no-gluon", action="store_true", help="--prefill-sweep without the Gluon kernels")
    ap.add_argument("--prefill-persist", action="store_true",
                    help="only causal prefill (8 x 4096 at 128 and 16 heads, 2 x 1024 at 128): the warp-specialized "
                         "Gluon kernel per program and persistent (PERSIST), each with its output by TMA and "
                         "without, against FlashInfer")
    ap.add_argument("--swap-sweep", action="store_true",
                    help="only decode at 128 heads and few sequences (B = 2 / 4 / 8 / 16, L = 4096; B = 1, L = 8192): the "
                         "Gluon kernel's 16-row (SWAP) and 64-row programs against the peers")
    ap.add_argument("--small", action="store_true",
                    help="only the latency-bound decode (B=1, H=16, L=4096, swept over split counts; B=2 H=16 and B=1 "
                         "H=128), with the Gluon swapped kernel at 8 and 32 splits")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    ceilings()
    dsweep_128 = [] if args.quick else [
        dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3, SPLITS=1),   # run 1's default
        dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2, SPLITS=2),
    ]
    dsweep_16 = [] if args.quick else [
        dict(BLOCK_H=16, BLOCK_N=32, num_warps=8, num_stages=3),   # run 1's default
        dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=4),
        dict(BLOCK_H=16, BLOCK_N=64, num_warps=8, num_stages=3, SPLITS=6),
    ]
    psweep = [] if args.quick else [
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    ]
    if args.prefill_sweep:
        tsweep = [{}, dict(BLOCK_N=64, num_stages=3), dict(HEADS_FIRST=True)]
        sections = [lambda ns=ns, lq=lq, h=h: prefill_case(ns, lq, h, psweep, args.budget_s, tsweep,
                                                                          not args.no_gluon)
                    for ns, lq in ((8, 4096), (2, 1024)) for h in (128, 16)]
    elif args.prefill_persist:
        persist = [dict(WS=True), dict(WS=True, TMA_OUT=False), dict(WS=True, PERSIST=True),
                   dict(WS=True, PERSIST=True, TMA_OUT=False)]
        sections = [lambda ns=ns, lq=lq, h=h: prefill_case(ns, lq, h, [], args.budget_s, gluon_sweep=persist)
                    for ns, lq, h in ((8, 4096, 128), (8, 4096, 16), (2, 1024, 128))]
    elif args.skinny:
        sections = [skinny_cases]
    elif args.few_tokens:
        sections = [few_token_cases]
    elif args.decode:
        # B=66 L=512 H=128: one wave of 64-row programs (2 a sequence on 132 SMs) over a 39 MB cache that stays in
        # L2 across the replays: set against B=128 L=4096, whether the 128-head gap to FlashMLA is in waiting for
        # memory (it closes here) or not (#27)
        sections = [lambda: decode_case(128, 128, 4096, dsweep_128, args.budget_s),
                    lambda: decode_case(128, 16, 8192, dsweep_16, args.budget_s),
                    lambda: decode_case(1, 128, 4096, [], args.budget_s),
                    lambda: decode_case(66, 128, 512, [], args.budget_s)]
    elif args.swap_sweep:
        sections = [lambda b=b, l=l: decode_case(b, 128, l, [], args.budget_s)
                    for b, l in ((2, 4096), (4, 4096), (8, 4096), (16, 4096), (1, 8192))]
    elif args.small:
        ssweep = [dict(BLOCK_H=16, BLOCK_N=n, num_warps=w, num_stages=st, SPLITS=sp) for sp in (16, 32, 64)
                  for n, w, st in ((64, 8, 3), (32, 4, 3))]
        sections = [lambda: decode_case(1, 16, 4096, ssweep, args.budget_s),
                    lambda: decode_case(2, 16, 4096, [], args.budget_s),
                    lambda: decode_case(1, 128, 4096, [], args.budget_s)]
    else:
        sections = [lambda: decode_case(128, 128, 4096, dsweep_128, args.budget_s),
                    lambda: decode_case(128, 16, 8192, dsweep_16, args.budget_s),
                    lambda: prefill_case(8, 4096, 128, psweep, args.budget_s),
                    small_ops]
    run_sections(sections, os.path.join(args.out, "bench_kernels.json"))
    text = table_text()
    with open(os.path.join(args.out, "bench_kernels.txt"), "w") as f:
        f.write(text + "\n")
    try:
        plot(os.path.join(args.out, "bench_kernels.png"))
    except Exception as exc:
        print(f"plot failed: {exc!r}")
    print("\n" + text)


if __name__ == "__main__":
    main()
