"""The alternating ("seesaw") sm_90 Gluon bf16 decode (``ops/triton/decode_gluon_seesaw.py``) on any machine with
Triton: its sm_90 compile (two 4-warp partitions, registers, spills, shared memory within an SM's 227 KB, the
dots and copies its schedule has) and ``decode_gluon.launch``'s call of it with ``SEESAW`` (every argument
bound, the half-tile copy box, the grid). Its float64 tests on an sm_90 GPU are the "seesaw" rows of
``test_gluon_decode.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _triton_test_util import gluon_sm90, longest_load_run, paged_cache, record_gluon_launches, sm90_compile

DC, DR = 512, 64
BARRIERS = 91  # the most partition barriers the seesaw kernel's PTX may hold (Triton 3.6)
BF = torch.bfloat16
SCALE = 0.07


def _desc_type(block_shape, layout, dtype: str = "bf16") -> str:
    return f"tensordesc<{dtype}[{', '.join(str(n) for n in block_shape)}],{layout!r}>"


@sm90_compile
@pytest.mark.parametrize("block_size,direct,fold_first,tma_out,tma_q", [
    (64, False, False, False, False), (128, True, False, False, True), (64, True, True, True, True),
    (128, True, False, True, False), (64, False, True, False, True), (64, False, True, True, True)])
def test_sm90_compile_resources(block_size, direct, fold_first, tma_out, tma_q):
    """8 warps in all (the kernel's 4 and a 4-warp worker), no spill or stack at the register file's 255, shared
    memory of :func:`smem_bytes` plus under 1 KB and within 227 KB; the dots: warpgroup 0's tile 0 (S: the rope
    part's 4 k-steps and two latent halves of 16; its P V, 4), each warpgroup's loop (S, the other's P V, its own
    P V) and fold of the other's last tile (4); the TMA copies: tiles 0 and 1 in three parts each, then each
    warpgroup's rope and own half after its P V (warpgroup 0 also after tile 0) and its half of the other's slot;
    the same counts with ``FOLD_FIRST`` (the loop's steps reordered); with ``TMA_OUT`` one TMA store a warpgroup and
    no plain store of the output (only the LSE's; several splits: their float32 rows by TMA too); with ``TMA_Q`` the
    latent query rows by one more TMA copy, no plain load of them."""
    from mla_compile.ops.triton import decode_gluon_seesaw as sw
    from mla_compile.ops.triton._bf16_tma import BOX_SL, F32_BOX_SL
    from mla_compile.ops.triton._gluon import SMEM_SL
    from mla_compile.ops.triton._sm90 import resources

    types = dict(q_ptr="*bf16", bt_ptr="*i32", seq_lens_ptr="*i32", lse_ptr="*fp32",
                 o_ptr="*bf16" if direct else "*fp32", scale_log2="fp32",
                 desc_h=_desc_type([4, 64, 64], BOX_SL), desc_r=_desc_type([64, 64], SMEM_SL),
                 desc_o=_desc_type([4, 64, 64], BOX_SL) if direct else _desc_type([1, 8, 64, 32], F32_BOX_SL, "fp32"),
                 desc_q=_desc_type([8, 64, 64], BOX_SL))
    consts = dict(DC=DC, DR=DR, BLOCK_SIZE=block_size, DIRECT=direct, FOLD_FIRST=fold_first, TMA_OUT=tma_out,
                  TMA_Q=tma_q)
    if not tma_out:
        consts["desc_o"] = None
    if not tma_q:
        consts["desc_q"] = None
    compiled = gluon_sm90(sw.decode_gluon_seesaw_kernel, consts, sw.WARPS, types, ("stride_q",))
    assert compiled.metadata.num_warps == 8
    shared = compiled.metadata.shared
    assert sw.smem_bytes() <= shared < sw.smem_bytes() + 1024
    assert shared <= 227 * 1024
    res = resources(compiled)
    assert res["stack"] == 0 and res["LDL"] == 0 and res["STL"] == 0, res
    assert res["regs"] <= 255, res
    s_dot, pv = DR // 16 + 2 * (DC // 2) // 16, 64 // 16
    loop = s_dot + 2 * pv
    assert res["HGMMA"] == (s_dot + pv + loop + pv) + (loop + pv), res
    assert res["UTMALDG"] == 2 * 3 + (2 + 1) * 2 + 2 + (1 if tma_q else 0), res
    ptx = compiled.asm["ptx"]
    stores = ptx.count(".global.shared::cta.bulk_group")  # TMA stores (3d: the bf16 output; 4d: the splits')
    assert stores == (2 if tma_out else 0), stores
    # the output's plain stores (bf16 pairs, or float32 into the splits' workspace) gone with TMA_OUT: the LSE's remain
    plain = ptx.count("st.global")
    assert (plain <= 4) if tma_out else (plain >= 64), plain
    assert "setmaxnreg" in ptx  # the worker's register count set, the kernel's warps raised to the rest
    # the prologue's latent query rows loaded in one round trip (16 bytes a load, the kernel's 4 warps' share)
    q_loads = 64 * DC * 2 // 16 // (32 * sw.WARPS)
    assert (longest_load_run(ptx) < q_loads) if tma_q else (longest_load_run(ptx) >= q_loads)
    # one shared-memory allocation per slot, P buffer, hand-over row and barrier: the compiler's hazard analysis
    # places a partition barrier between accesses to two views of one allocation (126 of them with one allocation
    # for each kind of buffer, Triton 3.6)
    # (TMA_OUT: 5 more, the compiler's around the store into the query rows' buffer the loop's dots read, at the end)
    barriers = ptx.count("bar.sync") + ptx.count("barrier.sync")
    assert barriers <= BARRIERS + (5 if tma_out else 0), barriers


@sm90_compile
@pytest.mark.parametrize("splits,fold_first,tma_out", [(1, False, None), (1, True, False), (3, True, None),
                                                       (3, False, True)])
def test_sm90_compile_of_the_launch(monkeypatch, splits, fold_first, tma_out):
    """``decode_gluon.launch(..., config={"SEESAW": True, ...})`` on CPU tensors (128 heads, MTP rows, pages of
    128): it calls the seesaw kernel on grid ``(2 s_q, splits, B)`` with 4 warps, the latent copies' box half a
    tile (``[4, 64, 64]``) over the cache's ``[8, rows, 64]`` column blocks and the rope box ``[64, 64]``; every
    argument binds and the call compiles for sm_90; with several splits the fp32 workspaces and the reduce; the
    config's ``FOLD_FIRST`` reaches the kernel (``SEESAW_FOLD_FIRST`` where it names none); with one split (whole
    64-row programs) the output's TMA store (``TMA_OUT``, a ``[4, 64, 64]`` box over ``out``'s ``[8, rows, 64]`` column
    blocks) unless the config turns it off; with several splits, where the config asks for it, the float32 workspace's
    (a ``[1, 8, 64, 32]`` box over ``[splits, 16, rows, 32]`` column blocks)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mla_compile.ops.triton import decode_gluon as g
    from mla_compile.ops.triton._sm90 import signature

    seesaw = g.decode_gluon_seesaw_kernel
    launches = record_gluon_launches(monkeypatch, g, "decode_gluon_seesaw_kernel")
    monkeypatch.setattr(g, "num_sms", lambda device: 132)
    gen = torch.Generator().manual_seed(3)
    cache, table, seq_lens = paged_cache([300, 0, 129], 128, DC + DR, BF, device="cpu", gen=gen)
    q = torch.randn(3, 2, 128, DC + DR, generator=gen).to(BF)
    config = {"SEESAW": True, "SPLITS": splits, **({"FOLD_FIRST": True} if fold_first else {}),
              **({} if tma_out is None else {"TMA_OUT": tma_out})}
    out, lse = g.launch(q, cache, table, seq_lens, SCALE, DC, config=config)
    assert out.shape == (3, 2, 128, DC) and lse.shape == (3, 2, 128)
    assert len(launches) == (1 if splits == 1 else 2)
    kernel, grid, args, kwargs = launches[0]
    assert kernel is seesaw
    assert grid == (4, splits, 3) and kwargs["num_warps"] == 4
    assert kwargs["DIRECT"] == (splits == 1) and kwargs["BLOCK_SIZE"] == 128
    assert kwargs["FOLD_FIRST"] is (fold_first or g.SEESAW_FOLD_FIRST)
    desc_h, desc_r = args[1], args[2]
    assert isinstance(desc_h, TensorDescriptor) and list(desc_h.block_shape) == [4, 64, 64]
    assert list(desc_h.shape) == [8, cache.shape[0] * 128, 64]
    assert list(desc_r.block_shape) == [64, 64]
    tma = tma_out if tma_out is not None else splits == 1  # by default with one split only
    assert kwargs["TMA_OUT"] is tma and (isinstance(kwargs["desc_o"], TensorDescriptor) if tma else
                                         kwargs["desc_o"] is None)
    if tma:
        desc_o = kwargs["desc_o"]
        if splits == 1:  # the bf16 output
            assert list(desc_o.block_shape) == [4, 64, 64] and list(desc_o.shape) == [8, 3 * 2 * 128, 64]
            assert desc_o.base.data_ptr() == out.data_ptr() and list(desc_o.strides) == [64, DC, 1]
        else:  # the float32 workspace [rows, splits, 512] the reduce reads (o_ptr)
            assert list(desc_o.block_shape) == [1, 8, 64, 32] and list(desc_o.shape) == [splits, 16, 3 * 2 * 128, 32]
            assert desc_o.base.data_ptr() == args[5].data_ptr() and list(desc_o.strides) == [DC, 32, splits * DC, 1]
    # q's rows are dense (contiguous, 256 rows a sequence): its latent columns by TMA, box [8, 64, 64]
    desc_q = kwargs["desc_q"]
    assert kwargs["TMA_Q"] is True and list(desc_q.block_shape) == [8, 64, 64]
    assert list(desc_q.shape) == [8, 3 * 2 * 128, 64] and list(desc_q.strides) == [64, DC + DR, 1]
    sig, consts, attrs = signature(kernel, args, kwargs)  # (the descriptors typed from their tensors and boxes)
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=kwargs["num_warps"]))
    assert compiled.metadata.num_warps == 8 and compiled.metadata.shared <= 227 * 1024


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_query_rows_by_tma_only_where_they_are_dense(monkeypatch):
    """``TMA_Q``: a contiguous q (rows of 576 one after the other) gets the query rows' TMA descriptor; q as a column
    slice of a wider buffer (rows 640 apart), 40 heads x 2 positions (80 rows a sequence: not whole programs) and q
    expanded over the batch get none and load them plainly (recorded launches on CPU tensors: no view is made past
    q's storage)."""
    from mla_compile.ops.triton import decode_gluon as g

    launches = record_gluon_launches(monkeypatch, g, "decode_gluon_seesaw_kernel")
    monkeypatch.setattr(g, "num_sms", lambda device: 132)
    gen = torch.Generator().manual_seed(5)
    cache, table, seq_lens = paged_cache([300, 0, 129], 64, DC + DR, BF, device="cpu", gen=gen)
    dense = torch.randn(3, 1, 128, DC + DR, generator=gen).to(BF)
    wide = torch.randn(3, 1, 128, 640, generator=gen).to(BF)[..., :DC + DR]
    few = torch.randn(3, 2, 40, DC + DR, generator=gen).to(BF)
    shared = torch.randn(1, 1, 128, DC + DR, generator=gen).to(BF).expand(3, 1, 128, DC + DR)  # a third stored
    for q in (dense, wide, few, shared):
        g.launch(q, cache, table, seq_lens, SCALE, DC, config={"SEESAW": True})
    flags = [(kw["TMA_Q"], kw["desc_q"] is None) for _, _, _, kw in launches if "TMA_Q" in kw]
    assert flags == [(True, False)] + [(False, True)] * 3, flags
