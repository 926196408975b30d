"""The sm_90 Gluon sparse decode over the fp8 cache with 64 heads a program (``ops/triton/sparse_decode_gluon64.py``,
backend "gluon64" of ``mla::sparse_decode``).

On any machine with Triton: its sm_90 compile (shared memory within an SM's 227 KB, at most 255 registers, no spill
in the tile loop, the dots and one tile's 16-byte row loads there, no TMA copies), the compile of ``launch``'s own
recorded call, and its declaration (what the selector lets it serve; "auto" skips it before its GPU run). On an
sm_90 GPU: shapes against the float64 sparse decode of the dequantized cache (``mla::sparse_decode_ref`` in float64;
NaN-poisoned cache rows that no list names (0xFF bytes) and outputs, -1 padded lists from the lightning indexer in
any order, all-invalid rows, 16 / 40 / 128 heads, s_q 1 and 2, topk off the tile size, one split and many, int64
indices, pages of 64 and 1, every flag), opcheck, torch.compile and CUDA-graph replay through
``mla_compile.ops.sparse_decode(..., backend="gluon64")``."""

from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch
from torch.library import opcheck

import mla_compile  # noqa: F401
from mla_compile.ops import sparse_decode
from mla_compile.ops.registry import backends_for
from mla_compile.ops.select import select, why_not
from tests.cuda_capture import capture
from _sparse_test_util import float_paged, fp8_paged, lens_with_empty, topk_indices
from _triton_test_util import (assert_attention_close, check_tma_out, gluon_sm90, longest_load_run, poison_allocator,
                               record_gluon_launches, sm90_compile, sm90_facts)

HAS_TRITON = importlib.util.find_spec("triton") is not None
SCALE = 1 / math.sqrt(192)
DC, DR = 512, 64
BF = torch.bfloat16
# fp8 cache: each dequantized key / value rounds once to bf16 (2**-9 relative), as in fp8_decode_gluon64's tests;
# bf16 cache: exact keys and values, P rounded to bf16
TOLS = {"fp8": (1.5e-2, 2e-2), "bf16": (1e-2, 5e-3)}
TOL = TOLS["fp8"][0]


def _sm90() -> bool:
    return HAS_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU and triton")


def _inputs(B, H, s_q, max_len, topk, bs, seed, empty_row=True, kind="fp8"):
    """q, a NaN-poisoned cache (``kind`` "fp8": uint8 rows, 0xFF where unwritten; "bf16": NaN) and
    ``[B, s_q, topk]`` lists (-1 padded, any order; batch row 2, when there are three or more, all -1 where
    ``empty_row``)."""
    gen = torch.Generator().manual_seed(seed)
    lens = lens_with_empty(B, max_len, gen)
    if kind == "fp8":
        cache, table, seq_lens, _ = fp8_paged(lens, bs, DC, DR, "cuda", gen)
    else:
        cache, table, seq_lens = float_paged(lens, bs, DC + DR, BF, "cuda", gen)
    idx = topk_indices(table, seq_lens, bs, s_q, topk, gen)
    if empty_row and B > 2:
        idx[2] = -1
    q = torch.randn(B, s_q, H, DC + DR, generator=gen).to("cuda", BF)
    return q, cache, idx


def _reference(q, cache, idx, scale=SCALE):
    """float64 sparse decode of the (dequantized) cache; the rows no list names stay NaN-poisoned for the kernel
    (a float cache's NaN are zeroed for the reference only, as the Triton kernel's tests do)."""
    cache = cache if cache.dtype == torch.uint8 else cache.double().nan_to_num()
    return torch.ops.mla.sparse_decode_ref(q.double(), cache, idx, scale, DC)


def _check(q, cache, idx, config=None):
    from mla_compile.ops.triton import sparse_decode_gluon64 as g

    assert g.eligible(q, cache, idx, DC)
    poison_allocator()
    out, lse = g.launch(q, cache, idx, SCALE, DC, config=config)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, cache, idx)
    tol, lse_atol = TOLS["fp8" if cache.dtype == torch.uint8 else "bf16"]
    assert_attention_close(out, lse, ref, ref_lse, BF, tol=tol, lse_atol=lse_atol)
    return out, lse


_SHAPES = [  # B, H, s_q, max_len, topk, bs, SPLITS (None: the plan's)
    (6, 16, 1, 5000, 2048, 64, None),     # an empty sequence, short lists padded with -1, many splits
    (6, 16, 1, 5000, 2048, 64, 1),        # one split: the result written directly
    (6, 16, 1, 5000, 2048, 64, 3),        # three splits merged by the reduce kernel
    (5, 128, 1, 4000, 2048, 64, None),    # 128 heads: two 64-head programs a query
    (4, 128, 1, 3000, 2048, 64, 1),
    (150, 16, 1, 2500, 2048, 64, None),   # more programs than SMs: one split
    (140, 128, 1, 700, 512, 64, None),    # 128 heads, full waves
    (5, 16, 2, 3000, 2048, 64, None),     # MTP: two queries, each its own list
    (3, 128, 2, 2000, 1000, 64, None),    # MTP with 128 heads, topk off the tile size
    (4, 40, 2, 900, 300, 64, 2),          # 40 heads: a partial program
    (5, 16, 1, 1500, 2048, 1, None),      # pages of one row
    (4, 64, 1, 100, 96, 128, None),       # lists shorter than two tiles, pages of 128
]


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("B,H,s_q,max_len,topk,bs,splits", _SHAPES)
def test_gluon64_sparse_decode_shapes(B, H, s_q, max_len, topk, bs, splits, kind):
    q, cache, idx = _inputs(B, H, s_q, max_len, topk, bs, seed=B + H + topk + bs, kind=kind)
    out, lse = _check(q, cache, idx, None if splits is None else {"SPLITS": splits})
    if B > 2:
        assert torch.isinf(lse[2]).all() and (out[2] == 0).all()


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("config", [{"RESCALE_SKIP": False, "MAX_XCHG": False}, {"RESCALE_SKIP": False},
                                    {"MAX_XCHG": False}, {"CVT_BF16": True}, {"ROPE_ASYNC": True},
                                    {"ROPE_ASYNC": True, "CVT_BF16": True},
                                    {"RESCALE_SKIP": False, "MAX_XCHG": False, "CVT_BF16": True},
                                    {"FOLD_SCALE": False}, {"FOLD_SCALE": True, "RESCALE_SKIP": False,
                                                            "MAX_XCHG": False},
                                    {"TMA_OUT": True, "SPLITS": 1}])
def test_gluon64_sparse_decode_flags(config, kind):
    """Each flag away from its default (``CVT_BF16``: the fp8 cache's bf16x2 dequantization; ``ROPE_ASYNC`` on: the
    fp8 rope by ``cp.async``; a bf16 cache ignores both; ``TMA_OUT`` in one split: the rows by TMA)."""
    q, cache, idx = _inputs(6, 128, 1, 5000, 2048, 64, seed=11, kind=kind)
    _check(q, cache, idx, config)


@pytest.mark.cuda
@needs_sm90
def test_gluon64_sparse_decode_int64_indices_all_invalid_and_growing_scores():
    """int64 lists; a batch whose every list is -1 (LSE -inf, output 0 everywhere); a query whose scores grow
    along its list (the running maxima raised tile after tile) at a larger softmax scale."""
    from mla_compile.ops.triton import sparse_decode_gluon64 as g

    q, cache, idx = _inputs(5, 16, 1, 4000, 2048, 64, seed=12)
    _check(q, cache, idx.long())
    poison_allocator()
    out, lse = g.launch(q, cache, torch.full_like(idx, -1), SCALE, DC)
    torch.cuda.synchronize()
    assert torch.isinf(lse).all() and (lse < 0).all() and (out == 0).all()
    # growing scores: q along the first written row's dequantized latent, the list sorted by score
    from mla_compile.ops.fp8_cache import dequantize_fp8_rows

    slots = idx[0, 0][idx[0, 0] >= 0].long()
    lat, _ = dequantize_fp8_rows(cache.reshape(-1, cache.shape[-1])[slots], DC)
    q0 = torch.zeros_like(q[:1])
    q0[..., :DC] = (lat[0].float() * 0.5).to(BF)
    score = lat.float() @ q0[0, 0, 0, :DC].float()
    order = torch.argsort(score)
    grow = torch.full_like(idx[:1], -1)
    grow[0, 0, :slots.numel()] = slots[order].int()
    out, lse = g.launch(q0, cache, grow, 1.0, DC)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q0, cache, grow, 1.0)
    assert_attention_close(out, lse, ref, ref_lse, BF, tol=TOL, lse_atol=0.5)


@pytest.mark.cuda
@needs_sm90
def test_the_backend_runs_the_kernel_and_falls_back_elsewhere():
    """Backend "gluon64" is the kernel bit for bit; a strided cache (pages inside a larger buffer) gives the same
    bits; float16 queries run ``mla::sparse_decode_triton``."""
    from mla_compile.ops.triton import sparse_decode_gluon64 as g

    q, cache, idx = _inputs(3, 128, 1, 3000, 2048, 64, seed=5)
    got = sparse_decode(q, cache, idx, SCALE, backend="gluon64")
    want = g.launch(q, cache, idx, SCALE, DC)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    wide = torch.full((cache.shape[0], 128, cache.shape[2]), 0xFF, dtype=torch.uint8, device="cuda")
    wide[:, :64] = cache
    strided = wide[:, :64]
    assert g.eligible(q, strided, idx, DC)
    got = torch.ops.mla.sparse_decode_gluon64(q, strided, idx, SCALE, DC)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    q16 = q.half()
    assert not g.eligible(q16, cache, idx, DC)
    got = torch.ops.mla.sparse_decode_gluon64(q16, cache, idx, SCALE, DC)
    want = torch.ops.mla.sparse_decode_triton(q16, cache, idx, SCALE, DC)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_gluon64_sparse_decode_opcheck(kind):
    import mla_compile.ops.triton.sparse_decode_gluon64  # noqa: F401

    q, cache, idx = _inputs(3, 16, 2, 300, 128, 64, seed=1, kind=kind)
    opcheck(torch.ops.mla.sparse_decode_gluon64.default, (q, cache, idx, SCALE, DC))


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("H,s_q,kind", [(16, 2, "fp8"), (128, 1, "fp8"), (16, 2, "bf16")])
def test_compiled_and_graph_replay_through_the_op(H, s_q, kind):
    """``sparse_decode(..., backend="gluon64")`` under torch.compile(fullgraph) and captured in a CUDA graph:
    replays take new lists (an all -1 row included) and queries (nothing read on the host)."""
    B, topk = 12, 512
    gen = torch.Generator().manual_seed(8)
    if kind == "fp8":
        cache, table, seq_lens, _ = fp8_paged([3000] * B, 64, DC, DR, "cuda", gen)
    else:
        cache, table, seq_lens = float_paged([3000] * B, 64, DC + DR, BF, "cuda", gen)
    tol, lse_atol = TOLS[kind]
    torch._dynamo.reset()
    step = torch.compile(lambda q, i: sparse_decode(q, cache, i, SCALE, backend="gluon64"), fullgraph=True)
    st = {"q": torch.zeros(B, s_q, H, DC + DR, device="cuda", dtype=BF),
          "idx": torch.full((B, s_q, topk), -1, device="cuda", dtype=torch.int32)}
    out, lse = step(st["q"], st["idx"])
    assert torch.isinf(lse).all() and (out == 0).all()
    graph, (out, lse) = capture(lambda: step(st["q"], st["idx"]))
    for _ in range(3):
        new_lens = torch.tensor(lens_with_empty(B, 3000, gen), dtype=torch.int32, device="cuda")
        idx = topk_indices(table, new_lens, 64, s_q, topk, gen)
        idx[3] = -1
        st["idx"].copy_(idx)
        st["q"].copy_(torch.randn(B, s_q, H, DC + DR, generator=gen).to("cuda", BF))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = _reference(st["q"], cache, st["idx"])
        assert_attention_close(out, lse, ref, ref_lse, BF, tol=tol, lse_atol=lse_atol)
        assert torch.isinf(lse[3]).all() and (out[3] == 0).all()


def test_an_unknown_config_key_is_refused_before_any_launch():
    from mla_compile.ops.triton import sparse_decode_gluon64 as g

    q = torch.randn(1, 1, 16, 576)
    with pytest.raises(ValueError, match=r"unknown config keys \['SPLIT_DEQUANT'\]"):
        g.launch(q, torch.randn(1, 64, 576), torch.zeros(1, 1, 8, dtype=torch.int32), 1.0, 512,
                 config={"SPLIT_DEQUANT": True})


def test_declaration_serves_only_sm90_bf16_q_fp8_or_bf16_deepseek_rows():
    """What the selector lets backend "gluon64" serve (no GPU needed: facts given), and that "auto" takes it where
    the shipped H200 table (BENCHMARKS run 132) has it fastest: the fp8 cache at 16 heads, the bf16 cache at 16
    and 128 heads (at 128 heads FlashMLA's fp8 sparse kernel is faster where it is installed)."""
    spec = backends_for("sparse_decode")["gluon64"]
    assert spec.gpu_tested

    facts = sm90_facts

    if HAS_TRITON:
        assert why_not(spec, facts()) is None
        assert why_not(spec, facts(block_size=1, query_len=2, num_heads=16)) is None
        assert why_not(spec, facts(packed_rows=False)) is None  # plain loads: pages inside a larger buffer too
        assert why_not(spec, facts(cache_dtype=BF)) is None
    for bad in (dict(cap=(10, 0)), dict(cap=(8, 9)), dict(dtype=torch.float16), dict(cache_dtype=torch.float16),
                dict(head_dims=(512, 32)), dict(cache_align=8)):
        assert why_not(spec, facts(**bad)) is not None, bad
    if HAS_TRITON:
        assert select("sparse_decode", facts(num_heads=16)).name == "gluon64"
        assert select("sparse_decode", facts(cache_dtype=BF, packed_rows=False)).name == "gluon64"
        assert select("sparse_decode", facts(cache_dtype=BF, num_heads=16)).name == "gluon64"


def _compile_sm90(consts, idx_type="*i32"):
    """The sm_90 compile of the kernel, its pointers, the q strides and the cache strides 16-byte divisible as
    the JIT specializes them for a real launch (``consts``: every constexpr, the flags included)."""
    from mla_compile.ops.triton import sparse_decode_gluon64 as g

    types = dict(q_ptr="*bf16", kv_ptr="*u8" if consts["FP8"] else "*bf16", idx_ptr=idx_type, lse_ptr="*fp32",
                 o_ptr="*bf16" if consts["DIRECT"] else "*fp32", scale_log2="fp32")
    if consts.get("TMA_OUT"):
        from mla_compile.ops.triton._bf16_tma import BOX_SL

        types["desc_o"] = f"tensordesc<bf16[8, 64, 64],{BOX_SL!r}>"
    return gluon_sm90(g.sparse_decode_gluon64_kernel, consts, g.NUM_WARPS, types, ("stride_q", "stride_k"))


@sm90_compile
def test_sm90_compile_tma_out():
    """The kernel with ``TMA_OUT`` (one split, an fp8 cache, its default flags): the output rows by one TMA copy
    (``check_tma_out``)."""
    from mla_compile.ops.triton import sparse_decode_gluon64 as g

    base = dict(DC=512, DR=64, BLOCK_SIZE=64, DIRECT=True, FP8=True, **g.DEFAULTS)
    check_tma_out(_compile_sm90(base), _compile_sm90(dict(base, TMA_OUT=True)))


_FP8_ONLY = ("CVT_BF16", "ROPE_ASYNC")  # flags a bf16 cache ignores: its compile with them is the plain one


@sm90_compile
@pytest.mark.parametrize("flags,direct,block_size,idx_type,fp8", [
    pytest.param(flags, direct, bs, idx, fp8, id=f"{'fp8' if fp8 else 'bf16'}-{flags}-{direct}-{bs}-{idx}")
    for flags, direct, bs, idx in [
        ({}, False, 64, "*i32"), ({}, True, 64, "*i32"), ({}, False, 1, "*i64"), ({}, True, 128, "*i64"),
        ({"RESCALE_SKIP": False, "MAX_XCHG": False}, False, 64, "*i32"), ({"CVT_BF16": True}, False, 64, "*i32"),
        ({"CVT_BF16": True}, True, 1, "*i64"), ({"ROPE_ASYNC": True}, False, 64, "*i32"),
        ({"ROPE_ASYNC": True, "CVT_BF16": True}, True, 64, "*i32"), ({"FOLD_SCALE": False}, False, 64, "*i32")]
    for fp8 in (True, False) if fp8 or not set(flags) <= set(_FP8_ONLY) or not flags])
def test_sm90_compile_resources(flags, direct, block_size, idx_type, fp8):
    """The kernel compiles for sm_90 with 8 warps, at most 255 registers a thread, no spill inside the tile loop (at
    most one 8-byte slot outside it: the bf16 kernel without its flags keeps one there), shared memory of its
    buffers' formula plus under 1 KB of scratch and within an SM's 227 KB; the dots
    (S twice: the first tile and the loop, 36 k-steps each; P V, 4) are there, no TMA copies, and the tile loop
    holds its S and P V dots, one tile's 16-byte row loads (fp8: eight of codes, one of scales, two of rope into
    registers; bf16: sixteen of latent and two of rope ``cp.async`` copies, no register loads of rows), the L2
    prefetches and at most five CTA barriers (three with the row maxima exchanged across warpgroups; one more
    for bf16, after the copies' wait; two more with fp8 ``ROPE_ASYNC``: the rope's two ``cp.async`` copies
    replace its register loads, and Triton's barrier pass adds one after their wait and one before them)."""
    _check_resources(flags, direct, block_size, idx_type, fp8)


def _check_resources(flags, direct, block_size, idx_type, fp8):
    from mla_compile.ops.triton import sparse_decode_gluon64 as g
    from mla_compile.ops.triton._sm90 import resources
    from test_gluon_fp8_decode64 import _loop_sass

    flags = {k: flags.get(k, g.DEFAULTS[k]) for k in g.VARIANTS}
    compiled = _compile_sm90(dict(DC=DC, DR=DR, BLOCK_SIZE=block_size, DIRECT=direct, FP8=fp8, **flags), idx_type)
    assert compiled.metadata.num_warps == 8
    # the query rows' latent and rope parts loaded in one round trip (16 bytes a load, every thread's share)
    assert longest_load_run(compiled.asm["ptx"]) >= 64 * (DC + DR) * 2 // 16 // (32 * 8)
    shared = compiled.metadata.shared
    assert g.smem_bytes() <= shared < g.smem_bytes() + 1024
    assert shared <= 227 * 1024
    res = resources(compiled)
    assert res["stack"] <= 8, res  # one 8-byte slot at most, outside the loop (ptxas parks an epilogue value there)
    assert res["regs"] <= 255, res
    assert res["HGMMA"] == 2 * (DC + DR) // 16 + 64 // 16, res
    assert res["UTMALDG"] == 0, res
    loop = _loop_sass(compiled)
    if fp8 and not flags["ROPE_ASYNC"]:
        assert loop.count("LDG.E.128") == 8 + 1 + 2, loop.count("LDG.E.128")  # codes, scales, rope
        assert "LDGSTS" not in loop
    elif fp8:  # the rope by cp.async
        assert loop.count("LDG.E.128") == 8 + 1, loop.count("LDG.E.128")  # codes, scales
        assert loop.count("LDGSTS.E.BYPASS.128") == 2, loop.count("LDGSTS.E.BYPASS.128")
    else:
        assert loop.count("LDGSTS.E.BYPASS.128") == 16 + 2, loop.count("LDGSTS.E.BYPASS.128")  # latent, rope
        assert "LDG.E.128" not in loop
    assert "UBLKPF.L2" in loop
    assert "STL" not in loop and "LDL" not in loop, "a spill inside the tile loop"
    assert loop.count("HGMMA") == (DC + DR) // 16 + 64 // 16
    # Triton's barrier pass adds one after the copies' wait (bf16, fp8 ROPE_ASYNC) and one before the rope copies
    extra = (2 if flags["ROPE_ASYNC"] else 0) if fp8 else 1
    assert loop.count("BAR.SYNC") <= (3 if flags["MAX_XCHG"] else 5) + extra, loop.count("BAR.SYNC")
    if fp8 and flags["CVT_BF16"]:  # bf16x2 dequantization: no fp32 products
        assert loop.count("HFMA2.BF16") == 64 and loop.count("PRMT") >= 64, loop.count("HFMA2.BF16")
    if flags["FOLD_SCALE"]:  # the exponent's argument as one FMA an element: 16 a thread a tile, 16 others
        assert len(re.findall(r"\bFFMA\b", loop)) >= 32, loop.count("FFMA")


@sm90_compile
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_sm90_compile_of_the_launch(monkeypatch, splits, kind):
    """``launch``'s own call (recorded on CPU tensors: 128 heads, MTP, pages of 64 inside a larger buffer) binds
    every kernel argument and compiles for sm_90 with the launch's constexprs and warps; with several splits it
    writes the fp32 workspaces and the reduce kernel merges them; the flags take ``DEFAULTS``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_compile.ops.triton import sparse_decode_gluon64 as g
    from mla_compile.ops.triton._sm90 import signature

    launches = record_gluon_launches(monkeypatch, g, "sparse_decode_gluon64_kernel")
    gen = torch.Generator().manual_seed(2)
    if kind == "fp8":
        cache = fp8_paged([300, 0, 129], 64, DC, DR, "cpu", gen)[0]
    else:
        cache = float_paged([300, 0, 129], 64, DC + DR, BF, "cpu", gen)[0]
    wide = torch.zeros(cache.shape[0], 128, cache.shape[2], dtype=cache.dtype)
    wide[:, :64] = cache
    q = torch.randn(3, 2, 128, DC + DR, generator=gen).to(BF)
    idx = torch.randint(-1, 64 * cache.shape[0], (3, 2, 256), generator=gen, dtype=torch.int32)
    out, lse = g.launch(q, wide[:, :64], idx, SCALE, DC, config={"SPLITS": splits})
    assert out.shape == (3, 2, 128, DC) and lse.shape == (3, 2, 128)
    kernel, grid, args, kwargs = launches[0]
    assert grid == (2, splits, 6)
    assert len(launches) == (1 if splits == 1 else 2)
    assert kwargs["DIRECT"] == (splits == 1) and kwargs["BLOCK_SIZE"] == 64 and kwargs["FP8"] == (kind == "fp8")
    assert {k: kwargs[k] for k in g.VARIANTS} == g.DEFAULTS
    assert args[3].dtype == (BF if splits == 1 else torch.float32)
    sig, consts, attrs = signature(kernel, args, kwargs)
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=kwargs["num_warps"]))
    assert compiled.metadata.num_warps == 8 and compiled.metadata.shared <= 227 * 1024
