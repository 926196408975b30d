"""A child process for tests/graphs/test_warm_start.py: compile a small function under
:func:`mla_compile.graphs.warm_start.enable_warm_start`, run it on seeded inputs and print one JSON line
(the output, the compile breakdown). ``--save PATH`` saves the artifacts after the run, ``--load PATH`` loads
them before compiling."""

from __future__ import annotations

import argparse
import json

import torch

from mla_compile.graphs.warm_start import compile_breakdown, enable_warm_start, load_warm_start, save_warm_start


def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A small graph with a matmul and pointwise work (what Inductor compiles and caches)."""
    return torch.tanh(x @ w) * 2.0 + x.sin()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dynamo_cache = enable_warm_start()
    loaded = load_warm_start(args.load) if args.load else None
    gen = torch.Generator().manual_seed(args.seed)
    x, w = torch.randn(8, 16, generator=gen), torch.randn(16, 16, generator=gen)
    out = torch.compile(f, fullgraph=True)(x, w)
    if args.save:
        save_warm_start(args.save)
    print(json.dumps(dict(out=out.tolist(), x=x.tolist(), w=w.tolist(), loaded=loaded, dynamo_cache=dynamo_cache,
                          breakdown=compile_breakdown())))


if __name__ == "__main__":
    main()
