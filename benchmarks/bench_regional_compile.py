"""Cold compile time against depth, with and without ``patch(..., regional_compile=True)``.

    python benchmarks/bench_regional_compile.py [--layers 6 24] [--kind v2-lite] [--device cpu] [--backend eager]
        [--warm] [--regional 0|1]

Each configuration runs in a fresh process with an empty Inductor / Triton cache: build a toy of ``kind`` with N
layers, compile it (``fullgraph=True``, ``--backend``: inductor by default; ``eager`` times Dynamo's tracing alone)
and run a 3-prompt prefill and 3 decode steps; prints the wall and process CPU time of that (mostly compile) and
whether the tokens equal the eager model's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _one(kind: str, layers: int, regional: bool, device: str, backend: str) -> dict:
    import torch

    from mla_compile.app import toy
    from mla_compile.serving.generate import greedy_generate
    from mla_compile.models.model import patch

    hf = toy.toy_hf_model(kind, seed=1, num_hidden_layers=layers, first_k_dense_replace=1, device=device)
    prompts = toy.random_prompts(2, [9, 13, 5])
    eager = patch(hf, regional_compile=regional)
    eager.allocate_cache(64, 16)
    want = greedy_generate(eager, prompts, 4, block_size=16, num_blocks=64, device=device).tokens
    t0, c0 = time.perf_counter(), time.process_time()
    compiled = torch.compile(eager, fullgraph=True, backend=backend)
    eager.allocate_cache(64, 16)
    got = greedy_generate(compiled, prompts, 4, block_size=16, num_blocks=64, device=device).tokens
    return dict(kind=kind, layers=layers, regional=regional, seconds=round(time.perf_counter() - t0, 1),
                cpu_seconds=round(time.process_time() - c0, 1), tokens_equal=got == want)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[6, 24])
    ap.add_argument("--kind", default="v2-lite")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: Dynamo's tracing alone)")
    ap.add_argument("--warm", action="store_true", help="also a warm start: a second process over the same caches")
    ap.add_argument("--regional", choices=("0", "1"), help="only without (0) or with (1) regional compilation")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        kind, layers, regional = args.one.split(",")
        print(json.dumps(_one(kind, int(layers), regional == "1", args.device, args.backend)))
        return 0
    for layers in args.layers:
        for regional in (False, True) if args.regional is None else (args.regional == "1",):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
                for start in ("cold", "warm")[:1 + args.warm]:  # warm: a new process over the cold one's caches
                    out = subprocess.run([sys.executable, __file__, "--device", args.device, "--backend", args.backend,
                                          "--one", f"{args.kind},{layers},{int(regional)}"], env=env, check=True,
                                         capture_output=True, text=True).stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    print(f"{r['kind']:8s} layers {r['layers']:3d} regional {str(r['regional']):5s} {start} "
                          f"{r['seconds']:6.1f} s (CPU {r['cpu_seconds']:6.1f} s)  tokens equal to eager: "
                          f"{r['tokens_equal']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
