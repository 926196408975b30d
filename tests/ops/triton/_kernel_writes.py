"""Run as a script (no ``TRITON_INTERPRET``; no GPU needed): launch each Triton kernel of the model's
decode and prefill path on CPU tensors with the launches recorded instead of run, then ask torch's own
Triton mutation analysis (what Inductor believes a kernel writes) which arguments each kernel writes.
Prints one JSON line: per launched kernel, the argument names the analysis finds written."""

from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction


class _Sm90:
    """A stand-in for the GPU driver: the TTIR frontend only asks it for the compile target."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 64)


def _with_config(config: dict, change: dict, run) -> None:
    """``run()`` with ``change`` written into a kernel module's ``config`` dict, restored after."""
    saved = dict(config)
    config.update(change)
    try:
        run()
    finally:
        config.clear()
        config.update(saved)


def main() -> None:
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    from mla_compile.ops.triton import cache_write, decode, fp8_cache_write, fp8_decode, gather, index_cache_write
    from mla_compile.ops.triton import merge, moe_experts, moe_grouped, moe_route, prefill

    triton.runtime.driver.set_active(_Sm90())
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    g = torch.Generator().manual_seed(0)
    bf = dict(dtype=torch.bfloat16)
    B, H, bs, nb = 3, 16, 16, 8
    table = torch.arange(B * 2, dtype=torch.int32).view(B, 2)
    seq_lens = torch.tensor([5, 17, 30], dtype=torch.int32)
    slots = torch.tensor([3, 40, 77], dtype=torch.int64)
    cache = torch.zeros(nb, bs, 576, **bf)
    fp8_cache = torch.zeros(nb, bs, 656, dtype=torch.uint8)
    cu = torch.tensor([0, 2, 5, 9], dtype=torch.int32)
    runs = [
        lambda: cache_write._launch(torch.randn(B, 512, generator=g).to(**bf), torch.randn(B, 64, generator=g).to(**bf),
                                    slots, cache),
        lambda: fp8_cache_write._launch(torch.randn(B, 512, generator=g).to(**bf),
                                        torch.randn(B, 64, generator=g).to(**bf), slots, fp8_cache),
        lambda: index_cache_write._launch(torch.randn(B, 128, generator=g).to(**bf), slots, torch.zeros(nb, bs, 128, **bf)),
        lambda: decode._launch(torch.randn(B, 1, H, 576, generator=g).to(**bf), cache, table, seq_lens, 0.1, 512),
        lambda: fp8_decode.launch_fp8(torch.randn(B, 1, H, 576, generator=g).to(**bf), fp8_cache, table, seq_lens, 0.1, 512),
        lambda: prefill._launch(torch.randn(9, H, 192, generator=g).to(**bf), torch.randn(9, H, 192, generator=g).to(**bf),
                                torch.randn(9, H, 128, generator=g).to(**bf), cu, cu, 0.1, True),
        lambda: gather._launch(cache, table, cu, torch.tensor([0, 1, 2], dtype=torch.int32), torch.zeros(12, 576, **bf)),
        lambda: merge._launch(*(torch.randn(4, H, 128, generator=g).to(**bf), torch.randn(4, H, generator=g)) * 2),
        lambda: moe_route._launch(torch.randn(B, 16, generator=g), torch.zeros(16), 4, 4, 2, "sigmoid", True, 2.5),
        lambda: moe_grouped._launch(torch.randn(B, 64, generator=g).to(**bf), torch.rand(B, 3, generator=g),
                                    torch.zeros(B, 3, dtype=torch.int32), torch.zeros(8, 64, 64, **bf),
                                    torch.zeros(8, 64, 32, **bf), torch.zeros(64, 64, **bf), torch.zeros(64, 64, **bf),
                                    torch.zeros(64, 64, **bf), False, torch.tensor([True, False, True])),
        lambda: moe_experts._launch(torch.randn(B, 64, generator=g).to(**bf), torch.rand(B, 3, generator=g),
                                    torch.zeros(B, 3, dtype=torch.int32), torch.zeros(8, 64, 64, **bf),
                                    torch.zeros(8, 64, 32, **bf), torch.zeros(64, 64, **bf), torch.zeros(64, 64, **bf),
                                    torch.zeros(64, 64, **bf), False),
        # with a token mask (the masked tokens' programs return early): still only the outputs
        lambda: moe_experts._launch(torch.randn(B, 64, generator=g).to(**bf), torch.rand(B, 3, generator=g),
                                    torch.zeros(B, 3, dtype=torch.int32), torch.zeros(8, 64, 64, **bf),
                                    torch.zeros(8, 64, 32, **bf), torch.zeros(64, 64, **bf), torch.zeros(64, 64, **bf),
                                    torch.zeros(64, 64, **bf), False, torch.tensor([True, False, True])),
        # the other form of each experts kernel (the GEMV gate-up, the tensor-core down)
        lambda: _with_config(moe_experts.CONFIG, dict(gate_up_pipe=False, gate_up_dot=False, down_dot=True), lambda: moe_experts._launch(
            torch.randn(B, 64, generator=g).to(**bf), torch.rand(B, 3, generator=g),
            torch.zeros(B, 3, dtype=torch.int32), torch.zeros(8, 64, 64, **bf), torch.zeros(8, 64, 32, **bf),
            torch.zeros(64, 64, **bf), torch.zeros(64, 64, **bf), torch.zeros(64, 64, **bf), False,
            torch.tensor([True, False, True]))),
        # kernel 1's tensor-core form (its pipelined GEMV form is the default)
        lambda: _with_config(moe_experts.CONFIG, dict(gate_up_pipe=False), lambda: moe_experts._launch(
            torch.randn(B, 64, generator=g).to(**bf), torch.rand(B, 3, generator=g),
            torch.zeros(B, 3, dtype=torch.int32), torch.zeros(8, 64, 64, **bf), torch.zeros(8, 64, 32, **bf),
            torch.zeros(64, 64, **bf), torch.zeros(64, 64, **bf), torch.zeros(64, 64, **bf), False,
            torch.tensor([True, False, True]))),
    ]
    report: dict[str, list[str]] = {}
    for run in runs:
        run()
    for kernel, args, kwargs in launches:
        named = dict(zip(kernel.arg_names, args), **kwargs)
        for key in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
            named.pop(key, None)
        writes = identify_accessed_tensors(kernel, named, {}).read_writes.writes
        report[kernel.fn.__name__] = sorted(set(report.get(kernel.fn.__name__, ())) | {dep.name for dep in writes})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
