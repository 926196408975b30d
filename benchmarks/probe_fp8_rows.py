"""Probe: ``mla::fp8_block_linear``'s Triton launch at V4-Flash's fp8 projection shapes for a few to a hundred rows
(decode batches): K unsplit against K split in slices summed in the kernel (``serial``: the op's launch, its split
chosen for the rows) and 32-column tiles each way, per row count. Weight sets rotate so the timed calls read from
HBM, as a decode step's projections do; median of 10 replays of a CUDA graph of up to 20 calls; bf16 activations.

    python benchmarks/probe_fp8_rows.py
"""
import torch
from bench_kernels import graph_ms  # this folder: on the path when run as a script
import triton

from mla_compile.ops.triton import fp8_block_linear as fl

# (name, groups, N, K): V4-Flash (hidden 4096, q_lora 1024, 64 heads of 512, o_groups 8 of o_lora 1024, indexer 64
# heads of 128, shared expert 2048)
SHAPES = (("q_a", 1, 1024, 4096), ("kv", 1, 512, 4096), ("q_b", 1, 32768, 1024), ("o_a", 8, 1024, 4096),
          ("o_b", 1, 4096, 8192), ("idx q_b", 1, 8192, 1024), ("shared gate", 1, 2048, 4096),
          ("shared down", 1, 4096, 2048))


def t(fn):
    """Microseconds per call (``bench_kernels.graph_ms``: replays of a CUDA graph of a few calls)."""
    return graph_ms(fn) * 1e3


def main():
    for name, E, N, K in SHAPES:
        shape = (E, N, K) if E > 1 else (N, K)
        nbytes = E * N * K
        sets = max(1, -(-(160 << 20) // nbytes))
        ws = [(torch.randn(shape, device="cuda") * 8).to(torch.float8_e4m3fn) for _ in range(sets)]
        ss = [torch.full((*shape[:-2], triton.cdiv(N, 128), triton.cdiv(K, 128)), 0.0025, device="cuda")
              for _ in range(sets)]
        for M in (1, 16, 17, 32, 64, 128):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cfg = fl._config(M, False, E * N)
            split = fl._split(M, triton.cdiv(M, cfg["BLOCK_M"]), E * triton.cdiv(N, cfg["BLOCK_N"]), K, None)[0]
            split32 = fl._split(M, triton.cdiv(M, cfg["BLOCK_M"]), E * triton.cdiv(N, 32), K, None)[0]
            i = [0]

            def call(**kw):
                def f():
                    w, s = ws[i[0] % sets], ss[i[0] % sets]
                    i[0] += 1
                    fl._launch(x, w, s, False, **kw)
                return f

            n32 = {"BLOCK_N": 32}
            us = {"unsplit": t(call(split=1)), f"serial x{split} (shipped)": t(call(serial=True)),
                  "n32 unsplit": t(call(split=1, config=n32)),
                  f"n32 serial x{split32}": t(call(serial=True, config=n32))}
            cells = "  ".join(f"{k} {v:7.1f}" for k, v in us.items())
            best = nbytes / 1e3 / min(us.values())
            print(f"{name:12s} M={M:3d} {nbytes / 2**20:5.1f} MiB  {cells} us  best {best:5.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
