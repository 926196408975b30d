"""The Gluon fp8 decodes (``ops/triton/fp8_decode_gluon.py``, ``mma.sync``; ``fp8_decode_wgmma.py`` and
``fp8_decode_tma.py``, sm_90):
CUDA shapes of each against the float64 reference with poisoned allocations, which one the op runs, the auto
choice, opcheck, torch.compile with a dynamic batch (no recompile) and CUDA-graph replay with new lengths;
on any machine with Triton, their shared-memory formulas against the sm_90 compile (the split plans count
programs per SM from them)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch.library import opcheck

import mla_compile  # noqa: F401
from tests.cuda_capture import capture
from _triton_test_util import assert_pdl_order, gluon_sm90, sm90_compile
from _sparse_test_util import fp8_paged, lens_with_empty
from _triton_test_util import assert_attention_close, poison_allocator
from mla_compile.ops import decode_fp8
from mla_compile.ops.fp8_cache import gluon_eligible

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA GPU and triton")
SCALE = 1 / math.sqrt(192)
DC, DR = 512, 64
# the bf16 budget of the sparse fp8 path (the Gluon kernels round each value once to float16, 2**-11, and are
# held to a tighter bound on data far from 1 by test_gluon_fp8_decode_float16_range)
TOL, LSE_ATOL = 1.5e-2, 1.5e-2


_lens = lens_with_empty


def _launch(kernel):
    """The launch function of ``kernel`` ("mma", "wgmma" or "tma"), skipping where it cannot run."""
    from mla_compile.ops.triton import fp8_decode_gluon, fp8_decode_tma, fp8_decode_wgmma

    if kernel != "mma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the {kernel} kernel is sm_90 only")
    return {"mma": fp8_decode_gluon.launch, "wgmma": fp8_decode_wgmma.launch, "tma": fp8_decode_tma.launch}[kernel]


def _check(B, H, s_q, lens, bs, seed, config=None, kernel="mma"):
    launch = _launch(kernel)
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens, _ = fp8_paged(lens, bs, DC, DR, "cuda", gen)
    q = torch.randn(B, s_q, H, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    assert gluon_eligible(q, cache, DC)
    poison_allocator()
    out, lse = launch(q, cache, table, seq_lens, SCALE, DC, config=config)
    torch.cuda.synchronize()
    ref, ref_lse = torch.ops.mla.decode_fp8_ref(q.double(), cache, table, seq_lens, SCALE, DC)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16, tol=TOL, lse_atol=LSE_ATOL)
    return q, cache, table, seq_lens, out, lse


_SHAPES = [  # B, H, s_q, max_len, bs
    (1, 16, 1, 16384, 64),     # one long sequence: many splits
    (128, 16, 1, 2048, 64),    # the memory-bound shape
    (300, 16, 1, 700, 64),     # more programs than slots: one split, written directly
    (9, 8, 2, 1500, 32),       # MTP rows folded (s_q * H = 16), pages of 32 (mma only)
    (5, 16, 2, 300, 64),       # two 16-row programs per sequence, queries that see nothing
    (4, 32, 1, 100, 64),       # two head blocks, sequences shorter than one tile
    (7, 12, 1, 3000, 128),     # pages of 128, 12 of 16 rows live
    (3, 128, 1, 2500, 64),     # 128 heads: eight head blocks, each reading the cache
    (2, 40, 2, 900, 64),       # MTP with 80 rows: five blocks, rows of both query positions in one block
]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kernel,B,H,s_q,max_len,bs", [
    (kernel, *shape) for shape in _SHAPES for kernel in ("mma", "wgmma", "tma")
    if kernel == "mma" or shape[-1] % 64 == 0  # wgmma / tma take pages of a multiple of 64 rows
])
def test_gluon_fp8_decode_shapes(kernel, B, H, s_q, max_len, bs):
    gen = torch.Generator().manual_seed(B * 10 + H)
    _check(B, H, s_q, _lens(B, max_len, gen), bs, seed=B + H, kernel=kernel)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kernel", ["mma", "wgmma", "tma"])
@pytest.mark.parametrize("splits", [1, 3])
def test_gluon_fp8_decode_split_counts(kernel, splits):
    gen = torch.Generator().manual_seed(5)
    _check(6, 16, 1, _lens(6, 3000, gen), 64, seed=5, config={"SPLITS": splits}, kernel=kernel)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kernel", ["mma", "wgmma", "tma"])
@pytest.mark.parametrize("q_mag,lat_mag", [(1.0, 1.0), (1e-4, 1.0), (40.0, 1.0), (1.0, 3e3), (1.0, 1e-2)])
def test_gluon_fp8_decode_float16_range(kernel, q_mag, lat_mag):
    """Both kernels run their dots in float16 (queries times a power of two; the wgmma kernel's values are
    codes times float16 scales, the group-split kernel's exact codes with fp32 scales): queries and latents far
    from 1 keep the float64 reference's accuracy, tighter than the bf16 budget, on outputs relative to the
    latents' size and LSEs relative to the scores' size (the exact-code kernels' LSEs to 1e-4)."""
    launch = _launch(kernel)
    gen = torch.Generator().manual_seed(11)
    lens = [1, 700, 3001, 64]
    cache, table, seq_lens, _ = fp8_paged(lens, 64, DC, DR, "cuda", gen)
    scales = cache[..., DC:DC + 4 * (DC // 128)].contiguous().view(torch.float32)
    cache[..., DC:DC + 4 * (DC // 128)] = (scales * lat_mag).view(torch.uint8)  # latents times lat_mag, exactly
    q = (torch.randn(len(lens), 1, 16, DC + DR, generator=gen) * q_mag).to("cuda", torch.bfloat16)
    poison_allocator()
    out, lse = launch(q, cache, table, seq_lens, SCALE, DC)
    torch.cuda.synchronize()
    ref, ref_lse = torch.ops.mla.decode_fp8_ref(q.double(), cache, table, seq_lens, SCALE, DC)
    size = max(1.0, q_mag * lat_mag)
    assert_attention_close(out / lat_mag, lse / size, ref / lat_mag, ref_lse / size, torch.bfloat16, tol=5e-3,
                           lse_atol=2e-3)
    if kernel != "wgmma":  # exact codes, fp32 scales: only the float16 queries round (relative 2**-11)
        seen = ref_lse.isfinite()
        assert ((lse.double() - ref_lse)[seen].abs().max() / size).item() < 1e-4


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kernel", ["mma", "wgmma", "tma"])
def test_gluon_split_count_beyond_the_merge_is_refused(kernel):
    launch = _launch(kernel)
    gen = torch.Generator().manual_seed(2)
    cache, table, seq_lens, _ = fp8_paged([100, 50], 64, DC, DR, "cuda", gen)
    q = torch.randn(2, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    with pytest.raises(ValueError, match=r"config SPLITS must be in \[1, 64\]"):
        launch(q, cache, table, seq_lens, SCALE, DC, config={"SPLITS": 65})


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("bs", [32, 64])
@pytest.mark.parametrize("contiguous", [True, False])
def test_the_op_runs_the_sm90_kernels_on_pages_of_64(bs, contiguous):
    """``mla::decode_fp8_gluon`` is bit-for-bit the launch ``sm90_launch`` names: on sm_90 with pages of 64
    rows the TMA kernel for a contiguous cache, the wgmma kernel for a strided view (pages of a larger buffer)."""
    from mla_compile.ops.triton import fp8_decode_gluon, fp8_decode_tma, fp8_decode_wgmma

    gen = torch.Generator().manual_seed(6)
    cache, table, seq_lens, _ = fp8_paged(_lens(5, 2000, gen), bs, DC, DR, "cuda", gen)
    if not contiguous:  # the same rows inside pages twice as long
        wide = torch.randint(0, 255, (cache.shape[0], 2 * bs, cache.shape[2]), dtype=torch.uint8, device="cuda")
        wide[:, :bs] = cache
        cache = wide[:, :bs]
    q = torch.randn(5, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    wgmma = torch.cuda.get_device_capability() == (9, 0) and bs % 64 == 0
    assert fp8_decode_gluon.wgmma_serves(q, cache) == wgmma
    assert fp8_decode_tma.serves(cache) == contiguous
    launch = fp8_decode_gluon.sm90_launch(q, cache) or fp8_decode_gluon.launch
    assert launch is {(True, True): fp8_decode_tma.launch, (True, False): fp8_decode_wgmma.launch}.get(
        (wgmma, contiguous), fp8_decode_gluon.launch)
    got = torch.ops.mla.decode_fp8_gluon(q, cache, table, seq_lens, SCALE, DC)
    want = launch(q, cache, table, seq_lens, SCALE, DC)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("scale", [-SCALE, 0.0])
def test_the_op_takes_any_softmax_scale(scale):
    """The group-split kernel's running max assumes a positive scale; the op runs other scales through the
    Triton kernel, still equal to the float64 reference."""
    import mla_compile.ops.triton.fp8_decode_gluon  # noqa: F401

    gen = torch.Generator().manual_seed(9)
    cache, table, seq_lens, _ = fp8_paged([40, 300, 1], 32, DC, DR, "cuda", gen)
    q = torch.randn(3, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    out, lse = torch.ops.mla.decode_fp8_gluon(q, cache, table, seq_lens, scale, DC)
    ref, ref_lse = torch.ops.mla.decode_fp8_ref(q.double(), cache, table, seq_lens, scale, DC)
    assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16, tol=TOL, lse_atol=LSE_ATOL)


@pytest.mark.cuda
@needs_cuda
def test_auto_picks_gluon_and_explicit_gluon_refuses_what_it_cannot_serve():
    gen = torch.Generator().manual_seed(4)
    cache, table, seq_lens, _ = fp8_paged(_lens(3, 900, gen), 64, DC, DR, "cuda", gen)
    q = torch.randn(3, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    auto = decode_fp8(q, cache, table, seq_lens, SCALE)
    gluon = decode_fp8(q, cache, table, seq_lens, SCALE, backend="gluon")
    assert all(torch.equal(a, g) for a, g in zip(auto, gluon))
    wide = torch.randn(3, 1, 128, DC + DR, generator=gen).to("cuda", torch.bfloat16)  # 128 heads: gluon too
    assert gluon_eligible(wide, cache, DC)
    auto = decode_fp8(wide, cache, table, seq_lens, SCALE)  # one of the Gluon kernels, as the timing table says
    assert any(all(torch.equal(a, g) for a, g in zip(auto, decode_fp8(wide, cache, table, seq_lens, SCALE, backend=b)))
               for b in ("gluon", "gluon64"))
    rope16 = torch.randn(3, 1, 16, 512 + 32, generator=gen).to("cuda", torch.bfloat16)  # not DeepSeek's split
    assert not gluon_eligible(rope16, cache, DC)
    with pytest.raises(ValueError, match="backend 'gluon' takes bf16 q"):
        decode_fp8(rope16, cache, table, seq_lens, SCALE, backend="gluon")
    with pytest.raises(ValueError, match="backend 'gluon'"):
        decode_fp8(q.half(), cache, table, seq_lens, SCALE, backend="gluon")


@pytest.mark.cuda
@needs_cuda
def test_gluon_fp8_decode_opcheck():
    import mla_compile.ops.triton.fp8_decode_gluon  # noqa: F401

    gen = torch.Generator().manual_seed(1)
    cache, table, lens, _ = fp8_paged([70, 0, 130], 64, DC, DR, "cuda", gen)
    q = torch.randn(3, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    opcheck(torch.ops.mla.decode_fp8_gluon.default, (q, cache, table, lens, SCALE, DC))


@pytest.mark.cuda
@needs_cuda
def test_compiled_dynamic_batch_and_graph_replay():
    """The auto backend under torch.compile(fullgraph, dynamic): batches across the SM count compile once;
    the compiled step captured in a CUDA graph replays new lengths and queries."""
    gen = torch.Generator().manual_seed(8)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batches = (2, 64, 2 * sms + 8)
    lens = _lens(max(batches), 1500, gen)
    cache, table, seq_lens, _ = fp8_paged(lens, 64, DC, DR, "cuda", gen)
    q = torch.randn(max(batches), 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16)
    step = torch.compile(lambda q, t, s: decode_fp8(q, cache, t, s, SCALE), fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for i, b in enumerate(batches):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out, lse = step(q[:b], table[:b], seq_lens[:b])
        ref, ref_lse = torch.ops.mla.decode_fp8_ref(q[:b].double(), cache, table[:b], seq_lens[:b], SCALE, DC)
        assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16, tol=TOL, lse_atol=LSE_ATOL)

    B = 12
    st = {"q": q[:B].clone(), "lens": seq_lens[:B].clone()}
    graph, (out, lse) = capture(lambda: step(st["q"], table[:B], st["lens"]))
    for _ in range(3):
        new = torch.tensor(_lens(B, 1500, gen), dtype=torch.int32, device="cuda")
        st["lens"].copy_(torch.minimum(new, seq_lens[:B]))  # within each sequence's written positions
        st["q"].copy_(torch.randn(B, 1, 16, DC + DR, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = torch.ops.mla.decode_fp8_ref(st["q"].double(), cache, table[:B], st["lens"], SCALE, DC)
        assert_attention_close(out, lse, ref, ref_lse, torch.bfloat16, tol=TOL, lse_atol=LSE_ATOL)


def _compile_sm90(kernel, consts, warps, extra=None):
    """The sm_90 compile of a decode kernel (its pointer arguments 16-byte aligned, as CUDA allocations are);
    ``extra``: signature types of further or other arguments (tensor descriptors, more pointers)."""
    types = dict(q_ptr="*bf16", kv_ptr="*u8", bt_ptr="*i32", seq_lens_ptr="*i32", lse_ptr="*fp32",
                 o_ptr="*bf16" if consts.get("DIRECT") else "*fp32", scale_log2="fp32")
    types.update(extra or {})
    return gluon_sm90(kernel, consts, warps, types, ("stride_kb", "stride_kt"))


@sm90_compile
@pytest.mark.parametrize("direct", [False, True])
def test_smem_formula_matches_the_sm90_compile(direct):
    """The group-split kernel's shared memory (sm_90 compile) is its formula, and its dot operands are the
    loaded registers renamed (the ``assert_trivial`` conversions compile)."""
    from mla_compile.ops.triton import fp8_decode_gluon as g

    consts = dict(DC=DC, DR=DR, BLOCK_SIZE=64, BLOCK_H=g.BLOCK_H, BLOCK_N=g.BLOCK_N, DIRECT=direct)
    compiled = _compile_sm90(g.decode_fp8_gluon_kernel, consts, 4)
    assert compiled.metadata.shared == g.smem_bytes()


@sm90_compile
def test_wgmma_smem_formula_matches_the_sm90_compile():
    """The wgmma kernel's shared memory (sm_90 compile) is its formula, and two programs fit an SM (228 KB,
    1 KB reserved each) where three do not: the split plan's ``PROGRAMS_PER_SM``."""
    from mla_compile.ops.triton import fp8_decode_wgmma as w

    consts = dict(DC=DC, DR=DR, BLOCK_SIZE=64, BLOCK_H=w.BLOCK_H, BLOCK_N=w.BLOCK_N, DIRECT=False)
    compiled = _compile_sm90(w.decode_fp8_wgmma_kernel, consts, 4)
    assert compiled.metadata.shared == w.smem_bytes()
    assert w.PROGRAMS_PER_SM * (w.smem_bytes() + 1024) <= 233472 < (w.PROGRAMS_PER_SM + 1) * (w.smem_bytes() + 1024)


@sm90_compile
@pytest.mark.parametrize("direct,pdl", [(False, True), (True, False)])
def test_tma_smem_formula_matches_the_sm90_compile(direct, pdl):
    """The TMA kernel's shared memory (sm_90 compile) is its buffers' formula plus under 1 KB of the
    partitions' captured arguments, one program fits an SM where two do not (the split plan's
    ``PROGRAMS_PER_SM``), the consumers keep their registers (setmaxnreg 240: at most one 4-byte slot,
    outside the loop, where ptxas keeps the final row sums' predicate; the loop-invariant ``wgmma``
    descriptors stay in the loop, ``_fp8_tma.opaque_zero``) and both consumers' dots are there; with ``PDL`` (the
    launch an sm_90 device gets) every program waits for the kernel before it ahead of any global read (the
    block table's, the TMA copies) and then lets the next kernel be scheduled, without it neither."""
    from mla_compile.ops.triton import _fp8_tma as t, fp8_decode_tma as m
    from mla_compile.ops.triton._sm90 import resources

    consts = dict(DC=DC, DR=DR, BLOCK_SIZE=64, BLOCK_H=t.BLOCK_H, BLOCK_N=t.BLOCK_N, DIRECT=direct, STAGES=m.STAGES,
                  PDL=pdl)
    extra = dict(desc_c=f"tensordesc<u8[4, 64, 128],{t.CODE_BOX!r}>", desc_r=f"tensordesc<bf16[64, 64],{t.ROPE_SL!r}>",
                 desc_s=f"tensordesc<u8[64, 16],{t.SCALE_SL!r}>", out_ptr="*bf16", lse_out_ptr="*fp32", cnt_ptr="*i32")
    compiled = _compile_sm90(m.decode_fp8_tma_kernel, consts, 4, extra)
    assert_pdl_order(compiled.asm["ptx"], pdl)
    shared = compiled.metadata.shared
    assert m.smem_bytes() <= shared < m.smem_bytes() + 1024
    assert m.PROGRAMS_PER_SM * (shared + 1024) <= 233472 < (m.PROGRAMS_PER_SM + 1) * (shared + 1024)
    res = resources(compiled)
    assert res["stack"] <= 8 and res["HGMMA"] == 2 * 68
