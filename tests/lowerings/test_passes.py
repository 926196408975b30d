"""The MLA post-grad fusion pass on small CPU graphs: norm + rope + cache write becomes one
``mla::write_latent_cache_fused`` call with unchanged numbers; it leaves graphs alone when the pieces
are used elsewhere or when switched off; its uuid is stable."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import mla_compile
from mla_compile.lowerings import MLAFusionPass, compile_options, mla_passes
from mla_compile.ops.fused_kv_write import rms_norm
from mla_compile.rope import apply_rope
from tests.ops.ref64 import generator, randn

DC, DR, EPS = 32, 8, 1e-6
SLOTS = [3, -1, 0, 7, 9, 14]


def _step(kv_a, w, cos, sin, slots, cache, interleave, extra_use):
    latent, k_pe = kv_a.split([DC, DR], -1)
    latent = rms_norm(latent, w, EPS)
    k_pe = apply_rope(k_pe, cos, sin, interleave)
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
    return out, "\n".join(code), counters["mla_passes"]["fuse_kv_write"]


@pytest.mark.parametrize("dtype,interleave", [(torch.float32, True), (torch.bfloat16, False)])
def test_norm_rope_write_become_one_op_with_the_same_cache(dtype, interleave):
    args = _inputs(11, dtype)
    eager_cache = args[-1].clone()
    _step(*args[:-1], eager_cache, interleave, False)
    _, code, fired = _compiled(args, interleave, False)
    assert fired == 1
    assert "torch.ops.mla.write_latent_cache_fused.default(" in code
    assert "write_latent_cache_ref" not in code.split("def call(")[-1]  # the unfused write is gone
    written = [s for s in SLOTS if s >= 0]
    got, want = args[-1].view(-1, DC + DR), eager_cache.view(-1, DC + DR)
    torch.testing.assert_close(got[written], want[written], atol=0, rtol=0)  # same math as eager, bit for bit
    untouched = [i for i in range(16) if i not in written]
    assert got[untouched].isnan().all()  # padding slot -1 wrote nothing


def test_pass_leaves_the_graph_when_the_norm_is_used_elsewhere():
    args = _inputs(12, torch.float32)
    counters["mla_passes_skipped"].clear()
    _, code, fired = _compiled(args, True, True)
    assert fired == 0 and "write_latent_cache_fused" not in code
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


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,interleave", [(torch.bfloat16, True), (torch.float32, False)])
def test_cuda_pass_fuses_the_triton_write(dtype, interleave):
    """On CUDA the write is our Triton op (traced into its kernel or left opaque): the pass must still fire."""
    args = tuple(a.cuda() for a in _inputs(14, dtype))
    eager_cache = args[-1].clone()
    _step(*args[:-1], eager_cache, interleave, False)
    counters["mla_passes_skipped"].clear()
    seen = []  # the post-grad graph as the pass sees it: on failure, what the write looks like there
    with torch._inductor.config.patch(post_grad_custom_pre_pass=lambda g: seen.append(_describe(g))):
        _, code, fired = _compiled(args, interleave, False)
    assert fired == 1, (dict(counters["mla_passes_skipped"]), seen)
    assert "_cache_write_kernel" not in code and "write_latent_cache_triton" not in code.split("def call(")[-1]
    written = [s for s in SLOTS if s >= 0]
    got, want = args[-1].view(-1, DC + DR), eager_cache.view(-1, DC + DR)
    # the fused kernel sums the norm in its own order: float32 agrees to rounding, not bit for bit
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got[written], want[written], **tol)


def test_pass_switched_off_by_flag_and_env(monkeypatch):
    assert mla_passes(False) is not None and compile_options(False) == {}
    monkeypatch.setenv("MLA_COMPILE_PASSES", "0")
    assert compile_options() == {}
    assert _compiled(_inputs(13, torch.float32), True, False)[2] == 0


def test_uuid_is_stable_and_names_the_pass():
    a, b = MLAFusionPass().uuid(), MLAFusionPass().uuid()
    assert a == b and a.startswith("mla_compile.lowerings.passes:")
    assert isinstance(compile_options(True)["post_grad_custom_post_pass"], MLAFusionPass)
