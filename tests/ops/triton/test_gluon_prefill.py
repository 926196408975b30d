"""The sm_90 Gluon prefill kernels (``ops/triton/prefill_gluon.py``, backends "gluon" and "gluon-ws" of
``mla::prefill``): on an sm_90 GPU against a float64 per-sequence reference (NaN-poisoned outputs and padding
rows, empty sequences, more keys than queries, strided k/v views, each tile configuration); on any machine
their sm_90 compile (no spills, shared memory of the formula within an SM's 227 KB, the dots and TMA copies)."""

from __future__ import annotations

import math

import pytest
import torch

import mla_compile  # noqa: F401
from _triton_test_util import (assert_attention_close, cu_from_lens, gluon_sm90, poison_allocator, prefill_ref64,
                               record_gluon_launches, sm90_compile)

SCALE = 1 / math.sqrt(192)
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
LENS_Q = [1, 0, 300, 128, 1000, 0, 2500, 77]
LENS_K = [1, 0, 300, 1000, 1000, 9, 4096, 1077]  # empty sequences (one with keys), more keys than queries
_UNPIPED = dict(WS=True, KV_SPLIT=False, PIPE=False)  # the warp-specialized kernel without its two defaults
CONFIGS = {"plain_n64": dict(BLOCK_N=64), "plain_n128": dict(BLOCK_N=128), "ws_n128_s2": dict(WS=True),
           "ws_n64_s3": dict(WS=True, BLOCK_N=64, STAGES=3), "ws_n64_s2": dict(WS=True, BLOCK_N=64),
           "plain_heads_last": dict(HEADS_FIRST=False), "ws_heads_last": dict(WS=True, HEADS_FIRST=False),
           "ws_unpiped": _UNPIPED, "ws_unpiped_n64_s3": dict(_UNPIPED, BLOCK_N=64, STAGES=3),
           "ws_kv_split_only": dict(WS=True, PIPE=False), "ws_pipe_only": dict(WS=True, KV_SPLIT=False),
           "ws_unfolded": dict(WS=True, FOLD_SCALE=False), "plain_unfolded": dict(FOLD_SCALE=False),
           "ws_pingpong": dict(WS=True, PINGPONG=True), "ws_pingpong_unpiped": dict(_UNPIPED, PINGPONG=True),
           "ws_pingpong_kv_split_only": dict(WS=True, PIPE=False, PINGPONG=True),
           "ws_pingpong_pipe_only": dict(WS=True, KV_SPLIT=False, PINGPONG=True),
           "ws_pingpong_n64_s3": dict(WS=True, BLOCK_N=64, STAGES=3, PINGPONG=True),
           "ws_pingpong_unpiped_n64": dict(_UNPIPED, BLOCK_N=64, PINGPONG=True),
           "ws_persist": dict(WS=True, PERSIST=True), "ws_persist_unpiped": dict(_UNPIPED, PERSIST=True),
           "ws_persist_n64_s3": dict(WS=True, BLOCK_N=64, STAGES=3, PERSIST=True),
           "ws_persist_heads_last": dict(WS=True, HEADS_FIRST=False, PERSIST=True),
           # the output's TMA store off (on by default, per program and persistent)
           "ws_plain_out": dict(WS=True, TMA_OUT=False),
           "ws_persist_plain_out": dict(WS=True, PERSIST=True, TMA_OUT=False)}
PERSIST = [c for c in CONFIGS if "persist" in c]
PINGPONG = [c for c in CONFIGS if "pingpong" in c]
# Sequences whose two consumer warpgroups (64 query rows each of a 128-row block) see different tile counts at
# BLOCK_N 64 / 128: 100 and 65 (causal: 1 tile for rows 0-63, 2 for rows 64-99 at 64-key tiles), 64 and 1
# (one block, rows 64-127 padding), 129 and 513 / 700 (a second block of 1 or a few rows, more keys than queries).
# A sequence of keys alone (0 / 7), and past the op's causal contract (more queries than keys; the kernels'
# causal offset is then negative): 200 / 100 (rows 0-63 see no key, rows 64-127 a tile) and 300 / 150 (a block
# whose rows see no key: no tile for either consumer).
LENS_PP_Q = [100, 65, 64, 1, 129, 0, 513, 200, 300]
LENS_PP_K = [100, 65, 64, 1, 129, 7, 700, 100, 150]
LENS_PP_Q_NONCAUSAL = LENS_PP_Q + [40]
LENS_PP_K_NONCAUSAL = LENS_PP_K + [0]  # 40 queries and no key: no tile for either consumer, out 0, LSE -inf


def _inputs(H, lens_q, lens_k, dtype, seed, pad=5):
    gen = torch.Generator().manual_seed(seed)
    T, S = sum(lens_q) + pad, sum(lens_k) + 3
    q = torch.randn(T, H, 192, generator=gen).to(dtype)
    k = torch.randn(S, H, 192, generator=gen).to(dtype)
    v = torch.randn(S, H, 128, generator=gen).to(dtype)
    q[sum(lens_q):], k[sum(lens_k):], v[sum(lens_k):] = math.nan, math.nan, math.nan  # padding: never read
    return q.cuda(), k.cuda(), v.cuda()


@pytest.mark.parametrize("H,NS,L,sms,want", [(16, 2, 1024, 132, True), (128, 2, 1024, 132, False),
                                              (16, 8, 4096, 132, False), (16, 2, 1024, 16, False)])
def test_default_grid_order(H, NS, L, sms, want):
    """The default grid order: heads-fastest for grids of at most HEADS_FIRST_WAVES waves (2 x 1024 tokens at 16
    heads on 132 SMs: 288 programs), query blocks fastest above (at 128 heads, 8 x 4096 tokens, or few SMs)."""
    from mla_compile.ops.triton import prefill_gluon as g

    programs = H * (NS * L // g.BLOCK_M + NS)
    assert g.heads_first(programs, sms) is want


def test_launch_refuses_unknown_config_keys():
    """A config key the kernels do not have (a removed or misspelt flag) is an error before any launch, not a
    silently ignored entry of a sweep."""
    from mla_compile.ops.triton import prefill_gluon as g

    q = torch.randn(4, 2, 192, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"unknown config keys \['PIPELINE'\]"):
        g.launch(q, q, q[..., :128], cu, cu, SCALE, True, config={"WS": True, "PIPELINE": True})
    assert all(set(c) <= g.CONFIG_KEYS for c in CONFIGS.values())


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_cuda_gluon_prefill_configs(causal, cfg):
    from mla_compile.ops.triton import prefill_gluon as g

    q, k, v = _inputs(16, LENS_Q, LENS_K, torch.bfloat16, int(causal))
    cu_q, cu_k = cu_from_lens(LENS_Q, "cuda"), cu_from_lens(LENS_K, "cuda")
    c = CONFIGS[cfg]
    assert g.eligible(q, k, v, c.get("BLOCK_N", 128 if c.get("WS") else 64), c.get("WS", False), c.get("STAGES", 2))
    poison_allocator()
    out, lse = g.launch(q, k, v, cu_q, cu_k, SCALE, causal, c)
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, causal)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("ws", [False, True])
def test_cuda_gluon_prefill_negative_scale_scales_first(ws):
    """A negative softmax scale (the row maximum of the scaled scores is not the scaled maximum): the launch
    does not fold the scale into the exponent, and the result is the float64 reference's."""
    from mla_compile.ops.triton import prefill_gluon as g

    q, k, v = _inputs(16, LENS_Q, LENS_K, torch.bfloat16, 5)
    cu_q, cu_k = cu_from_lens(LENS_Q, "cuda"), cu_from_lens(LENS_K, "cuda")
    poison_allocator()
    out, lse = g.launch(q, k, v, cu_q, cu_k, -SCALE, True, {"WS": ws})
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, -SCALE, True)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("backend", ["gluon", "gluon-ws"])
def test_cuda_gluon_prefill_backends(backend):
    from mla_compile.ops import prefill

    for H, lq, lk, dtype, seed in ((128, [1024, 513], [1024, 2000], torch.bfloat16, 3),
                                   (4, [100, 37], [150, 37], torch.float16, 4)):
        q, k, v = _inputs(H, lq, lk, dtype, seed)
        cu_q, cu_k = cu_from_lens(lq, "cuda"), cu_from_lens(lk, "cuda")
        poison_allocator()
        out, lse = prefill(q, k, v, cu_q, cu_k, SCALE, causal=True, backend=backend)
        ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, True)
        assert_attention_close(out, lse, ref, ref_lse, dtype)
    # k and v as column slices of one projection output (head stride 384, not the head dim)
    gen = torch.Generator().manual_seed(9)
    lq, lk = [300, 45], [700, 45]
    cu_q, cu_k = cu_from_lens(lq, "cuda"), cu_from_lens(lk, "cuda")
    kv = torch.randn(sum(lk), 8, 384, generator=gen).bfloat16().cuda()
    k, v = kv[..., :192], kv[..., 192:320]
    q = torch.randn(sum(lq), 8, 192, generator=gen).bfloat16().cuda()
    poison_allocator()
    out, lse = prefill(q, k, v, cu_q, cu_k, SCALE, causal=True, backend=backend)
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, True)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)
    # qk 128 (no second tile) is not eligible: the op runs the TMA/pointer Triton dispatch
    q2, k2 = q[..., :128].contiguous(), k[..., :128].contiguous()
    out, lse = prefill(q2, k2, v, cu_q, cu_k, SCALE, causal=True, backend=backend)
    ref, ref_lse = prefill_ref64(q2, k2, v, cu_q, cu_k, SCALE, True)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cfg", PINGPONG + PERSIST + ["ws_n128_s2", "ws_n64_s2", "ws_unpiped"])
def test_cuda_gluon_prefill_uneven_consumers(causal, cfg):
    """The warp-specialized kernel where its two consumers see different numbers of key tiles (or none): with
    ``PINGPONG`` each takes its own count of turns, and neither waits for a hand-over the other never makes (a
    deadlock hangs in the synchronize: run with pytest's ``--timeout``). Without ``PINGPONG`` the same lengths as
    a baseline."""
    from mla_compile.ops.triton import prefill_gluon as g

    lens_q = LENS_PP_Q if causal else LENS_PP_Q_NONCAUSAL
    lens_k = LENS_PP_K if causal else LENS_PP_K_NONCAUSAL
    q, k, v = _inputs(8, lens_q, lens_k, torch.bfloat16, 11 + int(causal))
    cu_q, cu_k = cu_from_lens(lens_q, "cuda"), cu_from_lens(lens_k, "cuda")
    poison_allocator()
    out, lse = g.launch(q, k, v, cu_q, cu_k, SCALE, causal, CONFIGS[cfg])
    torch.cuda.synchronize()
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, causal)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16)


def test_launch_refuses_pingpong_without_two_slots():
    """``PINGPONG`` needs the warp-specialized kernel and a ring of at least two slots (with one, a turn's S would
    wait for the slot the other consumer frees only in its next turn): an error before any launch."""
    from mla_compile.ops.triton import prefill_gluon as g

    q = torch.randn(4, 2, 192, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for cfg in (dict(WS=True, STAGES=1, PINGPONG=True), dict(PINGPONG=True)):
        with pytest.raises(ValueError, match="PINGPONG needs WS=True and STAGES >= 2"):
            g.launch(q, q, q[..., :128], cu, cu, SCALE, True, config=cfg)


def test_launch_refuses_persist_without_ws_or_with_pingpong():
    """``PERSIST`` needs the warp-specialized kernel and no ``PINGPONG`` (whose turns count from 0 in each work
    item): an error before any launch."""
    from mla_compile.ops.triton import prefill_gluon as g

    q = torch.randn(4, 2, 192, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for cfg in (dict(PERSIST=True), dict(WS=True, PINGPONG=True, PERSIST=True)):
        with pytest.raises(ValueError, match="PERSIST needs WS=True and no PINGPONG"):
            g.launch(q, q, q[..., :128], cu, cu, SCALE, True, config=cfg)


@sm90_compile
@pytest.mark.parametrize("H,sms", [(16, 132), (1, 132)])
def test_sm90_compile_of_the_persistent_launch(monkeypatch, H, sms):
    """``launch(..., {"WS": True, "PERSIST": True})`` on CPU tensors (recorded, not run): one axis of
    ``min(H * n_slots, SMs)`` programs (fewer work items than SMs: one program an item), ``PERSIST`` on, the work
    items' counter a fresh int32 zero, every argument bound; the call compiles for sm_90 with 12 warps within 227
    KB, its producer taking each item with one atomic add, each consumer storing its rows with one TMA copy where
    the config asks for ``TMA_OUT`` (the output's descriptor bound; on by default, with ``PERSIST`` too).
    Without ``PERSIST`` the counter argument is only a placeholder (``cu_seqlens_q``, never read)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_compile.ops.triton import prefill_gluon as g
    from mla_compile.ops.triton._sm90 import signature

    launches = record_gluon_launches(monkeypatch, g, "prefill_gluon_ws_kernel")
    monkeypatch.setattr(g, "num_sms", lambda device: sms)
    lens = [300, 0, 129]
    T = sum(lens)
    q, k = torch.randn(T, H, 192, dtype=torch.bfloat16), torch.randn(T, H, 192, dtype=torch.bfloat16)
    v = torch.randn(T, H, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 300, T], dtype=torch.int32)
    g.launch(q, k, v, cu, cu, SCALE, True, config={"WS": True, "PERSIST": True, "TMA_OUT": True})
    kernel, grid, args, kwargs = launches[0]
    n_slots = -(-T // g.BLOCK_M) + 3
    assert grid == (min(H * n_slots, sms),) and kwargs["PERSIST"] is True and kwargs["PINGPONG"] is False
    counter = kwargs["counter_ptr"]
    assert counter.dtype == torch.int32 and counter.shape == (1,) and int(counter[0]) == 0
    # the output by TMA (values as wide as the query's first part): a [64, 128] box over out as [T, H * 128]
    o_desc = kwargs["o_desc"]
    assert kwargs["TMA_OUT"] is True and list(o_desc.block_shape) == [64, 128] and list(o_desc.shape) == [T, H * 128]
    sig, consts, attrs = signature(kernel, args, kwargs)  # (the descriptors typed from their tensors and boxes)
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=kwargs["num_warps"]))
    assert compiled.metadata.num_warps == 12 and compiled.metadata.shared <= 227 * 1024
    assert compiled.asm["ptx"].count("atom.global.gpu.acq_rel.add.u32") == 2  # the first item, then each next one
    assert compiled.asm["ptx"].count("cp.async.bulk.tensor.2d.global.shared") == 2  # a consumer's rows, one copy
    g.launch(q, k, v, cu, cu, SCALE, True, config={"WS": True})
    assert launches[1][1] != grid and launches[1][3]["counter_ptr"] is cu
    assert launches[1][3]["TMA_OUT"] is True  # the output goes by TMA by default, per program and persistent
    g.launch(q, k, v, cu, cu, SCALE, True, config={"WS": True, "PERSIST": True})
    assert launches[2][3]["TMA_OUT"] is True and launches[2][3]["o_desc"] is not None
    g.launch(q, k, v, cu, cu, SCALE, True, config={"WS": True, "PERSIST": True, "TMA_OUT": False})
    assert launches[3][3]["TMA_OUT"] is False and launches[3][3]["o_desc"] is None


def _compile_sm90(kernel, consts, q_rows, warps):
    from mla_compile.ops.triton import prefill_gluon as g

    bn, sl = consts["BLOCK_N"], repr(g.SMEM_SL)

    def desc(r, c):
        return f"tensordesc<bf16[{r}, {c}],{sl}>"

    types = dict(qa_desc=desc(q_rows, 128), qb_desc=desc(q_rows, 64), ka_desc=desc(bn, 128), kb_desc=desc(bn, 64),
                 v_desc=desc(bn, 128), cu_q_ptr="*i32", cu_k_ptr="*i32", o_ptr="*bf16", lse_ptr="*fp32",
                 scale_log2="fp32", counter_ptr="*i32", o_desc=desc(64, 128))
    if not consts.get("TMA_OUT", True):
        consts = dict(consts, o_desc=None)  # None: a constexpr, as the JIT binds it
    return gluon_sm90(kernel, consts, warps, types, ("stride",))


@sm90_compile
@pytest.mark.parametrize("cfg", [c for c in CONFIGS if "heads_last" not in c])  # grid order: index math alone
def test_sm90_compile_gluon_prefill_resources(cfg):
    """Each configuration compiles for sm_90 at qk 192 / v 128: no spills, at most 255 registers; shared memory
    of its formula plus under 1 KB (the warp-specialized partitions' captured arguments), within 227 KB; the
    dots (per 128 rows: S in 12 k-steps of 16, P V in BLOCK_N / 16) and the TMA copies (Q's two or four, three a
    tile: the issue points of the prologue and the loop, or the producer's one); warp-specialized: 12 warps; the
    warp-specialized kernel (``TMA_OUT``, the launch's default) also stores by TMA, each consumer its 64 rows (with
    plain stores beside, for a block that ends past its sequence)."""
    from mla_compile.ops.triton import prefill_gluon as g
    from mla_compile.ops.triton._sm90 import resources

    c = CONFIGS[cfg]
    ws, bn, stages = c.get("WS", False), c.get("BLOCK_N", 128 if c.get("WS") else 64), c.get("STAGES", 2)
    kv, pingpong, persist = c.get("KV_SPLIT", ws), c.get("PINGPONG", False), c.get("PERSIST", False)
    consts = dict(DA=128, DB=64, DV=128, BLOCK_N=bn, CAUSAL=True, CHUNK=128 if ws else 256,
                  HEADS_FIRST=c.get("HEADS_FIRST", True), FOLD=c.get("FOLD_SCALE", True))
    if ws:
        compiled = _compile_sm90(g.prefill_gluon_ws_kernel, dict(consts, STAGES=stages, KV_SPLIT=kv,
                                 PIPE=c.get("PIPE", ws), PINGPONG=pingpong, PERSIST=persist, TMA_OUT=True),
                                 64, g.WS_WARPS)
    else:
        compiled = _compile_sm90(g.prefill_gluon_kernel, consts, 128, g.NUM_WARPS)
    assert compiled.metadata.num_warps == (12 if ws else 8)
    shared = compiled.metadata.shared
    formula = g.smem_bytes(192, 128, bn, ws, stages, kv, pingpong, persist)
    assert formula <= shared < formula + 1024 and shared <= 227 * 1024, (shared, formula)
    res = resources(compiled)
    assert res["stack"] == 0 and res["LDL"] == 0 and res["STL"] == 0, res
    assert res["regs"] <= 255, res
    dots = 12 + bn // 16  # PIPE: each consumer's dots in its loop and again in its prologue / epilogue
    assert res["HGMMA"] == ((4 if c.get("PIPE", ws) else 2) * dots if ws else dots), res
    # (the persistent producer with the TMA store: a tile's copies at two issue points, the item's first tiles
    # before the query rows' release and the rest after)
    assert res["UTMALDG"] == ((4 + 3 * (2 if persist else 1)) if ws else 2 + 3 * 3), res
    tma_out = ws
    stores = compiled.asm["ptx"].count("cp.async.bulk.tensor.2d.global.shared")
    assert (stores > 0) if tma_out else (stores == 0), stores
