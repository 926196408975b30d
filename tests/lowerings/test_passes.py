"""The MLA post-grad fusion pass on small CPU graphs: norm + rope + cache write (float cache, or the
quantizing write into the fp8 cache) becomes one ``mla::write_latent_cache_fused`` call with unchanged
numbers; it leaves graphs alone when the pieces are used elsewhere or when switched off; its uuid is
stable."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import mla_compile
from mla_compile.lowerings.passes import COUNTER_KEYS
from mla_compile.lowerings import MLAFusionPass, compile_options, mla_passes
from mla_compile.ops.fused_kv_write import rms_norm
from mla_compile.models.rope import apply_rope
from tests.lowerings.test_fused_kv_write import assert_fp8_rows_close
from tests.ops.ref64 import generator, randn

DC, DR, EPS = 32, 8, 1e-6
SLOTS = [3, -1, 0, 7, 9, 14]


def _step(kv_a, w, cos, sin, slots, cache, interleave, extra_use):
    dc = kv_a.shape[1] - DR
    latent, k_pe = kv_a.split([dc, DR], -1)
    latent = rms_norm(latent, w, EPS)
    k_pe = apply_rope(k_pe, cos, sin, interleave)
    if cache.dtype == torch.uint8:
        mla_compile.ops.write_latent_cache_fp8(latent, k_pe, slots, cache)
    else:
        mla_compile.ops.write_latent_cache(latent, k_pe, slots, cache)
    return latent.sum(-1) if extra_use else kv_a.sum(-1)


def _inputs(seed, dtype):
    gen = generator(seed)
    T = len(SLOTS)
    return (randn(gen, T, DC + DR, dtype=dtype), randn(gen, DC, dtype=dtype), randn(gen, T, DR // 2, dtype=torch.float32),
            randn(gen, T, DR // 2, dtype=torch.float32), torch.tensor(SLOTS), torch.full((4, 4, DC + DR), float("nan"), dtype=dtype))


def _compiled(args, interleave, extra_use, enabled=True):
    counters["mla_passes"].clear()
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: _step(*a, interleave, extra_use), fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True), mla_passes(enabled):
        out, code = run_and_get_code(fn, *args)
    torch._dynamo.reset()
    return out, "\n".join(code), {k: v for k, v in counters["mla_passes"].items() if v}


@pytest.mark.parametrize("dtype,interleave", [(torch.float32, True), (torch.bfloat16, False)])
def test_norm_rope_write_become_one_op_with_the_same_cache(dtype, interleave):
    args = _inputs(11, dtype)
    eager_cache = args[-1].clone()
    _step(*args[:-1], eager_cache, interleave, False)
    _, code, fired = _compiled(args, interleave, False)
    assert fired == {"fuse_kv_write": 1}
    assert "torch.ops.mla.write_latent_cache_fused.default(" in code
    assert "write_latent_cache_ref" not in code.split("def call(")[-1]  # the unfused write is gone
    written = [s for s in SLOTS if s >= 0]
    got, want = args[-1].view(-1, DC + DR), eager_cache.view(-1, DC + DR)
    torch.testing.assert_close(got[written], want[written], atol=0, rtol=0)  # same math as eager, bit for bit
    untouched = [i for i in range(16) if i not in written]
    assert got[untouched].isnan().all()  # padding slot -1 wrote nothing


DC8 = 256  # two fp8 groups of 128
W8 = DC8 + DC8 // 32 + 2 * DR  # fp8 row bytes


def _fp8_inputs(seed, dtype):
    gen = generator(seed)
    T = len(SLOTS)
    return [randn(gen, T, DC8 + DR, dtype=dtype), randn(gen, DC8, dtype=dtype), randn(gen, T, DR // 2, dtype=torch.float32),
            randn(gen, T, DR // 2, dtype=torch.float32), torch.tensor(SLOTS), torch.full((4, 4, W8), 0xFF, dtype=torch.uint8)]


def test_norm_rope_fp8_write_become_one_op_with_eagers_bytes():
    args = _fp8_inputs(14, torch.bfloat16)
    eager_cache, plain_cache = args[-1].clone(), args[-1].clone()
    _step(*args[:-1], eager_cache, True, False)
    _, plain_code, plain_fired = _compiled(args[:-1] + [plain_cache], True, False, enabled=False)
    _, code, fired = _compiled(args, True, False)
    assert fired == {"fuse_kv_write_fp8": 1} and plain_fired == {}
    assert "torch.ops.mla.write_latent_cache_fused.default(" in code
    assert "write_latent_cache_fp8_ref" not in code.split("def call(")[-1]
    assert "write_latent_cache_fp8_ref" in plain_code.split("def call(")[-1]
    written = [s for s in SLOTS if s >= 0]
    untouched = [i for i in range(16) if i not in written]
    got, want = args[-1].view(-1, W8), eager_cache.view(-1, W8)
    assert torch.equal(got[written], want[written])  # the fused op runs eager's math: the same bytes
    assert got[untouched].eq(0xFF).all()  # padding slot -1 wrote nothing
    # the unfused compiled graph normalizes in Inductor's own kernel (it may skip eager's bf16 rounding
    # of x * rsqrt(var)): codes at most one e4m3 step apart, scales and rope within bf16 rounding
    assert_fp8_rows_close(args[-1], plain_cache, DC8)
    assert "fuse_kv_write_fp8" in COUNTER_KEYS


def test_pass_leaves_the_graph_when_the_norm_is_used_elsewhere():
    args = _inputs(12, torch.float32)
    counters["mla_passes_skipped"].clear()
    _, code, fired = _compiled(args, True, True)
    assert fired == {} and "write_latent_cache_fused" not in code
    assert dict(counters["mla_passes_skipped"]) == {
        "fuse_kv_write: the normed latent or roped k_pe has other users (prefill)": 1}  # the reason is kept


def _describe(graph: torch.fx.Graph) -> str:
    """Each call's target, and for Triton kernel wrappers the kernel's name and argument names."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    lines = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        extra = ""
        if "kernel_idx" in n.kwargs:
            k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            fn = getattr(k, "fn", k)
            extra = f" kernel={type(k).__name__}:{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}" \
                    f" args={sorted(n.kwargs.get('kwargs', {}))}"
        elif n.args and isinstance(n.args[0], torch._ops.OpOverload):
            extra = f" op={n.args[0]}"
        lines.append(f"{n.name}: {n.target}{extra}")
    return "\n".join(lines)


def test_pass_switched_off_by_flag_and_env(monkeypatch):
    assert mla_passes(False) is not None and compile_options(False, pdl=False) == {}
    assert compile_options(False) == {"triton.enable_pdl": True}  # Inductor's PDL: on unless asked off
    monkeypatch.setenv("MLA_COMPILE_PASSES", "0")
    assert compile_options(pdl=False) == {}
    assert _compiled(_inputs(13, torch.float32), True, False)[2] == {}


def test_uuid_is_stable_and_names_the_pass():
    a, b = MLAFusionPass().uuid(), MLAFusionPass().uuid()
    assert a == b and a.startswith("mla_compile.lowerings.passes:")
    assert isinstance(compile_options(True)["post_grad_custom_post_pass"], MLAFusionPass)


def _triton_step(kv_a, w, cos, sin, slots, cache):
    """``_step`` with the Triton cache writes asked for by name: in the post-grad graph they are
    ``triton_kernel_wrapper_functional`` nodes of ``_cache_write_kernel`` / ``_fp8_write_kernel``."""
    latent, k_pe = kv_a.split([kv_a.shape[1] - DR, DR], -1)
    latent, k_pe = rms_norm(latent, w, EPS), apply_rope(k_pe, cos, sin, True)
    if cache.dtype == torch.uint8:
        mla_compile.ops.write_latent_cache_fp8(latent, k_pe, slots, cache, backend="triton")
    else:
        mla_compile.ops.write_latent_cache(latent, k_pe, slots, cache, backend="triton")
    return kv_a.sum(-1)


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_pass_fuses_the_triton_cache_writes(fp8):
    args = [t.cuda() for t in (_fp8_inputs(15, torch.bfloat16) if fp8 else _inputs(15, torch.bfloat16))]
    eager_cache = args[-1].clone()
    _triton_step(*args[:-1], eager_cache)
    counters["mla_passes"].clear()
    counters["mla_passes_skipped"].clear()
    torch._dynamo.reset()
    seen = []  # the post-grad graph as the pass sees it: on failure, what the write looks like there
    with torch._inductor.config.patch(force_disable_caches=True, post_grad_custom_pre_pass=lambda g: seen.append(_describe(g))), \
            mla_passes(True):
        _, code = run_and_get_code(torch.compile(_triton_step, fullgraph=True), *args)
    torch._dynamo.reset()
    code = "\n".join(code)
    fired = {k: v for k, v in counters["mla_passes"].items() if v}
    assert fired == {"fuse_kv_write_fp8" if fp8 else "fuse_kv_write": 1}, (dict(counters["mla_passes_skipped"]), seen)
    assert "torch.ops.mla.write_latent_cache_fused.default(" in code
    assert ("_fp8_write_kernel" if fp8 else "_cache_write_kernel") not in code
    if fp8:  # the fused kernel's norm sums in its own order: rows within one e4m3 step of eager's
        assert_fp8_rows_close(args[-1].cpu(), eager_cache.cpu(), DC8)
    else:
        torch.testing.assert_close(args[-1], eager_cache, atol=1e-2, rtol=2e-2, equal_nan=True)  # bf16: 2 ulp
