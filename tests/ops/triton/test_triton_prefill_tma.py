"""The TMA prefill kernel (``ops/triton/prefill_tma.py``, backend "triton-tma"): on CUDA against a float64
per-sequence reference (NaN-poisoned outputs and padding rows, empty sequences, more keys than queries,
strided k/v views, every autotune configuration); on any machine its sm_90 compile (no spills, shared memory
within an SM's 227 KB, the dots and TMA loads in place)."""

from __future__ import annotations

import math

import pytest
import torch

import mla_compile  # noqa: F401
from _triton_test_util import assert_attention_close, cu_from_lens, poison_allocator, prefill_ref64, sm90_compile
from mla_compile.lowerings.prefill import TMA_CONFIGS

SCALE = 1 / math.sqrt(192)


def _inputs(H, lens_q, lens_k, dqk, dv, dtype, seed, pad=5):
    gen = torch.Generator().manual_seed(seed)
    T, S = sum(lens_q) + pad, sum(lens_k) + 3
    q = torch.randn(T, H, dqk, generator=gen).to(dtype)
    k = torch.randn(S, H, dqk, generator=gen).to(dtype)
    v = torch.randn(S, H, dv, generator=gen).to(dtype)
    q[sum(lens_q):], k[sum(lens_k):], v[sum(lens_k):] = math.nan, math.nan, math.nan  # padding: never read
    return q.cuda(), k.cuda(), v.cuda()


def _check(H, lens_q, lens_k, causal, config=None, dtype=torch.bfloat16, dqk=192, dv=128, seed=0, backend=False):
    from mla_compile.ops import prefill
    from mla_compile.ops.triton import prefill_tma as pt

    q, k, v = _inputs(H, lens_q, lens_k, dqk, dv, dtype, seed)
    cu_q, cu_k = cu_from_lens(lens_q, "cuda"), cu_from_lens(lens_k, "cuda")
    assert pt.eligible(q, k, v)
    poison_allocator()
    if backend:
        out, lse = prefill(q, k, v, cu_q, cu_k, SCALE, causal=causal, backend="triton-tma")
    else:
        out, lse = pt.launch(q, k, v, cu_q, cu_k, SCALE, causal, config=config)
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, causal)
    assert out.shape == (q.shape[0], H, dv) and out.dtype == dtype and lse.dtype == torch.float32
    assert_attention_close(out, lse, ref, ref_lse, dtype)


LENS_Q = [1, 0, 300, 128, 1000, 0, 2500, 77]
LENS_K = [1, 0, 300, 1000, 1000, 9, 4096, 1077]  # empty sequences (one with keys), more keys than queries


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cfg", ["default", "n64s3", "heads_first", "m64"])
def test_cuda_prefill_tma_mixed_lengths(causal, cfg):
    config = {"default": {}, "n64s3": dict(BLOCK_N=64, num_stages=3), "heads_first": dict(HEADS_FIRST=True),
              "m64": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)}[cfg]
    _check(16, LENS_Q, LENS_K, causal, config, seed=int(causal))




@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_tma_backend_deepseek_heads_fp16_and_generic_dims():
    _check(128, [1024, 513], [1024, 2000], True, seed=3, backend=True)
    _check(4, [100, 37], [150, 37], True, dtype=torch.float16, seed=4, backend=True)
    _check(3, [50, 20], [60, 20], True, dqk=128, dv=64, seed=7, backend=True)  # no second qk tile


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_tma_strided_views_and_fallback():
    from mla_compile.ops import prefill
    from mla_compile.ops.triton import prefill_tma as pt

    gen = torch.Generator().manual_seed(9)
    lq, lk = [300, 45], [700, 45]
    cu_q, cu_k = cu_from_lens(lq, "cuda"), cu_from_lens(lk, "cuda")
    kv = torch.randn(sum(lk), 8, 192 + 128 + 64, generator=gen).bfloat16().cuda()
    k, v = kv[..., :192], kv[..., 192:320]  # head stride 384, not the head dim
    q = torch.randn(sum(lq), 8, 192, generator=gen).bfloat16().cuda()
    assert pt.eligible(q, k, v)
    poison_allocator()
    out, lse = prefill(q, k, v, cu_q, cu_k, SCALE, causal=True, backend="triton-tma")
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, True)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)
    # an odd head dim is not eligible: the op runs the pointer kernel
    q2, k2, v2 = q[..., :80], k[..., :80], v[..., :40]
    assert not pt.eligible(q2, k2, v2)
    out, lse = prefill(q2, k2, v2, cu_q, cu_k, SCALE, causal=True, backend="triton-tma")
    ref, ref_lse = prefill_ref64(q2, k2, v2, cu_q, cu_k, SCALE, True)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_tma_autotune_configs():
    from mla_compile.ops import prefill_autotune  # noqa: F401  (registers mla::prefill_triton_tma_config)

    lq, lk = [200, 333, 0, 64], [200, 400, 5, 64]
    q, k, v = _inputs(8, lq, lk, 192, 128, torch.bfloat16, 6)
    cu_q, cu_k = cu_from_lens(lq, "cuda"), cu_from_lens(lk, "cuda")
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, True)
    for cfg in TMA_CONFIGS:
        poison_allocator()
        out, lse = torch.ops.mla.prefill_triton_tma_config(q, k, v, cu_q, cu_k, SCALE, True, *cfg)
        assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)


def _compile_sm90(bm, bn, warps, stages, causal=True):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mla_compile.ops.triton import prefill_tma as pt

    def desc(r, c):
        return f"tensordesc<bf16[{r}, {c}]>"

    sig = dict(qa_desc=desc(bm, 128), qb_desc=desc(bm, 64), ka_desc=desc(bn, 128), kb_desc=desc(bn, 64),
               v_desc=desc(bn, 128), cu_q_ptr="*i32", cu_k_ptr="*i32", o_ptr="*bf16", lse_ptr="*fp32",
               scale_log2="fp32", n_seq="i32", T="i32", H="i32", n_slots="i32", stride_qh="i32", stride_kh="i32",
               stride_vh="i32")
    consts = dict(DA=128, DB=64, DV=128, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, HEADS_FIRST=True, CHUNK=128)
    sig.update({name: "constexpr" for name in consts})
    fn = pt._prefill_tma_kernel
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
             if sig[p.name].startswith("*") or p.name.startswith("stride")}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


# SASS wgmma instructions by BLOCK_N, read off the sm_90 compile: S (12 k-steps of 16 at qk 192) and P V
# (BLOCK_N / 16), per 64-row warpgroup tile, in each of the two loops
EXPECTED_HGMMA = {128: 40, 64: 32}


@sm90_compile
@pytest.mark.parametrize("cfg", TMA_CONFIGS)
def test_sm90_compile_prefill_tma_resources(cfg):
    """The autotune configurations at qk 192 / v 128 compile for sm_90: no spills, at most 255 registers, shared
    memory within an SM's 227 KB, wgmma dots and TMA loads (no cp.async)."""
    from mla_compile.ops.triton._sm90 import resources

    bm, bn, warps, stages, _ = cfg
    compiled = _compile_sm90(bm, bn, warps, stages)
    res = resources(compiled)
    assert res["stack"] == 0 and res["LDL"] == 0 and res["STL"] == 0, res
    assert res["regs"] <= 255 and res["smem"] <= 227 * 1024, res
    assert res["HGMMA"] == EXPECTED_HGMMA[bn] and res["UTMALDG"] >= 5 and res["LDGSTS"] == 0, res
    assert "ttg.warp_specialize" not in compiled.asm["ttgir"]
    assert compiled.metadata.num_warps == warps


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton-tma", "gluon", "gluon-ws"])
def test_cuda_new_prefill_backends_compile_and_replay_in_a_cuda_graph(backend):
    """Each new backend is an opaque op: ``torch.compile(fullgraph=True)`` without graph breaks, and a captured
    call replays with new inputs copied in (descriptors are made on the host at capture, over fixed buffers)."""
    from torch._dynamo.utils import counters

    from mla_compile.ops import prefill

    if backend != "triton-tma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels need sm_90")
    lq, lk = [300, 0, 77], [500, 9, 77]
    q, k, v = _inputs(16, lq, lk, 192, 128, torch.bfloat16, 11)
    cu_q, cu_k = cu_from_lens(lq, "cuda"), cu_from_lens(lk, "cuda")
    counters.clear()
    fn = torch.compile(lambda *a: prefill(*a, SCALE, causal=True, backend=backend), fullgraph=True)
    out, lse = fn(q, k, v, cu_q, cu_k)
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, True)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)
    assert dict(counters["graph_break"]) == {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prefill(q, k, v, cu_q, cu_k, SCALE, causal=True, backend=backend)  # warm-up (compiles) outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = prefill(q, k, v, cu_q, cu_k, SCALE, causal=True, backend=backend)
    q2, k2, v2 = _inputs(16, lq, lk, 192, 128, torch.bfloat16, 12)
    q.copy_(q2), k.copy_(k2), v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, True)
    assert_attention_close(g_out, g_lse, ref, ref_lse, torch.bfloat16)
