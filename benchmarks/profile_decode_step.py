"""Where the host time of one decode step goes: torch.profiler over the eager and compiled steps of
bench_decode_step's model, per attention backend (a diagnostic, not a benchmark).

    python benchmarks/profile_decode_step.py --out OUT [--backends triton,flashmla] [--batch 8]
    python benchmarks/profile_decode_step.py --out /tmp/p --device cpu --tiny --backends reference
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_step as bds  # noqa: E402


def main(argv=None) -> None:
    extra = {"--backends": "triton,flashmla", "--batch": "8"}
    argv = list(sys.argv[1:] if argv is None else argv)
    for key in list(extra):
        if key in argv:
            i = argv.index(key)
            extra[key] = argv[i + 1]
            del argv[i:i + 2]
    args = bds.parse_args(argv)
    batch, ctx = int(extra["--batch"]), max(args.ctx_list)
    args.batch_list = [batch]
    import mla_compile  # noqa: F401
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.models.metadata import mark_dynamic
    from mla_compile.models.model import patch

    dev, dtype = torch.device(args.device), args.torch_dtype
    os.makedirs(args.out, exist_ok=True)
    hf = bds.build_hf(args, dev, dtype)
    wl = bds.Workload(args, dev, dtype, hf.config.kv_lora_rank, hf.config.qk_rope_head_dim)
    lines = []
    for backend in extra["--backends"].split(","):
        torch._dynamo.reset()
        model = patch(hf, backend=backend)
        caches = model.allocate_cache(wl.num_blocks, wl.bs)
        for i, cache in enumerate(caches):
            cache.copy_(wl.latents(i))
        builder = MetadataBuilder(max_batch=wl.max_batch, max_blocks_per_seq=wl.nb, max_tokens=wl.max_batch,
                                  block_size=wl.bs, device=dev)
        for name, fn in (("eager", model), ("compiled", torch.compile(model, fullgraph=True))):
            def step(k):
                s = builder.build(wl.chunks(batch, ctx, k))
                mark_dynamic(s.input_ids, s.positions, s.meta)
                with torch.no_grad():
                    return fn(s.input_ids, s.positions, s.meta)[:s.num_rows].argmax(-1).tolist()
            for k in range(3):
                step(k)
            bds.sync(dev)
            t0 = time.perf_counter()
            for k in range(10):
                step(k)
            wall = (time.perf_counter() - t0) / 10 * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for k in range(3):
                    step(k)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
            head = f"== {backend} {name}: B={batch} ctx={ctx}: {wall:.3f} ms per step (wall, host included)"
            print(head, flush=True)
            print("\n".join(table.splitlines()[:18]), flush=True)
            lines += [head, table]
    with open(os.path.join(args.out, "profile_decode_step.txt"), "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
