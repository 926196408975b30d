"""Run as a script (no ``TRITON_INTERPRET``; no GPU needed): launch each Triton kernel of the model's
decode and prefill path and of every ``triton_op`` in ops/triton/ on CPU tensors with the launches recorded
instead of run, then ask torch's own Triton mutation analysis (what Inductor believes a kernel writes) which
arguments each kernel writes. Prints one JSON line: per launched kernel, the argument names the analysis
finds written (the union over its launches)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction


class _Sm90:
    """A stand-in for the GPU driver: the TTIR frontend only asks it for the compile target."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 64)


class _AnalysisFailures(logging.Handler):
    """Counts torch's warning that ``identify_accessed_tensors`` hit an exception and assumed every input
    mutated: a launch that does not compile must fail the script, not pass for a false positive."""

    count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "identify_accessed_tensors" in record.getMessage():
            self.count += 1


def _with_config(config: dict, change: dict, run) -> None:
    """``run()`` with ``change`` written into a kernel module's ``config`` dict, restored after."""
    saved = dict(config)
    config.update(change)
    try:
        run()
    finally:
        config.clear()
        config.update(saved)


def _with_attr(module, name: str, value, run) -> None:
    """``run()`` with ``module.name`` set to ``value``, restored after."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        run()
    finally:
        setattr(module, name, saved)


def _triton_op_runs(g: torch.Generator) -> list:
    """Launches of the other ``triton_op`` kernels: fp8 / fp4 block linear, lightning index, sparse decode, V4
    attention and compressor, fp8 and fp4 experts. Inputs from the interpreter tests' builders (imported from the
    repository root), at tiny shapes: nothing runs, the analysis only needs valid shapes and dtypes."""
    sys.path.insert(1, str(Path(__file__).resolve().parents[3]))  # ``tests.ops...``; this folder is sys.path[0]
    from _sparse_test_util import float_paged, fp8_paged, fp8_width
    from mla_compile.ops.triton import fp4_block_linear, fp8_block_linear, lightning_index
    from mla_compile.ops.triton import moe_experts_fp4, moe_experts_fp8
    from mla_compile.ops.triton import sparse_decode, v4_attention, v4_compress
    from tests.ops.test_fp4_block_linear import _weights as fp4_weights
    from tests.ops.test_fp8_block_linear import _weights as fp8_weights
    from tests.ops.test_moe_experts_fp4 import make as moe_fp4_inputs
    from tests.ops.test_moe_experts_fp8 import make as moe_fp8_inputs
    from tests.ops.triton.test_triton_interpret_v4 import _case as v4_case
    from tests.ops.triton.test_triton_interpret_v4 import _compress_steps as compress_steps

    bf, i32 = dict(dtype=torch.bfloat16), torch.int32
    runs = []
    # fp8 block linear: plain (weight-only and act-quant), a forced split-K launch, grouped, sorted groups
    for act_quant in (False, True):
        runs += [
            lambda a=act_quant: fp8_block_linear._launch(torch.randn(3, 300, generator=g).to(**bf),
                                                         *fp8_weights(200, 300), a),
            lambda a=act_quant: fp8_block_linear._launch(torch.randn(3, 700, generator=g).to(**bf),
                                                         *fp8_weights(70, 700), a, split=2),
            lambda a=act_quant: fp8_block_linear._launch(torch.randn(5, 150, generator=g).to(**bf),
                                                         *fp8_weights(3, 70, 150), a),
            lambda a=act_quant: fp8_block_linear._launch_sorted(torch.randn(23, 150, generator=g).to(**bf),
                                                                *fp8_weights(4, 70, 150), a,
                                                                torch.tensor([5, 5, 17, 20], dtype=i32)),
        ]
    # fp4 block linear: the tiled kernel (plain, grouped), the GEMV (dense, sorted), the sorted tiled kernel
    runs += [
        lambda: fp4_block_linear._launch(torch.randn(20, 320, generator=g).to(**bf), *fp4_weights(33, 320)),
        lambda: fp4_block_linear._launch(torch.randn(5, 96, generator=g).to(**bf), *fp4_weights(3, 70, 96)),
        lambda: fp4_block_linear._launch(torch.randn(3, 160, generator=g).to(**bf), *fp4_weights(70, 160)),
        lambda: fp4_block_linear._launch(torch.randn(3, 2, 96, generator=g).to(**bf), *fp4_weights(3, 70, 96)),
        lambda: fp4_block_linear._launch_sorted(torch.randn(23, 96, generator=g).to(**bf), *fp4_weights(4, 70, 96),
                                                torch.tensor([5, 5, 17, 20], dtype=i32)),
        lambda: fp4_block_linear._launch_sorted(torch.randn(3, 96, generator=g).to(**bf), *fp4_weights(4, 70, 96),
                                                torch.tensor([1, 1, 2, 3], dtype=i32)),
    ]
    # lightning index: bf16 and fp8 (uint8 rows of d + 4 bytes) index caches
    T, Hi, d, bs = 5, 4, 32, 16
    for cache in (torch.zeros(6, bs, d, **bf), torch.zeros(6, bs, d + 4, dtype=torch.uint8)):
        # torch.topk's selection here: the in-register top-k's output (recorded, never written) feeds torch indexing
        runs.append(lambda c=cache: _with_attr(lightning_index, "TOPK_MAX_L", 0, lambda: _with_attr(
            lightning_index, "TOPK_ANY_L", 0, lambda: lightning_index._launch(
                torch.randn(T, Hi, d, generator=g).to(**bf), torch.rand(T, Hi, generator=g), c,
                torch.tensor([[0, 2, 4], [1, 3, 5]], dtype=i32), torch.tensor([20, 40], dtype=i32),
                torch.tensor([0, 0, 1, 1, -1], dtype=i32), torch.tensor([18, 19, 38, 39, 0], dtype=i32), 8))))
    runs.append(lambda: lightning_index.topk_positions(torch.randn(3, 48, generator=g), 8))
    # sparse decode: bf16 and fp8 caches, one split (direct) and three (workspace + the reduce kernel)
    DC, DR, H = 128, 16, 16
    lens = [3, 40, 21]
    float_cache = float_paged(lens, bs, DC + DR, torch.bfloat16, "cpu", g)[0]
    fp8_cache = fp8_paged(lens, bs, DC, DR, "cpu", g)[0]
    assert fp8_cache.shape[-1] == fp8_width(DC, DR)
    for cache in (float_cache, fp8_cache):
        for splits in (1, 3):
            runs.append(lambda c=cache, s=splits: sparse_decode._launch(
                torch.randn(len(lens), 1, H, DC + DR, generator=g).to(**bf), c,
                torch.randint(-1, c.shape[0] * bs, (len(lens), 1, 48), generator=g, dtype=i32), (DC + DR) ** -0.5,
                DC, config={"SPLITS": s, "BLOCK_N": 16}))
    # V4 attention: one split (the attention kernel stores the result) and three (workspace + the merge kernel);
    # rope 32 and the default tiles: every tl.dot has K >= 16 (the interpreter tests' smaller tiles do not compile)
    q, kv, ws, comp, cs, sinks, pos, inv_freq = v4_case(1, torch.bfloat16, H=16, D=64, rope=32)
    for splits in (1, 3):
        runs.append(lambda s=splits: v4_attention._launch(q, kv, ws, comp, cs, sinks, pos, inv_freq, 0.1,
                                                          config=dict(SPLITS=s)))
    # V4 compressor (mutates_args: state_kv, state_gate, cache), overlapping windows and not
    for overlap, rate in ((True, 4), (False, 4)):
        steps, bias, norm_w, freq, table, cin = compress_steps(0, overlap, rate)
        C, R = (cin // 2, 2 * rate) if overlap else (cin, rate)
        kv_in, gate, seq, qpos = steps[0]
        runs.append(lambda a=(kv_in.to(**bf), gate.to(**bf), seq, qpos, torch.tensor([2, 0, 3], dtype=i32),
                              torch.zeros(4, R, cin, **bf), torch.zeros(4, R, cin, **bf), bias, norm_w, freq,
                              torch.zeros(12, 3, C, **bf), table, rate, 1e-6, overlap): v4_compress._launch(*a))
    # fp8 experts: with shared experts and a token mask, without shared experts, with the swiglu clamp
    mask = torch.tensor([True, False, True])
    runs += [
        lambda: moe_experts_fp8._launch(*moe_fp8_inputs(3, 40, 24, 6, 3, 2, dtype=torch.bfloat16), False, None),
        lambda: moe_experts_fp8._launch(*moe_fp8_inputs(3, 40, 24, 6, 3, 2, dtype=torch.bfloat16), False, None,
                                        mask),
        lambda: moe_experts_fp8._launch(*moe_fp8_inputs(3, 40, 24, 6, 3, 0, dtype=torch.bfloat16), True, 0.05,
                                        mask),
        lambda: moe_experts_fp8._launch(*moe_fp8_inputs(3, 40, 24, 6, 3, 0, dtype=torch.bfloat16), False, None),
    ]
    # fp4 experts: with the swiglu clamp (1 token: pipelined K loops) and without (3 tokens: one stage)
    runs += [
        lambda: moe_experts_fp4._launch(*moe_fp4_inputs(1, 64, 96, 6, 3, dtype=torch.bfloat16), True, 0.05),
        lambda: moe_experts_fp4._launch(*moe_fp4_inputs(3, 64, 96, 6, 3, dtype=torch.bfloat16), False, None),
    ]
    # fp4 block linear's tiled kernels on bf16 x with the byte-wise decode (TILED_WORDS off; the runs above: words)
    runs += [
        lambda: _with_attr(fp4_block_linear, "TILED_WORDS", False, lambda: fp4_block_linear._launch(
            torch.randn(20, 320, generator=g).to(**bf), *fp4_weights(33, 320))),
        lambda: _with_attr(fp4_block_linear, "TILED_WORDS", False, lambda: fp4_block_linear._launch_sorted(
            torch.randn(23, 96, generator=g).to(**bf), *fp4_weights(4, 70, 96),
            torch.tensor([5, 5, 17, 20], dtype=i32))),
    ]
    return runs


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
    runs += _triton_op_runs(g)
    report: dict[str, list[str]] = {}
    for run in runs:
        run()
    failed = _AnalysisFailures()
    logging.getLogger("torch._dynamo").addHandler(failed)
    for kernel, args, kwargs in launches:
        named = dict(zip(kernel.arg_names, args), **kwargs)
        for key in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
            named.pop(key, None)
        writes = identify_accessed_tensors(kernel, named, {}).read_writes.writes
        if failed.count:  # the analysis failed (e.g. the kernel does not compile at these shapes)
            raise SystemExit(f"{kernel.fn.__name__}: identify_accessed_tensors failed (logged above), which reports "
                             "every input as mutated; fix the launch's shapes or config")
        report[kernel.fn.__name__] = sorted(set(report.get(kernel.fn.__name__, ())) | {dep.name for dep in writes})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
