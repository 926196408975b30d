"""The persistent sm_90 Gluon bf16 decodes (``ops/triton/decode_gluon_seesaw_persist.py``,
``ops/triton/decode_gluon_swap_persist.py``) on any machine with Triton: their sm_90 compiles (warps, shared memory
within an SM's 227 KB, spills kept out of the tile loops, no ``wgmma`` ptxas serializes or waits on by itself, the
dots and copies of their schedules) and ``decode_gluon.launch``'s calls of them with ``PERSIST`` (one program an SM,
every argument bound, the copy boxes, the merge after them; the calls they leave to the other kernels); backends
"gluon-seesaw-persist" and "gluon-persist". Their float64 tests on an sm_90 GPU are the persistent rows of
``test_gluon_decode.py``; the schedule and the merge run on CPU in ``test_tile_merge.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _triton_test_util import gluon_sm90, paged_cache, record_gluon_launches, sm90_compile

DC, DR = 512, 64
BF = torch.bfloat16
SCALE = 0.07
PERSIST = {"SEESAW": True, "PERSIST": True}


def _desc_type(block_shape, layout, dtype: str = "bf16") -> str:
    return f"tensordesc<{dtype}[{', '.join(str(n) for n in block_shape)}],{layout!r}>"


@sm90_compile
@pytest.mark.parametrize("block_size", [64, 128])
def test_sm90_compile_resources(block_size):
    """8 warps (the kernel's 4 and a 4-warp worker, each warpgroup's register count set), shared memory of the
    seesaw's buffers plus under 1 KB and within 227 KB; no spill inside a loop of ``wgmma`` (the few values ptxas
    keeps in local memory across the two partitions are read once a piece) and no ptxas info C7511 / C7517; the
    dots: warpgroup 0's tile 0 (S: the rope part's 4 k-steps and two latent halves of 16; its P V, 4), each
    warpgroup's loop (S, the other's P V, its own P V) and fold of the other's last tile (4); the TMA copies: the
    first piece's tiles 0 and 1 in three parts each, each warpgroup's rope and own half after its P V (warpgroup 0
    also after tile 0) and its half of the other's slot (in its loop and after the last fold), warpgroup 0's whole
    tile 1 of the next piece after a piece of one tile, each warpgroup's half of a piece's query rows; one TMA store
    a warpgroup (a whole item's rows) beside the plain stores of the partial rows."""
    from mla_compile.ops.triton import decode_gluon_seesaw as sw
    from mla_compile.ops.triton import decode_gluon_seesaw_persist as sp
    from mla_compile.ops.triton._bf16_tma import BOX_SL
    from mla_compile.ops.triton._gluon import SMEM_SL
    from mla_compile.ops.triton._sm90 import ptxas_infos, resources, spills_in_mma_loops

    half = _desc_type([4, 64, 64], BOX_SL)
    types = dict(q_ptr="*bf16", bt_ptr="*i32", seq_lens_ptr="*i32", lse_ptr="*fp32", ws_ptr="*fp32", wl_ptr="*fp32",
                 scale_log2="fp32", desc_h=half, desc_r=_desc_type([64, 64], SMEM_SL), desc_o=half, desc_q=half)
    compiled = gluon_sm90(sp.decode_gluon_seesaw_persist_kernel, dict(DC=DC, DR=DR, BLOCK_SIZE=block_size), sp.WARPS,
                          types)
    assert compiled.metadata.num_warps == 8
    shared = compiled.metadata.shared
    assert sw.smem_bytes() <= shared < sw.smem_bytes() + 1024 and shared <= 227 * 1024
    res = resources(compiled)
    assert res["regs"] <= 255 and res["STL"] <= 6 and res["stack"] <= 32, res
    assert spills_in_mma_loops(compiled) == 0
    assert not {"C7511", "C7517"} & set(ptxas_infos(compiled))
    s_dot, pv = DR // 16 + 2 * (DC // 2) // 16, 64 // 16
    loop = s_dot + 2 * pv
    assert res["HGMMA"] == (s_dot + pv + loop + pv) + (loop + pv), res
    # prologue 2 tiles x 3 parts; warpgroup 0: tile 0's rope + half, its loop's 2 + 1, the fold's 1, the one-tile
    # piece's 3, the query half 1; warpgroup 1: its loop's 2 + 1, the fold's 1, the query half 1
    assert res["UTMALDG"] == 2 * 3 + (2 + 3 + 1 + 3 + 1) + (3 + 1 + 1), res
    ptx = compiled.asm["ptx"]
    assert ptx.count(".global.shared::cta.bulk_group") == 2  # the whole items' output, a warpgroup's half each
    assert "setmaxnreg" in ptx


def _launch(monkeypatch, lens, s_q, H, config, q=None):
    """``decode_gluon.launch`` on CPU tensors with its launches recorded (every kernel it may take, the merges)."""
    from mla_compile.ops.triton import decode_gluon as g
    from mla_compile.ops.triton._sm90 import recorder

    launches = record_gluon_launches(monkeypatch, g, "decode_gluon_seesaw_persist_kernel")
    for name in ("decode_gluon_seesaw_kernel", "decode_gluon_swap_persist_kernel", "decode_gluon_swap_kernel",
                 "decode_gluon_kernel"):
        monkeypatch.setattr(g, name, recorder(launches)(getattr(g, name)))
    monkeypatch.setattr(g, "num_sms", lambda device: 132)
    gen = torch.Generator().manual_seed(len(lens) + H)
    cache, table, seq_lens = paged_cache(lens, 128, DC + DR, BF, device="cpu", gen=gen)
    if q is None:
        q = torch.randn(len(lens), s_q, H, DC + DR, generator=gen).to(BF)
    out, lse = g.launch(q, cache, table, seq_lens, SCALE, DC, config=config)
    assert out.shape == (len(lens), s_q, H, DC) and lse.shape == (len(lens), s_q, H)
    return launches, q, cache, table, seq_lens, out, lse


@sm90_compile
def test_sm90_compile_of_the_launch(monkeypatch):
    """``decode_gluon.launch(..., config={"SEESAW": True, "PERSIST": True})`` on CPU tensors (128 heads, MTP rows,
    pages of 128): the persistent kernel on grid ``(132,)`` (one program an SM) with 4 warps; the latent copies'
    and the query rows' box half a tile (``[4, 64, 64]``) over the cache's and q's ``[8, rows, 64]`` column blocks,
    the rope box ``[64, 64]``, the output's ``[4, 64, 64]`` box over ``out``'s column blocks, float32 workspaces of
    two 64-row slots a program; then the merge over the same 132 programs; every argument binds and the call
    compiles for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mla_compile.ops.triton import decode_gluon_seesaw_persist as sp
    from mla_compile.ops.triton._sm90 import signature
    from mla_compile.ops.triton.tile_merge import _tile_merge_kernel

    launches, q, cache, _, seq_lens, out, lse = _launch(monkeypatch, [300, 0, 129], 2, 128, PERSIST)
    assert len(launches) == 2
    kernel, grid, args, kwargs = launches[0]
    assert kernel is sp.decode_gluon_seesaw_persist_kernel and grid == (132,) and kwargs["num_warps"] == 4
    assert kwargs["BLOCK_SIZE"] == 128
    desc_h, desc_r, desc_q, desc_o = args[1:5]
    for d in (desc_h, desc_q, desc_o):
        assert isinstance(d, TensorDescriptor) and list(d.block_shape) == [4, 64, 64]
    assert list(desc_h.shape) == [8, cache.shape[0] * 128, 64] and list(desc_r.block_shape) == [64, 64]
    assert list(desc_q.shape) == [8, 3 * 2 * 128, 64] and list(desc_q.strides) == [64, DC + DR, 1]
    assert desc_q.base.data_ptr() == q.data_ptr()
    assert desc_o.base.data_ptr() == out.data_ptr() and list(desc_o.shape) == [8, 3 * 2 * 128, 64]
    ws, wl = args[7], args[8]
    assert ws.shape == (2 * 132 * 64, DC) and wl.shape == (2 * 132 * 64,) and ws.dtype == wl.dtype == torch.float32
    assert args[9].data_ptr() == lse.data_ptr()
    merge, m_grid, m_args, _ = launches[1]
    assert merge is _tile_merge_kernel and m_grid[0] == 3 * (2 * 128 // 64)
    assert m_args[0] is seq_lens and m_args[1] is ws and m_args[2] is wl and m_args[3] is out
    assert tuple(m_args[5:8]) == (3, 2 * 128, 132)  # sequences, rows a sequence, programs
    sig, consts, attrs = signature(kernel, args, kwargs)
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=kwargs["num_warps"]))
    assert compiled.metadata.num_warps == 8 and compiled.metadata.shared <= 227 * 1024


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("case", ["rows", "fold_order", "strided", "not_asked"])
def test_calls_it_cannot_serve_run_the_seesaw(monkeypatch, case):
    """``PERSIST`` is taken only for whole 64-row blocks of query rows (40 heads x 2 positions are 80 rows: not),
    in the seesaw's ``FOLD_FIRST`` order and over q's dense rows (a column slice of a wider buffer is not); without
    ``PERSIST`` the seesaw runs (recorded launches on CPU tensors)."""
    gen = torch.Generator().manual_seed(1)
    q, H, s_q, config = None, 128, 1, dict(PERSIST)
    if case == "rows":
        H, s_q = 40, 2
    elif case == "fold_order":
        config["FOLD_FIRST"] = False
    elif case == "strided":
        q = torch.randn(3, 1, 128, 640, generator=gen).to(BF)[..., :DC + DR]
    else:
        config.pop("PERSIST")
    from mla_compile.ops.triton.decode_gluon_seesaw import decode_gluon_seesaw_kernel as seesaw

    launches, *_ = _launch(monkeypatch, [300, 0, 129], s_q, H, config, q=q)
    assert launches[0][0] is seesaw and launches[0][1][0] == -(-s_q * H // 64)  # grid (row blocks, splits, B)


@pytest.mark.parametrize("name,like,kernel", [
    ("gluon-seesaw-persist", "gluon-seesaw", "decode_gluon_seesaw_persist_kernel"),
    ("gluon-persist", "gluon", "decode_gluon_swap_persist_kernel")])
def test_the_backend_serves_what_its_kernel_serves_and_auto_skips_it(name, like, kernel):
    """Backends "gluon-seesaw-persist" / "gluon-persist" of ``mla::decode`` are declared with the capabilities of
    "gluon-seesaw" / "gluon" (calls their persistent kernel cannot run take the other kernels), their kernels named
    for ``inspect``; GPU-tested but slower than the kernels they come from (BENCHMARKS.md), so "auto" passes over
    them (by name only)."""
    from mla_compile.ops.registry import backends_for, kernel_backend
    from mla_compile.ops.select import auto_skip, why_not
    from _triton_test_util import sm90_facts

    table = backends_for("decode")
    spec, other = table[name], table[like]
    assert spec.gpu_tested and "slower" in auto_skip(spec)
    for kw in ({}, dict(block_size=128, query_len=2), dict(cap=(10, 0)), dict(cache_dtype=torch.float16),
               dict(block_size=32), dict(packed_rows=False)):
        facts = sm90_facts(**{"cache_dtype": BF, "cache_align": 128, **kw})
        assert (why_not(spec, facts) is None) == (why_not(other, facts) is None), kw
    assert kernel_backend(kernel) == name


@sm90_compile
@pytest.mark.parametrize("block_size,pdl", [(64, True), (128, False)])
def test_sm90_compile_resources_swapped(block_size, pdl):
    """4 warps, the swapped kernel's shared memory (16 query rows, two tile slots, P^T) plus under 1 KB; spills out of
    the tile loop but one value (ptxas keeps a shared-memory address of the softmax's row maxima in local memory at
    the register file's 255: its two loads there, against a tile's copy and dots), no ptxas info C7511 / C7517; the
    dots as the swapped kernel's (each piece's first S, the loop's S and P V); the TMA copies: the first piece's tiles
    0 and 1 (latent and rope each), the one-tile piece's next tile 1, the loop's refill; with ``PDL`` the wait before
    any global read."""
    from _triton_test_util import assert_pdl_order

    from mla_compile.ops.triton import decode_gluon as g
    from mla_compile.ops.triton import decode_gluon_swap_persist as sp
    from mla_compile.ops.triton._bf16_tma import BOX_SL
    from mla_compile.ops.triton._gluon import SMEM_SL
    from mla_compile.ops.triton._sm90 import ptxas_infos, resources, spills_in_mma_loops

    types = dict(q_ptr="*bf16", bt_ptr="*i32", seq_lens_ptr="*i32", lse_ptr="*fp32", ws_ptr="*fp32", wl_ptr="*fp32",
                 o_ptr="*bf16", scale_log2="fp32", desc_c=_desc_type([8, 64, 64], BOX_SL),
                 desc_r=_desc_type([64, 64], SMEM_SL))
    compiled = gluon_sm90(sp.decode_gluon_swap_persist_kernel,
                          dict(DC=DC, DR=DR, BLOCK_SIZE=block_size, BLOCK_R=16, PDL=pdl), sp.WARPS, types,
                          ("stride_q",))
    assert compiled.metadata.num_warps == 4
    shared = compiled.metadata.shared
    assert g.smem_bytes(swap=True) <= shared < g.smem_bytes(swap=True) + 1024
    res = resources(compiled)
    assert res["regs"] <= 255 and res["stack"] <= 32, res
    assert spills_in_mma_loops(compiled) <= 2
    assert not {"C7511", "C7517"} & set(ptxas_infos(compiled))
    s_dot, pv = DR // 16 + DC // 16, (DC // 64) * (64 // 16)
    assert res["HGMMA"] == s_dot + (s_dot + pv), res
    assert res["UTMALDG"] == 2 * 2 + 2 + 2, res
    assert_pdl_order(compiled.asm["ptx"], pdl, "decode_gluon_swap_persist_kernel")


@sm90_compile
def test_sm90_compile_of_the_swapped_launch(monkeypatch):
    """``decode_gluon.launch(..., config={"PERSIST": True})`` at 16 heads (the swapped kernel's calls): the persistent
    swapped kernel on grid ``(132,)`` with 4 warps and PDL, the tile copies' box a whole tile's latent columns
    (``[8, 64, 64]``) and the rope's ``[64, 64]``, float32 workspaces of two 16-row slots a program, then the merge
    of 16-row items; every argument binds and the call compiles for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mla_compile.ops.triton import decode_gluon_swap_persist as sp
    from mla_compile.ops.triton._sm90 import signature
    from mla_compile.ops.triton.tile_merge import _tile_merge_kernel

    launches, q, cache, _, seq_lens, out, lse = _launch(monkeypatch, [300, 0, 129, 4000], 1, 16, {"PERSIST": True})
    assert len(launches) == 2
    kernel, grid, args, kwargs = launches[0]
    assert kernel is sp.decode_gluon_swap_persist_kernel and grid == (132,) and kwargs["num_warps"] == 4
    assert kwargs["BLOCK_R"] == 16 and kwargs["BLOCK_SIZE"] == 128 and "PDL" in kwargs
    desc_c, desc_r = args[1], args[2]
    assert isinstance(desc_c, TensorDescriptor) and list(desc_c.block_shape) == [8, 64, 64]
    assert list(desc_r.block_shape) == [64, 64]
    ws, wl = args[5], args[6]
    assert ws.shape == (2 * 132 * 16, DC) and wl.shape == (2 * 132 * 16,)
    assert args[7].data_ptr() == out.data_ptr() and args[8].data_ptr() == lse.data_ptr()
    merge, m_grid, m_args, m_kwargs = launches[1]
    assert merge is _tile_merge_kernel and m_grid[0] == 4 and m_kwargs["ROWS"] == 16
    assert m_args[1] is ws and m_args[2] is wl and tuple(m_args[5:8]) == (4, 16, 132)
    sig, consts, attrs = signature(kernel, args, kwargs)
    opts = dict(num_warps=kwargs["num_warps"])
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=opts)
    assert compiled.metadata.num_warps == 4 and compiled.metadata.shared <= 227 * 1024


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("H,s_q,config,persistent", [(16, 1, {"PERSIST": True}, True),
                                                     (40, 2, {"PERSIST": True, "SWAP": True}, True),
                                                     (16, 1, {"PERSIST": True, "SWAP": False}, False)])
def test_the_swapped_kernel_is_persistent_only_where_it_would_run(monkeypatch, H, s_q, config, persistent):
    """``PERSIST`` without ``SEESAW`` makes the swapped kernel persistent where the call takes it (16 heads, or
    ``SWAP`` asked for at 40 heads x 2 positions); where the call takes the 64-row kernel (``SWAP`` off) it runs that
    (recorded launches on CPU tensors)."""
    from mla_compile.ops.triton import decode_gluon_swap_persist as sp
    from mla_compile.ops.triton.decode_gluon import decode_gluon_kernel as plain

    launches, *_ = _launch(monkeypatch, [300, 0, 129], s_q, H, config)
    assert launches[0][0] is (sp.decode_gluon_swap_persist_kernel if persistent else plain)
