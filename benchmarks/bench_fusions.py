"""The decode step's opt-in fusions against the launches they replace, at one sequence (two query rows: a real one
and the CUDA graph's padding row), on the GPU.

    python benchmarks/bench_fusions.py --out OUT_DIR [--dims v2-lite,v3] [--quick]

For each DeepSeek dims set, times (median per call of a replayed CUDA graph over enough input sets that the weights
and caches come from memory, as ``bench_kernels.py``):
- ``mla::decode_absorb_out`` ("gluon", "triton"; without ``--quick`` also ``decode_absorb.ABSORB``'s settings: column
  slices and warps, the split count)
  against ``mla::decode`` ("gluon") + ``mla::skinny_absorb_out``: context 4096 and a padding sequence of length 0,
  and 8 sequences of 4096 (the fused launch serves up to 8 query rows);
- ``mla::moe_norm_gate_route`` ("triton") against the add + norm launch (``skinny_norm_linear.add_norm``) +
  ``mla::moe_gate_route`` ("triton");
- ``mla::skinny_norm_linear`` ("triton") over the first projections against the add + norm launch +
  ``mla::skinny_linear`` ("triton");
- ``mla::write_latent_cache_absorb_q`` ("triton") against ``mla::write_latent_cache_fused`` + ``mla::skinny_absorb_q``
  (q_pe's RoPE, which the fused op also does, not counted on the unfused side).
The decode, norm + route and norm + linear rows compare the fused output with the unfused pair's on the first set
(relative error in the note; the routings' ids, sorted); the cache write + absorb_q row compares the written cache
rows and q_abs's latent columns (its unfused side leaves q_pe unrotated). Writes ``bench_fusions.json`` /
``.txt`` and prints the table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

import mla_compile  # noqa: F401  (registers every op and backend)
from mla_compile import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402  (CUDA-graph replay timing, the table)

DEV = "cuda"
PAGE, DC, DR = 64, 512, 64
# heads, v_head_dim, hidden, experts, top-k, groups, top groups, scoring, bias, renormalize, scaling, q width, kv width
DIMS = {
    "v2-lite": dict(H=16, V=128, hidden=2048, E=64, k=6, G=1, TG=1, scoring="softmax", bias=False, renorm=False,
                    scaling=1.0, first=(16 * 192, DC + DR)),
    "v3": dict(H=128, V=128, hidden=7168, E=256, k=8, G=8, TG=4, scoring="sigmoid", bias=True, renorm=True,
               scaling=2.5, first=(1536, DC + DR)),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def decode_absorb_case(name: str, d: dict, quick: bool, ctx: int = 4096, batch: int = 1) -> None:
    """``mla::decode_absorb_out`` against the decode + the absorb GEMV: one real sequence of ``ctx`` keys and a
    padding sequence of 0 (``batch`` 1, with ``ABSORB``'s sweep unless ``quick``), or ``batch`` sequences of
    ``ctx`` keys."""
    from mla_compile.ops.triton import decode_absorb

    H, V = d["H"], d["V"]
    blocks = ctx // PAGE
    rows = 2 if batch == 1 else batch
    per_set = H * 2 * V * DC * 2 + batch * ctx * (DC + DR) * 2  # kv_b_proj's value rows and the cache read
    sets = []
    for _ in range(bk._rotation(per_set, cap=32)):
        cache = torch.randn(batch * blocks + 1, PAGE, DC + DR, device=DEV, dtype=torch.bfloat16) * 0.5
        table = torch.zeros(rows, blocks, dtype=torch.int32, device=DEV)
        table[:batch] = torch.randperm(batch * blocks, device=DEV).to(torch.int32).view(batch, blocks)
        lens = torch.tensor([ctx] * batch + [0] * (rows - batch), dtype=torch.int32, device=DEV)
        q = torch.randn(rows, 1, H, DC + DR, device=DEV, dtype=torch.bfloat16)
        w_uv = (torch.randn(H, 2 * V, DC, device=DEV, dtype=torch.bfloat16) / DC ** 0.5)[:, V:]
        sets.append((q, cache, table, lens, w_uv))
    scale = 1 / math.sqrt(192)

    def unfused(s):
        out, _ = ops.decode(*s[:4], scale, kv_lora_rank=DC, backend="gluon")
        return ops.skinny_absorb_out(out.flatten(0, 1), s[4], backend="triton")

    def fused(s, backend):
        return ops.decode_absorb_out(*s[:4], scale, kv_lora_rank=DC, w_uv=s[4], backend=backend)

    group = f"decode + absorb_out {name} H={H} B={batch}{' (+1 empty)' if batch == 1 else ''} L={ctx}"
    print(group, flush=True)
    nbytes = per_set
    want = unfused(sets[0])
    bk.attempt(group, "decode gluon + skinny_absorb_out", lambda: [unfused(s) for s in sets], 0, nbytes,
               sets=len(sets))
    for backend in ("gluon", "triton"):
        err = _rel(fused(sets[0], backend), want)
        bk.attempt(group, f"decode_absorb_out {backend} (ours)", lambda b=backend: [fused(s, b) for s in sets], 0,
                   nbytes, note=f"rel err to unfused {err:.1e}", sets=len(sets))
    if quick or batch > 1:
        return
    default = dict(decode_absorb.ABSORB)
    for block_c, warps in ((32, 4), (64, 8), (128, 4), (128, 8)):  # (128, 2) spills on sm_90
        decode_absorb.ABSORB.update(block_c=block_c, num_warps=warps)
        bk.attempt(group, f"decode_absorb_out gluon BC{block_c} w{warps}",
                   lambda: [fused(s, "gluon") for s in sets], 0, nbytes, sets=len(sets))
    decode_absorb.ABSORB.update(default)
    for splits in (16, 48, 64):  # the split kernel's count (its own plan: up to 32 at 4096 keys)
        decode_absorb.ABSORB.update(splits=splits)
        bk.attempt(group, f"decode_absorb_out gluon {splits} splits",
                   lambda: [fused(s, "gluon") for s in sets], 0, nbytes, sets=len(sets))
    decode_absorb.ABSORB.update(default)


def norm_route_case(name: str, d: dict) -> None:
    """``mla::moe_norm_gate_route`` against the add + norm launch and ``mla::moe_gate_route`` (two tokens)."""
    from mla_compile.ops.triton.skinny_norm_linear import add_norm

    hidden, E = d["hidden"], d["E"]
    kw = dict(num_group=d["G"], topk_group=d["TG"], scoring=d["scoring"], renormalize=d["renorm"],
              scaling=d["scaling"])
    nbytes = E * hidden * 2
    sets = []
    for _ in range(bk._rotation(nbytes)):
        x, r = (torch.randn(2, hidden, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        nw = torch.rand(hidden, device=DEV, dtype=torch.bfloat16) + 0.5
        gate = torch.randn(E, hidden, device=DEV, dtype=torch.bfloat16) / hidden ** 0.5
        bias = torch.randn(E, device=DEV) * 0.1 if d["bias"] else None
        sets.append((x, r, nw, gate, bias))

    def unfused(s):
        h, normed = add_norm(s[0], s[1], s[2], 1e-6)
        return h, normed, *ops.moe_gate_route(normed, s[3], d["k"], bias=s[4], backend="triton", **kw)

    def fused(s):
        return ops.moe_norm_gate_route(s[0], s[1], s[2], 1e-6, s[3], d["k"], bias=s[4], backend="triton", **kw)

    group = f"add + norm + router + route {name} {E}x{hidden} T=2"
    print(group, flush=True)
    got, want = fused(sets[0]), unfused(sets[0])
    same = bool((got[3].sort(-1).values == want[3].sort(-1).values).all())
    note = f"normed rel err {_rel(got[1], want[1]):.1e}; ids as unfused: {same}"
    bk.attempt(group, "add_norm + moe_gate_route", lambda: [unfused(s) for s in sets], 0, nbytes, sets=len(sets))
    bk.attempt(group, "moe_norm_gate_route triton (ours)", lambda: [fused(s) for s in sets], 0, nbytes, note=note,
               sets=len(sets))


def norm_linear_case(name: str, d: dict) -> None:
    """``mla::skinny_norm_linear`` over the first projections against the add + norm launch and
    ``mla::skinny_linear`` (two rows)."""
    from mla_compile.ops.triton.skinny_norm_linear import add_norm

    hidden = d["hidden"]
    nbytes = sum(d["first"]) * hidden * 2
    sets = []
    for _ in range(bk._rotation(nbytes)):
        x, r = (torch.randn(2, hidden, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        nw = torch.rand(hidden, device=DEV, dtype=torch.bfloat16) + 0.5
        ws = [torch.randn(n, hidden, device=DEV, dtype=torch.bfloat16) / hidden ** 0.5 for n in d["first"]]
        sets.append((x, r, nw, ws))

    def unfused(s):
        h, normed = add_norm(s[0], s[1], s[2], 1e-6)
        return h, ops.skinny_linear(normed, s[3], backend="triton")

    def fused(s):
        return ops.skinny_norm_linear(s[0], s[1], s[2], 1e-6, s[3], backend="triton")

    group = f"add + norm + first projections {name} {hidden}->{'+'.join(map(str, d['first']))} M=2"
    print(group, flush=True)
    got, want = fused(sets[0]), unfused(sets[0])
    note = f"rel err to unfused {max(_rel(a, b) for a, b in zip(got[1], want[1])):.1e}"
    bk.attempt(group, "add_norm + skinny_linear", lambda: [unfused(s) for s in sets], 2 * nbytes, nbytes,
               sets=len(sets))
    bk.attempt(group, "skinny_norm_linear triton (ours)", lambda: [fused(s) for s in sets], 2 * nbytes, nbytes,
               note=note, sets=len(sets))


def write_absorb_case(name: str, d: dict) -> None:
    """``mla::write_latent_cache_absorb_q`` against the fused cache write + ``mla::skinny_absorb_q`` of a q_pe rotated
    beforehand (its RoPE kernel not counted: the comparison is conservative); two tokens, one a padding (slot -1)."""
    H, N, Dr = d["H"], 128, DR
    nbytes = H * N * DC * 2  # W_UK
    sets = []
    for _ in range(bk._rotation(nbytes)):
        kv = torch.randn(2, DC + Dr, device=DEV, dtype=torch.bfloat16)
        ang = torch.rand(2, Dr // 2, device=DEV) * 6
        cache = torch.zeros(64, PAGE, DC + Dr, device=DEV, dtype=torch.bfloat16)
        q = torch.randn(2, H, N + Dr, device=DEV, dtype=torch.bfloat16)
        w_uk = (torch.randn(H, 2 * N, DC, device=DEV, dtype=torch.bfloat16) / N ** 0.5)[:, :N]
        sets.append((kv[:, :DC], kv[:, DC:], torch.ones(DC, device=DEV, dtype=torch.bfloat16), ang.cos(), ang.sin(),
                     torch.tensor([7, -1], device=DEV), cache, q[..., :N], w_uk, q[..., N:]))

    def unfused(s):
        torch.ops.mla.write_latent_cache_fused(*s[:7], 1e-6, True)
        return ops.skinny_absorb_q(s[7], s[8], s[9], backend="triton")

    def fused(s):
        return ops.write_latent_cache_absorb_q(*s[:7], 1e-6, True, *s[7:], backend="triton")

    group = f"cache write + absorb_q {name} H={H} T=2"
    print(group, flush=True)
    first, twin = sets[0], list(sets[0])
    twin[6] = first[6].clone()
    want = unfused(twin)
    got = fused(first)
    note = (f"latent cols rel err {_rel(got[..., :DC], want[..., :DC]):.1e}; cache rows rel err "
            f"{_rel(first[6][0, 7], twin[6][0, 7]):.1e}; q_pe rotated inside")
    bk.attempt(group, "write_latent_cache_fused + skinny_absorb_q", lambda: [unfused(s) for s in sets], 0, nbytes,
               note="q_pe's RoPE not counted", sets=len(sets))
    bk.attempt(group, "write_latent_cache_absorb_q triton (ours)", lambda: [fused(s) for s in sets], 0, nbytes,
               note=note, sets=len(sets))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_fusions.{json,txt}")
    ap.add_argument("--dims", default="v2-lite,v3", help=f"comma-separated of {sorted(DIMS)}")
    ap.add_argument("--quick", action="store_true", help="no decode_absorb.ABSORB sweep")
    args = ap.parse_args()
    names = [n.strip() for n in args.dims.split(",") if n.strip()]
    unknown = sorted(set(names) - set(DIMS))
    if unknown:
        ap.error(f"--dims: unknown {unknown}; expected names of {sorted(DIMS)}")
    os.makedirs(args.out, exist_ok=True)
    bk.ceilings()  # the copy bandwidth and matmul rate the table's fractions divide by
    sections = []
    for n in names:
        sections += [lambda n=n: decode_absorb_case(n, DIMS[n], args.quick),
                     lambda n=n: decode_absorb_case(n, DIMS[n], True, batch=8), lambda n=n: norm_route_case(n, DIMS[n]),
                     lambda n=n: norm_linear_case(n, DIMS[n]), lambda n=n: write_absorb_case(n, DIMS[n])]
    bk.run_sections(sections, os.path.join(args.out, "bench_fusions.json"))
    text = bk.table_text()
    with open(os.path.join(args.out, "bench_fusions.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
