"""The sm_90 Gluon fp8-cache decode with 64 query rows a program (``ops/triton/fp8_decode_gluon64.py``, backend
"gluon64" of ``mla::decode_fp8``).

On any machine with Triton: its sm_90 compile (shared memory within an SM's 227 KB, no spills in the tile
loop, the dots there, no TMA copies) and its declaration (what the selector lets it serve; "auto" never picks
it before its GPU run). On an sm_90 GPU: shapes against the float64 decode of the dequantized cache
(``mla::decode_fp8_ref`` in float64; NaN-poisoned cache rows past each sequence and outputs, empty sequences,
lengths off the tile size, one split and many, MTP rows, 16 and 128 heads, pages of 64 and 128), latents and
queries far from 1, any softmax scale, a strided cache (pages inside a larger buffer) bit for bit, the op's
fallback for what the kernel does not serve, opcheck, torch.compile and CUDA-graph replay through
``mla_compile.ops.decode_fp8(..., backend="gluon64")``."""

from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch
from torch.library import opcheck

import mla_compile  # noqa: F401
from mla_compile.ops import decode_fp8
from mla_compile.ops.registry import backends_for
from mla_compile.ops.select import select, why_not
from tests.cuda_capture import capture
from _sparse_test_util import fp8_paged, lens_with_empty
from _triton_test_util import (assert_attention_close, assert_pdl_order, check_tma_out, gluon_sm90, longest_load_run,
                               poison_allocator, record_gluon_launches, sm90_compile, sm90_facts)

HAS_TRITON = importlib.util.find_spec("triton") is not None
SCALE = 1 / math.sqrt(192)
DC, DR = 512, 64
BF = torch.bfloat16
# each dequantized key / value rounds once to bf16 (2**-9 relative): scores move by about 0.0018 at this scale
# and N(0, 1) data, and a row that sees one key carries its score's error into its LSE whole (a CPU model of
# the kernel's roundings: LSEs within 9e-3, outputs within 3.3e-3 normwise and 1.2e-2 elementwise on these
# tests' data)
TOL, LSE_ATOL = 1.5e-2, 2e-2
# the kernel's variants (``launch``'s config keys, ``fp8_decode_gluon64.VARIANTS``) as whole configs: none, each
# alone, "default" (``launch``'s defaults: RESCALE_SKIP + MAX_XCHG) and all together; the ids name them
# (``-k RESCALE_SKIP``)
_FLAGS = ("RESCALE_SKIP", "MAX_XCHG", "CVT_BF16")
VARIANTS = {name: {k: k in on for k in _FLAGS} for name, on in {
    "PLAIN": (), "RESCALE_SKIP": ("RESCALE_SKIP",), "MAX_XCHG": ("MAX_XCHG",), "CVT_BF16": ("CVT_BF16",),
    "default": ("RESCALE_SKIP", "MAX_XCHG"), "ALL_VARIANTS": _FLAGS}.items()}
VARIANTS["TMA_OUT"] = {**VARIANTS["default"], "TMA_OUT": True}  # one split's rows by TMA (not a default yet)
variants = pytest.mark.parametrize("variant", list(VARIANTS))


def _sm90() -> bool:
    return HAS_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU and triton")


def _inputs(lens, H, s_q, bs, seed, q_mag=1.0):
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens, _ = fp8_paged(lens, bs, DC, DR, "cuda", gen)
    q = (torch.randn(len(lens), s_q, H, DC + DR, generator=gen) * q_mag).to("cuda", BF)
    return q, cache, table, seq_lens


def _reference(q, cache, table, seq_lens, scale=SCALE):
    """float64 decode over the dequantized cache (``float64(code) * scale``; rows past a sequence masked)."""
    return torch.ops.mla.decode_fp8_ref(q.double(), cache, table, seq_lens, scale, DC)


def _check(lens, H, s_q, bs, seed, config=None, variant="default"):
    from mla_compile.ops.triton import fp8_decode_gluon64 as g

    q, cache, table, seq_lens = _inputs(lens, H, s_q, bs, seed)
    assert g.eligible(q, cache, DC)
    poison_allocator()
    out, lse = g.launch(q, cache, table, seq_lens, SCALE, DC, config={**(config or {}), **VARIANTS[variant]})
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, cache, table, seq_lens)
    assert_attention_close(out, lse, ref, ref_lse, BF, tol=TOL, lse_atol=LSE_ATOL)


_SHAPES = [  # B, H, s_q, max_len, bs, SPLITS (None: the plan's)
    (6, 16, 1, 3000, 64, None),     # an empty sequence, lengths off the tile size
    (6, 16, 1, 3000, 64, 1),        # one split: the result written directly
    (6, 16, 1, 3000, 64, 3),        # three splits merged by the reduce kernel
    (1, 16, 1, 16384, 64, None),    # one long sequence: many splits
    (1, 128, 1, 16384, 64, None),   # 128 heads, one sequence: two 64-row programs, many splits
    (300, 16, 1, 700, 64, None),    # more programs than SMs: one split
    (5, 128, 1, 2500, 64, None),    # 128 heads: two 64-row programs a sequence
    (4, 128, 1, 2000, 64, 1),
    (140, 128, 1, 1000, 64, None),  # 128 heads, a full wave: one split
    (5, 16, 2, 1000, 64, None),     # MTP: 32 rows, queries of the last position see one key more
    (3, 128, 2, 1500, 128, None),   # MTP with 256 rows, pages of 128
    (2, 40, 2, 900, 64, 2),         # 80 rows: a full and a partial program, both query positions in one
    (7, 16, 1, 3000, 128, None),    # pages of 128
    (4, 16, 1, 63, 64, None),       # sequences shorter than one tile
]


@pytest.mark.cuda
@needs_sm90
@variants
@pytest.mark.parametrize("B,H,s_q,max_len,bs,splits", _SHAPES)
def test_gluon64_fp8_decode_shapes(B, H, s_q, max_len, bs, splits, variant):
    gen = torch.Generator().manual_seed(B * 7 + H + s_q)
    lens = lens_with_empty(B, max_len, gen)
    _check(lens, H, s_q, bs, seed=B + H, config=None if splits is None else {"SPLITS": splits}, variant=variant)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("lens", [[0, 0, 0], [1, 0, 65], [64, 128, 129, 1], [200, 130, 250], [256, 320, 383]])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("H", [16, 128])
@variants
def test_gluon64_fp8_decode_short_and_empty(lens, s_q, H, variant):
    """Splits with no tile, one tile, one partial tile and two to six tiles (the prologue's two slots, the
    register tile and the steady state): every row written, -inf LSE where nothing is seen (s_q = 2 with one
    key: the first query position sees nothing)."""
    _check(lens, H, s_q, 64, seed=3, variant=variant)
    _check(lens, H, s_q, 64, seed=4, config={"SPLITS": 4}, variant=variant)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("q_mag,lat_mag", [(1e-4, 1.0), (1e-3, 1e3), (1.0, 1e-2), (1.0, 1e-30)])
@variants
def test_gluon64_fp8_decode_far_from_one(q_mag, lat_mag, variant):
    """Queries and latents far from 1 (bf16 keeps float32's exponent range: no clamping as in the float16
    kernels): the float64 reference's accuracy relative to the latents' size. Large latents come with small
    queries: the keys' bf16 rounding moves a score by about 2**-9 / sqrt(3) * ||q * k|| (0.025 for N(0, 1)
    data), and logits in the tens or more turn that into visible changes of the softmax (a CPU model of the
    kernel's roundings exceeds the elementwise bound at queries times 40), not an error of the kernel. The
    scales reach about 7 here (N(0, 1) latents times 1e3): within ``CVT_BF16``'s 2**8."""
    from mla_compile.ops.triton import fp8_decode_gluon64 as g

    q, cache, table, seq_lens = _inputs([1, 700, 3001, 64], 16, 1, 64, seed=11, q_mag=q_mag)
    scales = cache[..., DC:DC + 16].contiguous().view(torch.float32)
    cache[..., DC:DC + 16] = (scales * lat_mag).view(torch.uint8)  # latents times lat_mag (scales stay finite)
    poison_allocator()
    out, lse = g.launch(q, cache, table, seq_lens, SCALE, DC, config=VARIANTS[variant])
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, cache, table, seq_lens)
    size = max(1.0, q_mag * lat_mag)
    assert_attention_close(out / lat_mag, lse / size, ref / lat_mag, ref_lse / size, BF, tol=TOL,
                           lse_atol=LSE_ATOL)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("scale", [-SCALE, 0.0, 4 * SCALE])
@variants
def test_gluon64_fp8_decode_any_scale(scale, variant):
    """Negative, zero and larger scales (applied before the maxima). Not far larger: the keys' bf16 rounding
    moves N(0, 1) scores by about 0.025 (times the scale), which near-ties of large logits would amplify."""
    from mla_compile.ops.triton import fp8_decode_gluon64 as g

    q, cache, table, seq_lens = _inputs([700, 300, 5], 16, 1, 64, seed=8)
    out, lse = g.launch(q, cache, table, seq_lens, scale, DC, config=VARIANTS[variant])
    ref, ref_lse = _reference(q, cache, table, seq_lens, scale)
    assert_attention_close(out, lse, ref, ref_lse, BF, tol=TOL, lse_atol=LSE_ATOL * max(1.0, abs(scale) / SCALE))


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("splits", [None, 1])
@variants
def test_gluon64_fp8_decode_growing_maxima(splits, variant):
    """Keys scaled up 3, 4 and 5 times at positions 700, 1500 and 2500: for some rows a later tile's maximum
    passes the running one by more than ``RESCALE_SKIP``'s threshold (2**8) after tiles that kept it (a CPU
    model of the variant counts 8 such raises in one split), others keep theirs: both paths of the lazy
    rescale, warps that skip O's rescale next to warps that do not. A row led by a scaled key carries its
    score's bf16 error (five times N(0, 1)'s) into its LSE (the model: 0.03 for every variant)."""
    from mla_compile.ops.triton import fp8_decode_gluon64 as g

    lens = [3000, 2100, 1000]
    q, cache, table, seq_lens = _inputs(lens, 16, 1, 64, seed=5)
    for b, n in enumerate(lens):
        for pos, f in [(700, 3.0), (1500, 4.0), (2500, 5.0)]:
            if pos < n:
                blk, off = int(table[b, pos // 64]), pos % 64
                sc = cache[blk, off, DC:DC + 16].clone().view(torch.float32) * f
                cache[blk, off, DC:DC + 16] = sc.view(torch.uint8)
    poison_allocator()
    config = {**VARIANTS[variant], **({} if splits is None else {"SPLITS": splits})}
    out, lse = g.launch(q, cache, table, seq_lens, SCALE, DC, config=config)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, cache, table, seq_lens)
    assert_attention_close(out, lse, ref, ref_lse, BF, tol=TOL, lse_atol=5e-2)


@pytest.mark.cuda
@needs_sm90
def test_the_backend_runs_the_kernel_strided_caches_too_and_falls_back_elsewhere():
    """Backend "gluon64" is the kernel bit for bit; pages inside a larger buffer (a strided cache: plain loads,
    no TMA descriptor needed) give the same bits; pages of 32 rows run ``mla::decode_fp8_gluon``."""
    from mla_compile.ops.triton import fp8_decode_gluon64 as g

    q, cache, table, seq_lens = _inputs([900, 0, 333], 128, 1, 64, seed=5)
    got = decode_fp8(q, cache, table, seq_lens, SCALE, backend="gluon64")
    want = g.launch(q, cache, table, seq_lens, SCALE, DC)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    wide = torch.full((cache.shape[0], 128, cache.shape[2]), 0xFF, dtype=torch.uint8, device="cuda")
    wide[:, :64] = cache
    strided = wide[:, :64]
    assert g.eligible(q, strided, DC)
    got = torch.ops.mla.decode_fp8_gluon64(q, strided, table, seq_lens, SCALE, DC)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    q, cache, table, seq_lens = _inputs([900, 0, 333], 16, 1, 32, seed=6)
    assert not g.eligible(q, cache, DC)
    got = torch.ops.mla.decode_fp8_gluon64(q, cache, table, seq_lens, SCALE, DC)
    want = torch.ops.mla.decode_fp8_gluon(q, cache, table, seq_lens, SCALE, DC)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.cuda
@needs_sm90
def test_gluon64_fp8_decode_opcheck():
    import mla_compile.ops.triton.fp8_decode_gluon64  # noqa: F401

    q, cache, table, seq_lens = _inputs([70, 0, 130], 16, 2, 64, seed=1)
    opcheck(torch.ops.mla.decode_fp8_gluon64.default, (q, cache, table, seq_lens, SCALE, DC))


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("H", [16, 128])
def test_compiled_and_graph_replay_through_the_op(H):
    """``decode_fp8(..., backend="gluon64")`` under torch.compile(fullgraph) and captured in a CUDA graph:
    replays take new lengths and queries (nothing read on the host)."""
    B = 12
    gen = torch.Generator().manual_seed(8)
    q, cache, table, seq_lens = _inputs(lens_with_empty(B, 1500, gen), H, 1, 64, seed=8)
    step = torch.compile(lambda q, t, s: decode_fp8(q, cache, t, s, SCALE, backend="gluon64"), fullgraph=True)
    out, lse = step(q, table, seq_lens)
    ref, ref_lse = _reference(q, cache, table, seq_lens)
    assert_attention_close(out, lse, ref, ref_lse, BF, tol=TOL, lse_atol=LSE_ATOL)

    st = {"q": q.clone(), "lens": seq_lens.clone()}
    graph, (out, lse) = capture(lambda: step(st["q"], table, st["lens"]))
    for _ in range(3):
        new = torch.tensor(lens_with_empty(B, 1500, gen), dtype=torch.int32, device="cuda")
        st["lens"].copy_(torch.minimum(new, seq_lens))  # within each sequence's written positions
        st["q"].copy_(torch.randn(B, 1, H, DC + DR, generator=gen).to("cuda", BF))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = _reference(st["q"], cache, table, st["lens"])
        assert_attention_close(out, lse, ref, ref_lse, BF, tol=TOL, lse_atol=LSE_ATOL)


def test_declaration_serves_only_sm90_bf16_deepseek_pages_of_64():
    """What the selector lets backend "gluon64" serve (no GPU needed: facts given), and that "auto" takes it only
    where the measured timings say so (the shipped H200 table, BENCHMARKS run 232: at 128 heads above 2
    sequences, the 16-row "gluon" below; at 16 heads to 2 sequences only, "gluon" above)."""
    spec = backends_for("decode_fp8")["gluon64"]
    assert spec.gpu_tested

    facts = sm90_facts

    if HAS_TRITON:
        assert why_not(spec, facts()) is None
        assert why_not(spec, facts(block_size=128, query_len=2, num_heads=16)) is None
        assert why_not(spec, facts(packed_rows=False)) is None  # plain loads: pages inside a larger buffer too
    for bad in (dict(cap=(10, 0)), dict(cap=(8, 9)), dict(dtype=torch.float16), dict(cache_dtype=BF),
                dict(block_size=32), dict(head_dims=(512, 32)), dict(cache_align=8)):
        assert why_not(spec, facts(**bad)) is not None, bad
    if HAS_TRITON:
        assert select("decode_fp8", facts()).name == "split:gluon:2/gluon64"
        assert select("decode_fp8", facts(num_heads=16)).name == "split:gluon64:2/gluon"


def _compile_sm90(consts):
    """The sm_90 compile of the kernel, its pointers, the q strides and the cache strides 16-byte divisible as
    the JIT specializes them for a real launch (``consts``: every constexpr, the variants' flags included; ``PDL``
    False unless given)."""
    from mla_compile.ops.triton import fp8_decode_gluon64 as g

    consts = {"PDL": False, **consts}
    types = dict(q_ptr="*bf16", kv_ptr="*u8", bt_ptr="*i32", seq_lens_ptr="*i32", lse_ptr="*fp32",
                 o_ptr="*bf16" if consts["DIRECT"] else "*fp32", scale_log2="fp32")
    if consts.get("TMA_OUT"):
        from mla_compile.ops.triton._bf16_tma import BOX_SL

        types["desc_o"] = f"tensordesc<bf16[8, 64, 64],{BOX_SL!r}>"
    return gluon_sm90(g.decode_fp8_gluon64_kernel, consts, g.NUM_WARPS, types, ("stride_q", "stride_k"))


@sm90_compile
def test_sm90_compile_tma_out():
    """The kernel with ``TMA_OUT`` (one split, its default variants): the output rows by one TMA copy
    (``check_tma_out``)."""
    from mla_compile.ops.triton import fp8_decode_gluon64 as g

    base = dict(DC=512, DR=64, BLOCK_SIZE=64, DIRECT=True, **g.DEFAULTS)
    check_tma_out(_compile_sm90(base), _compile_sm90(dict(base, TMA_OUT=True)))


def _loop_sass(compiled) -> str:
    """The SASS of the kernel's tile loop (between the loop's head and its backward branch)."""
    import re
    import subprocess
    import tempfile

    from mla_compile.ops.triton._sm90 import cuobjdump

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    lines = sass.splitlines()
    addr = {int(m.group(1), 16): i for i, line in enumerate(lines) if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line))}
    loops = [(addr[int(m.group(2), 16)], i) for i, line in enumerate(lines)
             if (m := re.search(r"/\*([0-9a-f]{4,})\*/.*\bBRA 0x([0-9a-f]+)", line))
             and int(m.group(2), 16) < int(m.group(1), 16) and int(m.group(2), 16) in addr]
    first, last = max(loops, key=lambda r: r[1] - r[0])  # the tile loop: the longest backward branch
    return "\n".join(lines[first:last + 1])


def _skipped_fmuls(loop: str) -> dict[str, tuple[str, str, str]]:
    """The FMULs that the forward branch after the loop's warp vote (``RESCALE_SKIP``) jumps over: their
    ``(destination, first, second)`` registers by destination."""
    lines = loop.splitlines()
    vote = next(i for i, line in enumerate(lines) if "VOTE.ANY" in line)
    i, m = next((i, m) for i, line in enumerate(lines[vote:], vote)
                if (m := re.search(r"/\*([0-9a-f]{4,})\*/.*\bBRA 0x([0-9a-f]+)", line)))
    target = int(m.group(2), 16)
    assert target > int(m.group(1), 16), "the vote's branch goes backward"
    skipped = []
    for line in lines[i + 1:]:
        a = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if a and int(a.group(1), 16) >= target:
            break
        skipped.append(line)
    fmuls = [re.search(r" FMUL (R\d+), (R\d+), (R\d+)", line) for line in skipped if " FMUL " in line]
    return {m.group(1): m.groups() for m in fmuls if m}


@sm90_compile
@pytest.mark.parametrize("variant,direct,block_size", [  # every variant; each setting by none or all of them
    (v, d, bs) for v in VARIANTS for d in (False, True) for bs in (64, 128)
    if (v == "PLAIN" and d == (bs == 128)) or (v == "ALL_VARIANTS" and d != (bs == 128))
    or (v not in ("PLAIN", "ALL_VARIANTS") and not d and bs == 64)])
def test_sm90_compile_resources(direct, block_size, variant):
    """The kernel compiles for sm_90 with 8 warps, at most 255 registers a thread (two warpgroups fit one SM's
    register file), no spill inside the tile loop (at most one 8-byte slot outside it, written before the loop and
    read after it: ptxas keeps one epilogue value there in some variants), shared memory of its buffers' formula plus
    under 1 KB of scratch and within an SM's 227 KB; the dots (S twice: the first tile and the loop, 36 k-steps each;
    P V, 4) are there, no TMA copies, and the tile loop holds its S and P V dots, one tile's 16-byte loads (eight of
    codes, one of scales, two of rope), the L2 prefetches and at most five CTA barriers (the row maxima across
    warpgroups, P, the slot's release: the dequantized tile's single store needs none of its own). Each variant too:
    ``MAX_XCHG`` with three CTA barriers (one for the row maxima), ``RESCALE_SKIP`` with its warp vote and the branch
    around O's 128 multiplies a thread, ``CVT_BF16`` with its bf16x2 dequantization (no fp32 products)."""
    from mla_compile.ops.triton import fp8_decode_gluon64 as g
    from mla_compile.ops.triton._sm90 import resources

    flags = {k: VARIANTS[variant].get(k, False) for k in g.VARIANTS}
    compiled = _compile_sm90(dict(DC=DC, DR=DR, BLOCK_SIZE=block_size, DIRECT=direct, **flags))
    assert compiled.metadata.num_warps == 8
    # the query rows' latent and rope parts loaded in one round trip (16 bytes a load, every thread's share)
    assert longest_load_run(compiled.asm["ptx"]) >= 64 * (DC + DR) * 2 // 16 // (32 * 8)
    shared = compiled.metadata.shared
    assert g.smem_bytes() <= shared < g.smem_bytes() + 1024
    assert shared <= 227 * 1024
    res = resources(compiled)
    assert res["stack"] <= (8 if variant in ("PLAIN", "RESCALE_SKIP") else 16), res  # outside the loop
    assert res["regs"] <= 255, res
    assert res["HGMMA"] == 2 * (DC + DR) // 16 + 64 // 16, res
    assert res["UTMALDG"] == 0, res
    loop = _loop_sass(compiled)
    assert loop.count("LDG.E.128") == 8 + 1 + 2, loop.count("LDG.E.128")  # codes, scales, rope
    assert "UBLKPF.L2" in loop
    assert "STL" not in loop and "LDL" not in loop, "a spill inside the tile loop"
    assert loop.count("HGMMA") == (DC + DR) // 16 + 64 // 16
    assert loop.count("BAR.SYNC") <= (3 if flags["MAX_XCHG"] else 5), loop.count("BAR.SYNC")
    if flags["RESCALE_SKIP"]:
        fmuls = _skipped_fmuls(loop)
        assert len(fmuls) == 64 * DC // 256, len(fmuls)  # O's accumulators a thread
        # each accumulator times one of its thread's two rows' alphas (not another accumulator)
        assert all(d == a and m not in fmuls for d, a, m in fmuls.values()), fmuls
        assert len({m for _, _, m in fmuls.values()}) == 2, fmuls
    if flags["CVT_BF16"]:
        assert loop.count("HFMA2.BF16") == 64 and loop.count("PRMT") >= 64, loop.count("HFMA2.BF16")
        assert "HADD2.F32" not in loop


@sm90_compile
@pytest.mark.parametrize("pdl", [False, True])
def test_sm90_compile_pdl(pdl):
    """With ``PDL`` (the launch an sm_90 device gets) every program waits for the kernel before it ahead of its
    first global load, then lets the next kernel be scheduled; without it, neither instruction is there; no more
    spill either way than the resources test allows the default variant."""
    from mla_compile.ops.triton import fp8_decode_gluon64 as g

    from mla_compile.ops.triton._sm90 import cuobjdump, resources

    compiled = _compile_sm90(dict(DC=DC, DR=DR, BLOCK_SIZE=64, DIRECT=False, PDL=pdl, **g.DEFAULTS))
    if cuobjdump() is not None:
        assert resources(compiled)["stack"] <= 8, resources(compiled)  # as without PDL (the default variant)
    assert_pdl_order(compiled.asm["ptx"], pdl)


@sm90_compile
@pytest.mark.parametrize("variant", ["default", "ALL_VARIANTS"])
@pytest.mark.parametrize("splits", [1, 3])
def test_sm90_compile_of_the_launch(monkeypatch, splits, variant):
    """``launch``'s own call (recorded on CPU tensors: 128 heads, MTP rows, pages of 128 inside a larger buffer)
    binds every kernel argument and compiles for sm_90 with the launch's constexprs and warps; with several
    splits it writes the fp32 workspaces and the reduce kernel merges them; the config's variant flags reach
    the kernel as constexprs (``DEFAULTS`` where the config names none)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_compile.ops.triton import fp8_decode_gluon64 as g
    from mla_compile.ops.triton._sm90 import signature

    launches = record_gluon_launches(monkeypatch, g, "decode_fp8_gluon64_kernel")
    gen = torch.Generator().manual_seed(2)
    cache, table, seq_lens, _ = fp8_paged([300, 0, 129], 128, DC, DR, "cpu", gen)
    wide = torch.zeros(cache.shape[0], 256, cache.shape[2], dtype=torch.uint8)
    wide[:, :128] = cache
    q = torch.randn(3, 2, 128, DC + DR, generator=gen).to(BF)
    flags = {} if variant == "default" else VARIANTS[variant]  # "default": the config names no flag
    out, lse = g.launch(q, wide[:, :128], table, seq_lens, SCALE, DC, config={"SPLITS": splits, **flags})
    assert out.shape == (3, 2, 128, DC) and lse.shape == (3, 2, 128)
    kernel, grid, args, kwargs = launches[0]
    assert grid == (4, splits, 3)
    assert len(launches) == (1 if splits == 1 else 2)
    assert kwargs["DIRECT"] == (splits == 1) and kwargs["BLOCK_SIZE"] == 128
    assert {k: kwargs[k] for k in g.VARIANTS} == VARIANTS[variant]
    assert g.DEFAULTS == VARIANTS["default"]
    assert args[4].dtype == (BF if splits == 1 else torch.float32)
    sig, consts, attrs = signature(kernel, args, kwargs)
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=kwargs["num_warps"]))
    assert compiled.metadata.num_warps == 8 and compiled.metadata.shared <= 227 * 1024
