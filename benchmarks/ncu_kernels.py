"""Hardware counters of our headline kernels and the peers' at the same shapes, under Nsight Compute (#27).

    ncu --clock-control none --profile-from-start off -k regex:'KERNELS' --section SpeedOfLight \
        --section WarpStateStats --section ComputeWorkloadAnalysis --csv --page raw \
        python benchmarks/ncu_kernels.py [--cases decode16,decode128,fp8,sparse,prefill,b1,fp4moe,moe256] > ncu.csv
    python benchmarks/ncu_kernels.py --summarize ncu.csv        # the short table (no GPU needed)

    ncu ... -k regex:seesaw -c 1 --section SourceCounters --section WarpStateStats -o rep \
        python benchmarks/ncu_kernels.py --cases decode128
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/ncu_kernels.py --source src.csv            # where one kernel's warps stall, per instruction

The first form runs each case's calls once between ``cudaProfilerStart`` / ``Stop`` (after one call outside
them, so the JIT compiles and the peers' plans happen before): ncu profiles every launch in there of a kernel
whose name matches ``-k``. ``--print-regex`` prints a regex of every kernel of the cases (ours and the peers'). The
second form reads ncu's CSV and prints, per kernel launch: duration, DRAM throughput (% of peak), SM
throughput, tensor-pipe utilization, and the top three warp stall reasons (warps stalled per issued instruction).
Shapes: ``decode16`` bf16 decode B=128 L=8192 H=16 (ours Gluon, FlashMLA); ``decode128`` bf16 B=128 L=4096
H=128 (ours Gluon 64-row, Gluon-ws, Gluon-seesaw, FlashMLA); ``short128`` B=66 L=64 H=128, one tile a program
(Gluon-seesaw, FlashMLA); ``fp8`` fp8 decode B=128 L=4096 H=128 (gluon64, FlashMLA's fp8
sparse kernel over the whole table); ``sparse`` top-2048 B=128 H=128 fp8 cache (gluon64, FlashMLA); ``prefill``
causal 8 x 4096 H=128 qk192/v128 (Triton, TMA, Gluon, Gluon-ws, Gluon-ws ``PERSIST``); ``b1`` bf16 decode B=1
L=4096 H=16 (Gluon); ``fp4moe`` V4-Flash's fp4 routed experts (256 experts top-6, hidden 4096, intermediate
2048) at 64 tokens (the Gluon kernels over the rows sorted by expert) and at 1 (per pick); ``moe256`` V2-Lite's bf16
routed + 2 shared experts (64 top-6, hidden 2048, intermediate 1408) at 256 tokens (the grouped Triton kernels, #28's
largest batch).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys

KERNELS = ("decode_gluon|gluon64|sparse_decode_gluon|prefill_gluon|_prefill_tma_kernel|_prefill_kernel|"
           "_decode_reduce|flash_fwd|sparse|mla|_moe_")
SCALE = 1 / math.sqrt(192)
PAGE, DC, D, W = 64, 512, 576, 656


def _dense(B, L, H, dev, fp8=False, seed=0):
    import torch

    from mla_compile.ops.fp8_cache import quantize_fp8_rows

    gen = torch.Generator(device=dev).manual_seed(seed)
    nblk = -(-L // PAGE)
    pages = B * nblk
    cache = (torch.randn(pages, PAGE, D, device=dev, generator=gen) * 0.5).bfloat16()
    if fp8:
        rows = cache.view(-1, D)
        cache = quantize_fp8_rows(rows[:, :DC], rows[:, DC:]).view(pages, PAGE, W)
    table = torch.randperm(pages, device=dev, generator=gen).view(B, nblk).int().contiguous()
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    q = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    return q, cache, table, lens


def cases(names: list[str], dev: str = "cuda") -> list[tuple[str, object]]:
    """``(label, call)`` of every kernel run of the named cases."""
    import torch

    from mla_compile.ops import decode, decode_fp8, prefill, sparse_decode

    out = []
    if "decode16" in names:
        q, c, t, n = _dense(128, 8192, 16, dev)
        out += [(f"decode16 {b}", lambda b=b, a=(q, c, t, n): decode(*a, SCALE, backend=b))
                for b in ("gluon", "flashmla")]
    if "decode128" in names:
        q, c, t, n = _dense(128, 4096, 128, dev)
        out += [(f"decode128 {b}", lambda b=b, a=(q, c, t, n): decode(*a, SCALE, backend=b))
                for b in ("gluon", "gluon-ws", "gluon-seesaw", "flashmla")]
    if "short128" in names:  # one 64-key tile a program: what a program costs besides its tiles
        q, c, t, n = _dense(66, 64, 128, dev)
        out += [(f"short128 {b}", lambda b=b, a=(q, c, t, n): decode(*a, SCALE, backend=b))
                for b in ("gluon-seesaw", "flashmla")]
    if "fp8" in names:
        q, c, t, n = _dense(128, 4096, 128, dev, fp8=True)
        out += [(f"fp8 {b}", lambda b=b, a=(q, c, t, n): decode_fp8(*a, SCALE, backend=b)) for b in ("gluon64", "flashmla")]
    if "sparse" in names:
        _, c, t, _ = _dense(128, 8192, 1, dev, fp8=True, seed=1)
        q = torch.randn(128, 1, 128, D, device=dev, dtype=torch.bfloat16)
        pos = torch.rand(128, 8192, device=dev).topk(2048, dim=-1).indices
        idx = (t.long().gather(1, pos // PAGE) * PAGE + pos % PAGE).int()[:, None].contiguous()
        out += [(f"sparse {b}", lambda b=b, a=(q, c, idx): sparse_decode(*a, SCALE, backend=b))
                for b in ("gluon64", "flashmla")]
    if "prefill" in names:
        T, H = 8 * 4096, 128
        q, k = (torch.randn(T, H, 192, device=dev, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(T, H, 128, device=dev, dtype=torch.bfloat16)
        cu = torch.arange(9, device=dev, dtype=torch.int32) * 4096
        out += [(f"prefill {b}", lambda b=b, a=(q, k, v, cu, cu): prefill(*a, SCALE, causal=True, backend=b))
                for b in ("triton", "triton-tma", "gluon", "gluon-ws")]
        from mla_compile.ops.triton import prefill_gluon

        out += [("prefill gluon-ws PERSIST", lambda a=(q, k, v, cu, cu): prefill_gluon.launch(
            *a, SCALE, True, config={"WS": True, "PERSIST": True}))]
    if "b1" in names:
        q, c, t, n = _dense(1, 4096, 16, dev)
        out += [("b1 gluon", lambda a=(q, c, t, n): decode(*a, SCALE, backend="gluon"))]
    if "fp4moe" in names:
        out += [(f"fp4moe T={T}", call) for T, call in ((64, _fp4_experts(64, dev)), (1, _fp4_experts(1, dev)))]
    if "moe256" in names:
        out += [("moe256 grouped", _bf16_experts(256, dev))]
    return out


def _routing(T: int, E: int, k: int, dev: str, seed: int):
    """``(weights [T, k] float32, ids [T, k] int64)``: k distinct random experts a token."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.rand(T, E, device=dev, generator=gen).argsort(dim=-1)[:, :k].contiguous()
    return torch.rand(T, k, device=dev, generator=gen), ids


def _fp4_experts(T: int, dev: str, E: int = 256, H: int = 4096, I: int = 2048, k: int = 6, backend: str = "gluon"):
    """One call of ``mla::moe_experts_fp4`` (``backend``) at V4-Flash's expert dims over ``T`` tokens: random packed
    codes, scale bytes near 2^-7."""
    import torch

    from mla_compile.ops.moe_experts_fp4 import moe_experts_fp4

    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
    weights, ids = _routing(T, E, k, dev, T)
    w = []
    for n, kk in ((I, H), (I, H), (H, I)):  # gate, up, down: packed codes then scales
        w += [torch.randint(0, 256, (E, n, kk // 2), dtype=torch.uint8, device=dev, generator=gen),
              torch.randint(117, 123, (E, n, kk // 32), dtype=torch.uint8, device=dev, generator=gen)]
    return lambda: moe_experts_fp4(x, weights, ids, *w, swiglu_limit=10.0, backend=backend)


def _bf16_experts(T: int, dev: str, E: int = 64, H: int = 2048, I: int = 1408, k: int = 6, shared: int = 2,
                  backend: str = "triton-grouped"):
    """One call of ``mla::moe_experts`` (``backend``; "triton-grouped": the grouped Triton kernels the full-depth step
    takes at large batches; "grouped" would be torch's ``_grouped_mm``) at V2-Lite's dims over
    ``T`` tokens, its shared experts folded in."""
    import torch

    from mla_compile.ops import moe_experts

    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
    weights, ids = _routing(T, E, k, dev, T)

    def rand(*shape):
        return (torch.randn(*shape, device=dev, generator=gen) * 0.02).bfloat16()

    gate_up, down = rand(E, 2 * I, H), rand(E, H, I)
    sg, su, sd = rand(shared * I, H), rand(shared * I, H), rand(H, shared * I)
    return lambda: moe_experts(x, weights, ids, gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd,
                               backend=backend)


def run(names: list[str]) -> None:
    """Each call of the named cases once outside and once inside ``cudaProfilerStart`` / ``Stop``; a case that
    fails is reported on stderr and skipped."""
    import torch

    for label, call in cases(names):
        try:
            call()  # untimed: JIT compile, plans, autotune
            torch.cuda.synchronize()
            print(f"# {label}", file=sys.stderr, flush=True)
            torch.cuda.profiler.start()  # ncu --profile-from-start off: only this call's kernels
            call()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        except Exception as exc:  # a peer missing or refusing the shape: say so, go on
            print(f"# {label} failed: {type(exc).__name__}: {exc}"[:300], file=sys.stderr, flush=True)


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def summarize(path: str) -> str:
    """The short table of an ncu ``--csv --page raw`` file (a header row of metric names, a row of units, then a
    row per kernel launch): duration, DRAM and SM throughput (% of peak, elapsed), the busiest tensor pipe (% of
    peak), and the three largest warp stall reasons (warps stalled per issued instruction)."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own log lines (==PROF==) are not CSV
    table = list(csv.reader(lines))
    if len(table) < 3:
        return "no kernel rows in " + path
    head, units, rows = table[0], table[1], table[2:]
    col = {name: i for i, name in enumerate(head)}
    tensor = [i for i, n in enumerate(head) if "pipe_tensor" in n and ".avg.pct_of_peak_sustained_active" in n]
    stall_prefix, stall_suffix = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    stalls = [(i, n[len(stall_prefix):-len(stall_suffix)]) for i, n in enumerate(head)
              if n.startswith(stall_prefix) and n.endswith(stall_suffix)]
    dur = col.get("gpu__time_duration.sum")
    to_us = {"msecond": 1e3, "ms": 1e3, "usecond": 1.0, "us": 1.0, "nsecond": 1e-3, "ns": 1e-3, "second": 1e6,
             "s": 1e6}.get(units[dur] if dur is not None else "", 1.0)

    def pick(r, *names):
        for n in names:
            if n in col:
                return _num(r[col[n]])
        return float("nan")

    out = [f"{'kernel':58s} {'us':>9s} {'dram%':>6s} {'sm%':>6s} {'tensor%':>7s}  top stalls (warps per issue)"]
    for r in rows:
        name = r[col["Kernel Name"]][:58] if "Kernel Name" in col else "?"
        us = _num(r[dur]) * to_us if dur is not None else float("nan")
        dram = pick(r, "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")
        sm = pick(r, "sm__throughput.avg.pct_of_peak_sustained_elapsed")
        tp = max((_num(r[i]) for i in tensor), default=float("nan"))
        top = sorted(((_num(r[i]), n) for i, n in stalls if n not in ("selected", "not_selected")), reverse=True)[:3]
        out.append(f"{name:58s} {us:9.1f} {dram:6.1f} {sm:6.1f} {tp:7.1f}  " + ", ".join(f"{n} {v:.2f}" for v, n in top))
    return "\n".join(out)


def source_summary(path: str, top: int = 40) -> str:
    """The instructions of an ncu ``--page source --print-source sass --csv`` file (one kernel, ``SourceCounters``)
    with the most warp stall samples: address, share of all samples, the two largest stall reasons among the
    per-reason sample columns, and the SASS; then the samples summed per opcode."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    table = list(csv.reader(lines))
    start = next((i for i, r in enumerate(table) if "Address" in r and "Source" in r), None)  # after the kernel line
    if start is None or len(table) < start + 2:
        return "no source rows in " + path
    head = table[start]
    col = {name: i for i, name in enumerate(head)}
    total_col = next((i for i, n in enumerate(head) if n.startswith("Warp Stall Sampling (All")), None)
    src_col, addr_col = col["Source"], col["Address"]  # both in the header row found above
    if total_col is None:
        return "no 'Warp Stall Sampling (All Samples)' column in " + path + ": " + ", ".join(head[:30])
    rows = [r for r in table[start + 1:] if len(r) > total_col]  # the instruction rows (complete ones)
    reasons = [(i, n) for i, n in enumerate(head)
               if n.startswith("stall_") or n.startswith("smsp__pcsamp_warps_issue_stalled_")]
    total = sum(_num(r[total_col]) for r in rows) or 1.0
    ranked = sorted(rows, key=lambda r: -_num(r[total_col]))[:top]
    out = [f"{'address':>8s} {'share':>6s}  {'reasons':34s} sass"]
    for r in ranked:
        why = sorted(((_num(r[i]), n.replace("smsp__pcsamp_warps_issue_stalled_", "")) for i, n in reasons),
                     reverse=True)[:2]
        out.append(f"{r[addr_col]:>8s} {100 * _num(r[total_col]) / total:5.1f}%  "
                   f"{', '.join(f'{n} {v:.0f}' for v, n in why if v > 0):34s} {r[src_col].strip()[:90]}")
    per_op: dict[str, float] = {}
    for r in rows:
        words = r[src_col].split()
        if words:
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # past a predicate
            per_op[op] = per_op.get(op, 0.0) + _num(r[total_col])
    out.append("samples per opcode: " + ", ".join(f"{op} {100 * v / total:.1f}%" for op, v in
                                                  sorted(per_op.items(), key=lambda kv: -kv[1])[:12]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """The command line (the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="decode16,decode128,fp8,sparse,prefill,b1,fp4moe,moe256")
    ap.add_argument("--summarize", metavar="CSV", help="print the short table of an ncu CSV (no GPU)")
    ap.add_argument("--print-regex", action="store_true", help="print the kernel-name regex for ncu's -k")
    ap.add_argument("--source", metavar="CSV", help="print the stall samples per instruction of an ncu source-page CSV")
    args = ap.parse_args(argv)
    if args.print_regex:
        print(KERNELS)
    elif args.summarize:
        print(summarize(args.summarize))
    elif args.source:
        print(source_summary(args.source))
    else:
        run(args.cases.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
