"""Cold compile time against depth, with and without ``patch(..., regional_compile=True)``.

    python benchmarks/bench_regional_compile.py [--layers 6 24] [--kind v2-lite|v3|v4] [--device cpu] [--backend eager]
        [--warm [--dynamo-cache auto|0|1]] [--regional 0|1]

Each configuration runs in a fresh process with an empty Inductor / Triton cache: build a toy of ``kind`` with N
layers (v4: DeepSeek-V4's three attention kinds in turn), compile it (``fullgraph=True``, ``--backend``: inductor by default; ``eager`` times Dynamo's tracing alone)
and run a 3-prompt prefill and 3 decode steps; prints the wall and process CPU time of that (mostly compile) and
whether the tokens equal the eager model's, then where the compile time went
(:func:`mla_compile.graphs.warm_start.compile_breakdown`: Dynamo tracing, guards, AOTAutograd + Inductor or their
cache loads, loading compiled graphs; ``run``: the rest) and the FX-graph cache hits / misses.

``--warm`` adds a warm start: a second process over the first one's caches. Both call
:func:`~mla_compile.graphs.warm_start.enable_warm_start` before compiling (``--dynamo-cache``: auto, its
default, or 0 / 1 to force torch's Dynamo cache off / on) and the first calls
:func:`~mla_compile.graphs.warm_start.save_warm_start` after its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _one(kind: str, layers: int, regional: bool, device: str, backend: str, warm: str = "") -> dict:
    """One configuration in this process; ``warm``: "" (no warm-start helpers), or "cold"/"warm" then ":" and the
    ``--dynamo-cache`` choice (the cold process saves the caches after its steps)."""
    import torch

    from mla_compile.app import toy
    from mla_compile.graphs.warm_start import compile_breakdown, enable_warm_start, save_warm_start
    from mla_compile.serving.generate import greedy_generate
    from mla_compile.models.model import patch

    prompts = toy.random_prompts(2, [9, 13, 5])
    if kind == "v4":
        from mla_compile.app.v4_toy import depth_overrides, toy_v4_model

        hf = toy_v4_model(1, **depth_overrides(layers)).to(device)
        prompts = toy.random_prompts(2, [9, 13, 5], vocab_size=hf.config.vocab_size)
        eager = patch(hf, regional_compile=regional)
        generate = lambda step_fn: _v4_greedy(eager, step_fn, prompts)  # noqa: E731
    else:
        hf = toy.toy_hf_model(kind, seed=1, num_hidden_layers=layers, first_k_dense_replace=1, device=device)
        eager = patch(hf, regional_compile=regional)

        def generate(step_fn):
            eager.allocate_cache(64, 16)
            return greedy_generate(step_fn, prompts, 4, block_size=16, num_blocks=64, device=device).tokens
    want = generate(eager)
    start, _, choice = warm.partition(":")
    t0, c0 = time.perf_counter(), time.process_time()
    dynamo_cache = enable_warm_start({"auto": None, "0": False, "1": True}[choice]) if start else False
    compiled = torch.compile(eager, fullgraph=True, backend=backend)
    got = generate(compiled)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    if start == "cold":
        save_warm_start()
    return dict(kind=kind, layers=layers, regional=regional, seconds=round(seconds, 1),
                cpu_seconds=round(cpu_seconds, 1), tokens_equal=got == want, dynamo_cache=dynamo_cache,
                torch=torch.__version__, breakdown=compile_breakdown())


def _v4_greedy(model, step_fn, prompts: list[list[int]], steps: int = 4) -> list[list[int]]:
    """Greedy tokens of a V4 model through ``step_fn``: a batched prefill of ``prompts``, then ``steps`` - 1 decode
    steps, over fresh caches (:class:`~mla_compile.models.v4_model.V4Sequences`)."""
    import torch

    from mla_compile.models.v4_model import V4Sequences

    seqs = V4Sequences(model, len(prompts), 64, 16)
    batch = list(range(len(prompts)))
    tokens = [[] for _ in prompts]
    with torch.no_grad():
        chunks = prompts
        for _ in range(steps):
            nxt = seqs.step(step_fn, batch, chunks).argmax(-1).tolist()
            for toks, t in zip(tokens, nxt):
                toks.append(t)
            chunks = [[t] for t in nxt]
    return tokens


def _breakdown_line(r: dict) -> str:
    """The compile breakdown of one result, in seconds and cache counts."""
    b = r["breakdown"]
    return (f"    compile {b['compile']:.1f} s: dynamo {b['dynamo']:.1f}, guards {b['guards']:.1f}, aot+inductor "
            f"{b['aot_inductor']:.1f}, load {b['load']:.1f}; run {r['seconds'] - b['compile']:.1f} s | fx cache "
            f"{b['fx_cache_hit']} hit / {b['fx_cache_miss']} miss, aot cache {b['aot_cache_hit']} / "
            f"{b['aot_cache_miss']}, dynamo cache {'on' if r['dynamo_cache'] else 'off'} "
            f"({b['dynamo_cache_hit']} hit / {b['dynamo_cache_miss']} miss), graphs traced {b['graphs_traced']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[6, 24])
    ap.add_argument("--kind", default="v2-lite")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: Dynamo's tracing alone)")
    ap.add_argument("--warm", action="store_true", help="also a warm start: a second process over the same caches")
    ap.add_argument("--dynamo-cache", choices=("auto", "0", "1"), default="auto",
                    help="with --warm: torch's Dynamo cache (enable_warm_start's dynamo=None / False / True)")
    ap.add_argument("--regional", choices=("0", "1"), help="only without (0) or with (1) regional compilation")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--start", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        kind, layers, regional = args.one.split(",")
        print(json.dumps(_one(kind, int(layers), regional == "1", args.device, args.backend, args.start)))
        return 0
    for layers in args.layers:
        for regional in (False, True) if args.regional is None else (args.regional == "1",):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
                for start in ("cold", "warm")[:1 + args.warm]:  # warm: a new process over the cold one's caches
                    warm = f"{start}:{args.dynamo_cache}" if args.warm else ""
                    proc = subprocess.run([sys.executable, __file__, "--device", args.device, "--backend", args.backend,
                                           "--one", f"{args.kind},{layers},{int(regional)}", "--start", warm],
                                          env=env, capture_output=True, text=True)
                    if proc.returncode != 0:  # the child's own error, not only its exit status
                        raise SystemExit(f"{args.kind} layers {layers} regional {regional} {start} failed:\n"
                                         f"{proc.stderr[-6000:]}")
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                    print(f"{r['kind']:8s} layers {r['layers']:3d} regional {str(r['regional']):5s} {start} "
                          f"{r['seconds']:6.1f} s (CPU {r['cpu_seconds']:6.1f} s)  tokens equal to eager: "
                          f"{r['tokens_equal']}  torch {r['torch']}", flush=True)
                    print(_breakdown_line(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
