"""Time one MoE layer's experts and routing on a GPU: ``mla::moe_experts`` fused (Triton) vs grouped vs dense.

    python benchmarks/bench_moe.py --out OUT_DIR [--dims v2-lite,v3] [--tokens 1,8,64,256] [--sweep [dot|pipe]] [--fp8]
        [--pad]

DeepSeek-V2-Lite dims (hidden 2048, moe_intermediate 1408, 64 experts top-6, 2 shared experts) and V3 dims
(hidden 7168, moe_intermediate 2048, 256 experts top-8, 1 shared), random bf16 weights, tokens T = 1, 8, 64,
256. Every row runs the routed *and* shared experts of the layer, output in bf16:
- "fused triton": ``moe_experts(backend="triton")``, reads only the routed experts' rows (the shared ones
  folded in as weight-1 slots), two kernels;
- "grouped": ``moe_experts(backend="grouped")``, tokens sorted by expert through ``torch._grouped_mm`` (what
  ``MLAMoE`` ran before), plus the shared MLP as three linears;
- "triton grouped": ``moe_experts(backend="triton-grouped")``, the (token, pick) pairs sorted by expert in blocks
  of one expert, Triton grouped GEMMs (shared experts as always-routed blocks), a deterministic combine; its
  note gives the norm-relative error against the reference backend (first input set);
- "dense": every expert on every token (``models.moe.experts_dense``) plus the shared MLP;
- "auto": what ``moe_experts``'s "auto" runs here (its choice in the note);
and the routing alone: ``moe_route(backend="triton")`` (one kernel) vs the same math in eager torch.
``--fp8`` adds the same layer with fp8 block-quantized weights (e4m3 codes, one float32 scale per 128 x 128
block, as DeepSeek's checkpoints; routed and shared), through ``mla::moe_experts_fp8``: "fp8 fused triton"
(reads only the routed experts' codes and scales) and "fp8 grouped" (tokens sorted by expert through
``mla::fp8_block_linear``'s sorted groups plus three fp8 linears for the shared MLP: what ``MLAMoE`` runs for
fp8 experts without the fused kernel); their note gives the norm-relative error against the reference backend
(first input set). GB/s counts fp8 bytes (codes + scales).
Times are per call from a replayed CUDA graph (``bench_kernels.graph_ms``) over 4 input sets whose routed
experts are disjoint where the experts allow and whose shared weights are separate copies, so the weights
come from memory as in a full-depth step (not from L2). GB/s counts the distinct expert weights each call
must read. ``--sweep`` also times the fused kernels' launch configs (``ops/triton/moe_experts.CONFIG``: the GEMV
kernels' tiles, ``SWEEP_CONFIGS``, and their tensor-core forms, ``DOT_SWEEP``; ``--sweep dot`` the latter only,
``--sweep pipe`` only the pipelined form's rows, ``PIPE_SWEEP``; with ``--fp8`` also
``ops/triton/moe_experts_fp8.CONFIG``) for up to 8 tokens, each checked against the default
config's output, and the grouped Triton kernels' (``ops/triton/moe_grouped.CONFIG``, ``GROUPED_SWEEP``) for 64
tokens and more. ``--pad`` adds one padding token to every input set (``token_mask`` False), as the decode
graphs run one sequence (their smallest capture size is 2); such a group is named ``T=1+1pad``. Each group also
times a "read floor": ``bench_kernels.read_floor``, the fastest plain Triton streaming read of one contiguous buffer
of the bytes the call must read, what one kernel reading that many bytes takes here. Writes ``bench_moe.json`` and
``bench_moe.txt`` under ``--out``; a short table is printed last.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  (graph_ms, attempt, ceilings, run_sections)

import mla_compile  # noqa: E402,F401
from mla_compile.models.moe import experts_dense  # noqa: E402
from mla_compile.ops import moe_experts, moe_route  # noqa: E402
from mla_compile.ops.moe_experts import auto_backend  # noqa: E402
from mla_compile.ops.moe_experts_fp8 import moe_experts_fp8  # noqa: E402
from mla_compile.ops.moe_route import route_math  # noqa: E402
from mla_compile.ops.triton import moe_experts as tmoe  # noqa: E402
from mla_compile.ops.triton import moe_grouped as tgrouped  # noqa: E402

SWEEP = False
FP8 = False
PAD = False
# the fused kernels' configs timed by --sweep at T <= 8: (gate_up_tile, down_tile, waves, num_warps), each tile at
# every width (no narrow_tile)
SWEEP_CONFIGS = tuple(dict(gate_up_tile=g, down_tile=d, waves=v, num_warps=w) for g, d, v, w in (
    (2048, 1024, 2, 4), (8192, 2048, 2, 4), (4096, 4096, 2, 4), (4096, 2048, 4, 4), (8192, 4096, 2, 8),
    (4096, 2048, 1, 4), (8192, 8192, 8, 8), (8192, 8192, 8, 4), (16384, 8192, 4, 8), (4096, 4096, 8, 4),
    (8192, 4096, 8, 8), (16384, 16384, 8, 8)))
# the fused kernels' tensor-core forms (ops/triton/moe_experts.CONFIG's dot keys), timed by --sweep at T <= 8 (with
# kernel 1's pipelined GEMV form, the default, turned off): the gate-up form's tiles, depth and warps with the down
# kernel's GEMV, then a few of the down kernel's tensor-core form (it has too few programs at few tokens); then the
# pipelined form's tiles
DOT = dict(gate_up_dot=True, down_dot=True)
_DOT_FORMS = (dict(dot_n=16), dict(dot_n=16, dot_stages=6), dict(dot_n=16, dot_k=256, dot_stages=3),
             dict(dot_n=16, dot_k=256), dict(dot_n=16, dot_warps=2), dict(dot_n=16, dot_warps=8, dot_k=256),
             dict(dot_stages=3), dict(dot_stages=5), dict(dot_stages=6), dict(dot_k=256, dot_stages=3),
             dict(dot_k=64, dot_stages=8), dict(dot_warps=8), dict(dot_warps=2), dict(dot_n=64, dot_stages=3),
             dict(dot_n=64, dot_k=64, dot_stages=6), dict(dot_n=64, dot_warps=8, dot_stages=3),
             DOT, dict(DOT, down_h=32, down_k=128, down_stages=6), dict(DOT, dot_n=16, down_k=128, down_stages=8),
             # 32-wide tiles with shallower rings: three to five programs an SM, so one token's 8 slots x 44 tiles
             # are resident at once (64-wide tiles: 176 programs, two an SM, on 132 SMs)
             dict(dot_n=32), dict(dot_n=32, dot_stages=4), dict(dot_n=32, dot_warps=2),
             dict(dot_n=32, dot_k=128, dot_stages=3),
             # deeper rings a program (more bytes in flight; run 184: dot_k=64 with 8 stages 41.7 us against 43.9)
             dict(dot_stages=10), dict(dot_k=128, dot_stages=5), dict(dot_k=128, dot_stages=6),
             dict(dot_k=64, dot_stages=8, dot_warps=8), dict())
# kernel 1's pipelined GEMV form (many 16- or 32-wide programs, several an SM): timed by --sweep and --sweep dot
# after DOT_SWEEP, alone by --sweep pipe (both kernels as one launch, 2327a90, lost by 19-41 us: BENCHMARKS.md run 195)
PIPE_SWEEP = (dict(pipe_k=128), dict(pipe_k=128, pipe_stages=2), dict(pipe_stages=4),
              dict(pipe_n=32, pipe_k=128, pipe_warps=8))
DOT_SWEEP = (*(dict(change, gate_up_pipe=False) for change in _DOT_FORMS), *PIPE_SWEEP)
# changes to ops/triton/moe_grouped.CONFIG, each timed by --sweep at T >= 64 (5 stages at BLOCK_M 64 may not fit
# in shared memory: such a row records the failure)
GROUPED_SWEEP = (dict(block_m=16), dict(block_m=32), dict(block_m=64), dict(gate_up_n=32),
                 dict(gate_up_n=128, gate_up_k=64), dict(gate_up_k=64), dict(down_n=64, down_k=128), dict(down_n=64),
                 dict(down_k=128), dict(num_stages=2), dict(num_stages=4), dict(num_stages=5), dict(num_warps=8),
                 dict(gate_up_k=256, down_k=128, num_stages=2), dict(block_m=64, num_warps=8, num_stages=4),
                 # the down kernel alone (its weight rows read in longer runs, deeper, more warps) and the gate-up
                 # kernel's longer K step
                 dict(down_k=128, down_stages=4), dict(down_k=256, down_stages=2), dict(down_k=128, down_stages=3),
                 dict(down_k=128, down_stages=5), dict(down_stages=5), dict(down_stages=6), dict(down_warps=8),
                 dict(down_k=128, down_warps=8, down_stages=4), dict(down_n=64, down_k=256, down_stages=3),
                 dict(down_n=256, down_stages=3), dict(down_n=256, down_k=32, down_stages=6),
                 dict(gate_up_k=256), dict(gate_up_k=256, num_stages=2, down_stages=3))

DEV, SETS = "cuda", 4
# name: (hidden, moe_intermediate, experts, top_k, shared experts, routing: num_group, topk_group, scoring)
DIMS = {"v2-lite": (2048, 1408, 64, 6, 2, (1, 1, "softmax")), "v3": (7168, 2048, 256, 8, 1, (8, 4, "sigmoid"))}


_WEIGHTS: dict = {}


def _weights(H, I, E, S):
    """Random bf16 ``(gate_up, down, [SETS copies of the shared weights])``, kept for the next T of these dims."""
    key = (H, I, E, S)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        torch.cuda.empty_cache()
        _WEIGHTS[key] = _new_weights(H, I, E, S)
    return _WEIGHTS[key]


def _new_weights(H, I, E, S):
    gate_up = torch.empty(E, 2 * I, H, device=DEV, dtype=torch.bfloat16)
    down = torch.empty(E, H, I, device=DEV, dtype=torch.bfloat16)
    for e in range(0, E, 16):  # chunks bound the float32 temporaries
        gate_up[e:e + 16] = torch.randn(gate_up[e:e + 16].shape, device=DEV) * H ** -0.5
        down[e:e + 16] = torch.randn(down[e:e + 16].shape, device=DEV) * I ** -0.5
    shared = [tuple((torch.randn(*shape, device=DEV) * 0.02).bfloat16()
                    for shape in ((S * I, H), (S * I, H), (H, S * I))) for _ in range(SETS)]
    return gate_up, down, shared


_FP8_WEIGHTS: dict = {}


def _fp8(shape, fan_in):
    """Random e4m3 codes ``shape`` and float32 block scales (values ~ fan_in**-0.5), made in chunks of 16 rows
    of the leading dim (bounds the float32 temporaries)."""
    codes = torch.empty(shape, device=DEV, dtype=torch.float8_e4m3fn)
    lead = shape[0] if len(shape) == 3 else 1
    view = codes if len(shape) == 3 else codes[None]
    for e in range(0, lead, 16):
        view[e:e + 16] = (torch.randn(view[e:e + 16].shape, device=DEV) * 64).clamp(-448, 448)
    blocks = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    return codes, (torch.rand(blocks, device=DEV) + 0.5) * fan_in ** -0.5 / 64


def _fp8_weights(H, I, E, S):
    """fp8 ``(routed [gate, gate_scale, up, up_scale, down, down_scale], [SETS dicts of shared kwargs])``."""
    key = (H, I, E, S)
    if key not in _FP8_WEIGHTS:
        _FP8_WEIGHTS.clear()
        torch.cuda.empty_cache()
        routed = (*_fp8((E, I, H), H), *_fp8((E, I, H), H), *_fp8((E, H, I), I))
        shared = []
        for _ in range(SETS):
            (g, gs), (u, us), (d, ds) = _fp8((S * I, H), H), _fp8((S * I, H), H), _fp8((H, S * I), I)
            shared.append(dict(shared_gate=g, shared_gate_scale=gs, shared_up=u, shared_up_scale=us,
                               shared_down=d, shared_down_scale=ds))
        _FP8_WEIGHTS[key] = routed, shared
    return _FP8_WEIGHTS[key]


def fp8_case(group, T, H, I, E, S, sets, hit, flops, note, mask):
    """The fp8 rows of one (dims, T): fused Triton vs grouped, each checked against the reference backend
    (``mask``: the sets' token mask or None)."""
    routed, shared = _fp8_weights(H, I, E, S)
    scale_bytes = 4 * 3 * (-(-H // 128)) * (-(-I // 128))
    nbytes = (hit + S) * (3 * H * I + scale_bytes)
    x, w, ids = sets[0]
    want = moe_experts_fp8(x, w, ids, *routed, **shared[0], out_float32=True, backend="reference",
                           token_mask=mask)[:T].double()

    def run(backend):
        def fn():
            for (xs, ws, ids_s), sh in zip(sets, shared):
                moe_experts_fp8(xs, ws, ids_s, *routed, **sh, backend=backend, token_mask=mask)
        return fn

    for impl, backend in (("fp8 fused triton", "triton"), ("fp8 grouped", "grouped")):
        try:
            got = moe_experts_fp8(x, w, ids, *routed, **shared[0], out_float32=True, backend=backend,
                                  token_mask=mask)[:T].double()
            check = f"rel err {float((got - want).norm() / want.norm()):.1e}"
        except Exception as exc:  # the timing attempt records the failure as its row
            check = f"check failed: {type(exc).__name__}"
        bk.attempt(group, impl, run(backend), flops, nbytes, f"{note}; {check}", rep_ms=100, sets=SETS)
    if SWEEP and T <= 8:
        from mla_compile.ops.triton import moe_experts_fp8 as tfp8

        sweep_configs(group, tfp8.CONFIG, "fp8 fused", SWEEP_CONFIGS,
                      lambda: moe_experts_fp8(x, w, ids, *routed, **shared[0], out_float32=True, backend="triton",
                                              token_mask=mask),
                      run("triton"), flops, nbytes)


def _sets(T, H, E, k, seed):
    """``SETS`` inputs ``(x, weights, ids)``; with one token the sets pick disjoint experts when E allows."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    perm = torch.randperm(E, device=DEV, generator=gen)
    out = []
    for s in range(SETS):
        if T == 1 and SETS * k <= E:
            ids = perm[s * k:(s + 1) * k][None]
        else:
            ids = torch.stack([torch.randperm(E, device=DEV, generator=gen)[:k] for _ in range(T)])
        out.append((torch.randn(T, H, device=DEV).bfloat16(), torch.rand(T, k, device=DEV) + 0.1, ids.int()))
    if PAD:  # one padding token a set: NaN activations and expert 0 (never read: its mask is False)
        out = [(torch.cat([x, torch.full_like(x[:1], float("nan"))]), torch.cat([w, w[:1]]),
                torch.cat([ids, torch.zeros_like(ids[:1])])) for x, w, ids in out]
    return out


def _mask(T):
    """The token mask of an input set (None without ``--pad``)."""
    if not PAD:
        return None
    return torch.arange(T + 1, device=DEV) < T


def case(name, T):
    H, I, E, k, S, (G, TG, scoring) = DIMS[name]
    group = f"{name} T={T}" + ("+1pad" if PAD else "")
    print(group, flush=True)
    gate_up, down, shared = _weights(H, I, E, S)
    sets = _sets(T, H, E, k, seed=T)
    mask = _mask(T)
    hit = sum(int(torch.unique(ids[:T]).numel()) for _, _, ids in sets) / SETS
    nbytes = (hit + S) * 3 * H * I * 2
    flops = 2 * T * (k + S) * 3 * H * I
    note = f"{hit:.0f} experts hit"

    def run(backend):
        def fn():
            for (x, w, ids), (sg, su, sd) in zip(sets, shared):
                moe_experts(x, w, ids, gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd, backend=backend,
                            token_mask=mask)
        return fn

    def dense():
        for (x, w, ids), (sg, su, sd) in zip(sets, shared):
            experts_dense(x, w, ids.long(), gate_up, down, F.silu).to(x.dtype) + F.linear(
                F.silu(F.linear(x, sg)) * F.linear(x, su), sd)

    floor = torch.empty(int(nbytes) // 2, device=DEV, dtype=torch.bfloat16).normal_()
    bk.read_floor(group, floor, nbytes)  # one kernel streaming the bytes the call reads (bench_kernels' floor)
    del floor
    bk.attempt(group, "fused triton", run("triton"), flops, nbytes, note, rep_ms=100, sets=SETS)
    if SWEEP and T <= 8:
        sweep(group, sets, shared, gate_up, down, flops, nbytes, mask)
    bk.attempt(group, "grouped", run("grouped"), flops, nbytes, note, rep_ms=100, sets=SETS)
    x, w, ids = sets[0]
    sg, su, sd = shared[0]

    def first_set(backend):
        return moe_experts(x, w, ids, gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd, out_float32=True,
                           backend=backend, token_mask=mask)[:T].double()

    try:
        want = first_set("reference")
        check = f"rel err {float((first_set('triton-grouped') - want).norm() / want.norm()):.1e}"
    except Exception as exc:  # the timing attempt records the failure as its row
        check = f"check failed: {type(exc).__name__}"
    bk.attempt(group, "triton grouped", run("triton-grouped"), flops, nbytes, f"{note}; {check}", rep_ms=100,
               sets=SETS)
    if SWEEP and T >= 64:
        sweep_configs(group, tgrouped.CONFIG, "triton grouped", GROUPED_SWEEP, lambda: first_set("triton-grouped"),
                      run("triton-grouped"), flops, nbytes)
    bk.attempt(group, "dense", dense, flops, nbytes, note, rep_ms=100, sets=SETS)
    bk.attempt(group, "auto", run(None), flops, nbytes, f"{note}; auto = {auto_backend(DEV, 'bfloat16', H)}",
               rep_ms=100, sets=SETS)
    if FP8:
        fp8_case(group, T, H, I, E, S, sets, hit, flops, note, mask)

    logits = [torch.randn(T, E, device=DEV) for _ in range(SETS)]
    bias = torch.randn(E, device=DEV) * 0.1 if scoring == "sigmoid" else None
    args = (bias, k, G, TG, scoring, scoring == "sigmoid", 2.5)

    def route_triton():
        for z in logits:
            moe_route(z, k, bias=bias, num_group=G, topk_group=TG, scoring=scoring, renormalize=args[5],
                      scaling=2.5, backend="triton")

    def route_torch():
        for z in logits:
            route_math(z, *args)

    bk.attempt(group, "route triton", route_triton, 0, T * E * 4, rep_ms=100, sets=SETS)
    bk.attempt(group, "route torch (eager)", route_torch, 0, T * E * 4, rep_ms=100, sets=SETS)


def sweep(group, sets, shared, gate_up, down, flops, nbytes, mask):
    """Time the fused kernels under each of ``SWEEP_CONFIGS`` (not with ``--sweep dot``) and ``DOT_SWEEP``, each
    checked against the default config."""
    (x, w, ids), (sg, su, sd) = sets[0], shared[0]

    def call():
        return moe_experts(x, w, ids, gate_up, down, shared_gate=sg, shared_up=su, shared_down=sd,
                           out_float32=True, backend="triton", token_mask=mask)

    def all_sets():
        for (xs, ws, ids_s), (g, u, d) in zip(sets, shared):
            moe_experts(xs, ws, ids_s, gate_up, down, shared_gate=g, shared_up=u, shared_down=d, backend="triton",
                        token_mask=mask)

    if SWEEP == "all":
        sweep_configs(group, tmoe.CONFIG, "fused", SWEEP_CONFIGS, call, all_sets, flops, nbytes, drop=("narrow_tile",))
    sweep_configs(group, tmoe.CONFIG, "fused", PIPE_SWEEP if SWEEP == "pipe" else DOT_SWEEP, call, all_sets, flops,
                  nbytes)


def sweep_configs(group, config, label, changes, call, all_sets, flops, nbytes, drop=()):
    """Time ``all_sets`` under the kernels' default ``config`` dict and under each of ``changes`` written into it
    (the ``drop`` keys left out), each checked (``call``: one output of the kernels) against the default config's
    output; the default is restored after."""
    default = dict(config)
    want = call().double()
    bk.attempt(group, f"{label} default {config}", all_sets, flops, nbytes, rep_ms=100, sets=SETS)
    try:
        for change in changes:
            config.clear()
            config.update({k: v for k, v in default.items() if k not in drop}, **change)
            name = label + " " + " ".join(f"{k}={v}" for k, v in change.items())
            try:
                err = f"rel diff to default {float((call().double() - want).norm() / want.norm()):.1e}"
            except Exception as exc:  # the timing attempt records the failure as its row
                err = f"check failed: {type(exc).__name__}"
            bk.attempt(group, name, all_sets, flops, nbytes, err, rep_ms=100, sets=SETS)
    finally:
        config.clear()
        config.update(default)


def table() -> str:
    """Microseconds per call: one line per (dims, T), one column per implementation."""
    impls = ["read floor", "fused triton", "grouped", "triton grouped", "dense", "auto", "route triton", "route torch (eager)"]
    impls += ["fp8 fused triton", "fp8 grouped"] if FP8 else []
    by = {}
    for r in bk.ROWS:
        by.setdefault(r["group"], {})[r["impl"]] = "FAILED" if "error" in r else f"{r['us']:.1f}"
    lines = [f"{'':14s}" + "".join(f"{i:>22s}" for i in impls)]
    lines += [f"{g:14s}" + "".join(f"{row.get(i, '-'):>22s}" for i in impls) for g, row in by.items()]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dims", default="v2-lite,v3", help=f"comma-separated, of {list(DIMS)}")
    ap.add_argument("--tokens", default="1,8,64,256", help="comma-separated token counts")
    ap.add_argument("--sweep", nargs="?", const="all", default="", choices=("all", "dot", "pipe"),
                    help="also time the fused kernels' launch configs (T <= 8), the grouped Triton ones (T >= 64); "
                         "'dot': the fused kernels' tensor-core forms (DOT_SWEEP); 'pipe': kernel 1's pipelined "
                         "form only (PIPE_SWEEP)")
    ap.add_argument("--fp8", action="store_true", help="also time the layer with fp8 block-quantized experts")
    ap.add_argument("--pad", action="store_true", help="one padding token (masked) added to every input set")
    args = ap.parse_args()
    global SWEEP, FP8, PAD
    SWEEP, FP8, PAD = args.sweep, args.fp8, args.pad
    os.makedirs(args.out, exist_ok=True)
    bk.ceilings()
    sections = [lambda n=n, t=t: case(n, t) for n in args.dims.split(",") for t in map(int, args.tokens.split(","))]
    bk.run_sections(sections, os.path.join(args.out, "bench_moe.json"))
    rows = "\n".join(f"{r.get('group', '')}: {bk._fmt(r)}" for r in bk.ROWS)
    text = table()
    with open(os.path.join(args.out, "bench_moe.txt"), "w") as f:
        f.write(rows + "\n\n" + text + "\n")
    print("\nus per call (CUDA-graph replay, weights from memory)\n" + text)


if __name__ == "__main__":
    main()
