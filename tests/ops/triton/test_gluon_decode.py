"""The sm_90 Gluon bf16 decodes (``ops/triton/decode_gluon.py``, backends "gluon" and "gluon-ws" of
``mla::decode``).

On any machine with Triton: their sm_90 compiles (shared memory within an SM's 227 KB, spills, warps, the
dots and TMA copies there) and their declarations (what the selector lets them serve; "auto" never picks them
before their GPU run). On an sm_90 GPU, for each kernel (64 rows a program in its two schedules, the swapped
16-row one, the warp-specialized one, the alternating one, the persistent forms of the swapped and alternating
ones): shapes against a float64 softmax written here (NaN-poisoned cache rows and outputs, empty sequences, lengths
off the tile size, several splits and one, MTP rows, pages of 64 and 128), the op's fallback for a strided cache,
opcheck, torch.compile and CUDA-graph replay through ``mla_compile.ops.decode(..., backend=...)``."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch.library import opcheck

import mla_compile  # noqa: F401
from mla_compile.ops import decode
from mla_compile.ops.registry import backends_for
from mla_compile.ops.select import select, why_not
from tests.cuda_capture import capture
from _sparse_test_util import lens_with_empty
from _triton_test_util import (assert_attention_close, check_tma_out, gluon_sm90, longest_load_run, paged_cache,
                               poison_allocator, sm90_compile, sm90_facts)

HAS_TRITON = importlib.util.find_spec("triton") is not None
SCALE = 1 / math.sqrt(192)
DC, DR = 512, 64
BF = torch.bfloat16


def _sm90() -> bool:
    return HAS_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU and triton")


def _softmax64(q, cache, table, seq_lens, scale):
    """float64 absorbed-MLA decode from the math: row (i, h) of sequence b sees positions
    ``< seq_lens[b] - (s_q - 1 - i)``; values are the first 512 columns; LSE natural log, -inf and output 0
    for a row that sees nothing."""
    B, s_q, H, _ = q.shape
    bs = cache.shape[1]
    out = torch.zeros(B, s_q, H, DC, dtype=torch.float64, device=q.device)
    lse = torch.full((B, s_q, H), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        rows = cache[table[b, pos // bs].long(), pos % bs].double()  # [n, 576]
        s = torch.einsum("ihd,nd->ihn", q[b].double(), rows) * scale
        limit = n - (s_q - 1 - torch.arange(s_q, device=q.device))
        s = s.masked_fill(pos[None, None, :] >= limit[:, None, None], float("-inf"))
        m = torch.logsumexp(s, dim=-1)
        seen = m.isfinite()
        p = torch.where(seen[..., None], torch.exp(s - m[..., None]), 0.0)
        out[b] = torch.einsum("ihn,nd->ihd", p, rows[:, :DC])
        lse[b] = m
    return out, lse


def _inputs(lens, H, s_q, bs, seed):
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens = paged_cache(lens, bs, DC + DR, BF, device="cuda", gen=gen)
    q = torch.randn(len(lens), s_q, H, DC + DR, generator=gen).to("cuda", BF)
    return q, cache, table, seq_lens


def _check(lens, H, s_q, bs, seed, config=None, kernel="plain"):
    from mla_compile.ops.triton import decode_gluon

    q, cache, table, seq_lens = _inputs(lens, H, s_q, bs, seed)
    assert decode_gluon.eligible(q, cache, DC)
    poison_allocator()
    config = dict(config or {}, **KERNEL_CONFIG[kernel])
    out, lse = decode_gluon.launch(q, cache, table, seq_lens, SCALE, DC, config=config)
    torch.cuda.synchronize()
    ref, ref_lse = _softmax64(q, cache, table, seq_lens, SCALE)
    assert_attention_close(out, lse, ref, ref_lse, BF)


_SHAPES = [  # B, H, s_q, max_len, bs, SPLITS (None: the plan's)
    (6, 16, 1, 3000, 64, None),     # an empty sequence, lengths off the tile size
    (6, 16, 1, 3000, 64, 1),        # one split: the result written directly
    (6, 16, 1, 3000, 64, 3),        # three splits merged by the reduce kernel
    (1, 16, 1, 16384, 64, None),    # one long sequence: many splits
    (300, 16, 1, 700, 64, None),    # more programs than SMs: one split
    (5, 128, 1, 2500, 64, None),    # 128 heads: two 64-row programs a sequence
    (4, 128, 1, 2000, 64, 1),
    (5, 16, 2, 1000, 64, None),     # MTP: 32 rows, queries of the last position see one key more
    (3, 128, 2, 1500, 128, None),   # MTP with 256 rows, pages of 128
    (3, 128, 2, 1500, 128, 1),      # the same in one split (the seesaw's output through TMA)
    (70, 128, 1, 300, 64, None),    # 140 programs, one split (the seesaw's TMA output), empty sequences among them
    (2, 40, 2, 900, 64, 2),         # 80 rows: a full and a partial program, both query positions in one
    (7, 16, 1, 3000, 128, None),    # pages of 128
    (4, 16, 1, 63, 64, None),       # sequences shorter than one tile
]


# "plain": decode_gluon_kernel (8 warps in step, its default schedule PIPE=False); "pipe": the same kernel with
# the PIPE schedule; "swap": decode_gluon_swap_kernel (16 rows a program, operands swapped: forced
# here for every shape, "gluon"'s default for at most 16 rows); "ws": decode_gluon_ws_kernel (warp-specialized);
# "seesaw": decode_gluon_seesaw_kernel (two alternating warpgroups, no producer; its default FOLD_FIRST order;
# "seesaw-steps": the module docstring's first order, the shape table only).
# Run "plain" first on a new GPU (-k plain), then "swap", "pipe", "ws", "seesaw": a hang in one would stop the
# session (run a kernel's first GPU tests under a timeout).
KERNEL_CONFIG = {"plain": {"WS": False, "SWAP": False}, "pipe": {"WS": False, "SWAP": False, "PIPE": True},
                 "swap": {"WS": False, "SWAP": True}, "swap-early": {"WS": False, "SWAP": True, "EARLY": True},
                 "ws": {"WS": True}, "seesaw": {"SEESAW": True}, "seesaw-tma": {"SEESAW": True, "TMA_OUT": True},
                 "plain-tma": {"WS": False, "SWAP": False, "TMA_OUT": True},
                 "seesaw-steps": {"SEESAW": True, "FOLD_FIRST": False},
                 "seesaw-persist": {"SEESAW": True, "PERSIST": True},
                 "swap-persist": {"WS": False, "SWAP": True, "PERSIST": True}}
# "swap-early": the swapped kernel's copies of older keys started before its PDL wait (on sm_90 every launch has PDL)
# "pipe" (the PIPE schedule, not the default) and "seesaw-steps": the shape table only
# "seesaw-tma": the seesaw's output copies by TMA with several splits too (the float32 partial rows; by default only
# with one split); "plain-tma": the 64-row kernel's one-split rows by TMA (not a default yet)
# "swap-persist": the swapped kernel persistent (decode_gluon_swap_persist: one program an SM over balanced runs of
# tiles, then the merge), at every shape of the tables (any rows a sequence, in 16-row items)
KERNELS = ["plain", "plain-tma", "swap", "swap-early", "ws", "seesaw", "seesaw-tma", "swap-persist"]


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("kernel", ["pipe"] + KERNELS + ["seesaw-steps"])
@pytest.mark.parametrize("B,H,s_q,max_len,bs,splits", _SHAPES)
def test_gluon_decode_shapes(kernel, B, H, s_q, max_len, bs, splits):
    gen = torch.Generator().manual_seed(B * 7 + H + s_q)
    lens = lens_with_empty(B, max_len, gen)
    _check(lens, H, s_q, bs, seed=B + H, config=None if splits is None else {"SPLITS": splits}, kernel=kernel)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lens", [[0, 0, 0], [1, 0, 65], [64, 128, 129, 1], [200, 130, 250]])
@pytest.mark.parametrize("s_q", [1, 2])
def test_gluon_decode_short_and_empty(kernel, lens, s_q):
    """Splits with no tile, one tile, one partial tile, two and three tiles (each consumer's first and last
    tile of the warp-specialized kernel): every row written, -inf LSE where nothing is seen (s_q = 2 with one
    key: the first query position sees nothing)."""
    _check(lens, 16, s_q, 64, seed=3, kernel=kernel)
    _check(lens, 16, s_q, 64, seed=4, config={"SPLITS": 4}, kernel=kernel)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale", [-SCALE, 2.0])
def test_gluon_decode_any_scale(kernel, scale):
    from mla_compile.ops.triton import decode_gluon

    q, cache, table, seq_lens = _inputs([700, 300, 5], 16, 1, 64, seed=8)
    out, lse = decode_gluon.launch(q, cache, table, seq_lens, scale, DC, config=KERNEL_CONFIG[kernel])
    ref, ref_lse = _softmax64(q, cache, table, seq_lens, scale)
    assert_attention_close(out, lse, ref, ref_lse, BF, lse_atol=2e-2 * max(1.0, abs(scale) / SCALE))


BACKENDS = {"gluon": {}, "gluon-ws": {"WS": True}, "gluon-seesaw": {"SEESAW": True},  # backend -> its launch config
            "gluon-seesaw-persist": {"SEESAW": True, "PERSIST": True}, "gluon-persist": {"WS": False, "PERSIST": True}}


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_backend_runs_the_kernel_and_falls_back_for_a_strided_cache(backend):
    """Backends "gluon" / "gluon-ws" / "gluon-seesaw" of ``mla::decode`` are their kernel bit for bit on a
    contiguous cache; pages inside a larger buffer (a strided cache, no TMA descriptor over it) run
    ``mla::decode_triton``."""
    from mla_compile.ops.triton import decode_gluon

    q, cache, table, seq_lens = _inputs([900, 0, 333], 16, 1, 64, seed=5)
    got = decode(q, cache, table, seq_lens, SCALE, backend=backend)
    want = decode_gluon.launch(q, cache, table, seq_lens, SCALE, DC, config=BACKENDS[backend])
    if backend == "gluon":  # 16 rows: the swapped kernel by default
        swapped = decode_gluon.launch(q, cache, table, seq_lens, SCALE, DC, config={"SWAP": True})
        assert all(torch.equal(a, b) for a, b in zip(want, swapped))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    wide = torch.full((cache.shape[0], 128, cache.shape[2]), float("nan"), dtype=BF, device="cuda")
    wide[:, :64] = cache
    strided = wide[:, :64]
    assert not decode_gluon.eligible(q, strided, DC)
    got = decode(q, strided, table, seq_lens, SCALE, backend=backend)
    want = torch.ops.mla.decode_triton(q, strided, table, seq_lens, SCALE, DC)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("op,H", [("decode_gluon", 16), ("decode_gluon_ws", 16), ("decode_gluon_seesaw", 16),
                                  ("decode_gluon_seesaw", 128), ("decode_gluon_seesaw_persist", 128),
                                  ("decode_gluon_persist", 16)])
def test_gluon_decode_opcheck(op, H):
    """opcheck of the ops; the seesaw at 128 heads over 70 sequences runs one split (its output's TMA store), the
    persistent one its pieces and merge."""
    import mla_compile.ops.triton.decode_gluon  # noqa: F401

    lens = [70, 0, 130] if H == 16 else lens_with_empty(70, 200, torch.Generator().manual_seed(1))
    q, cache, table, seq_lens = _inputs(lens, H, 2 if H == 16 else 1, 64, seed=1)
    opcheck(getattr(torch.ops.mla, op).default, (q, cache, table, seq_lens, SCALE, DC))


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("backend,B,H", [(b, 12, 16) for b in BACKENDS] + [("gluon-seesaw", 70, 128),
                                                                          ("gluon-seesaw-persist", 70, 128)])
def test_compiled_and_graph_replay_through_the_op(backend, B, H):
    """``decode(..., backend=...)`` under torch.compile(fullgraph) and captured in a CUDA graph: replays take
    new lengths and queries (nothing read on the host); the seesaw at 128 heads over 70 sequences in one split (its
    output's TMA store into the captured output)."""
    gen = torch.Generator().manual_seed(8)
    q, cache, table, seq_lens = _inputs(lens_with_empty(B, 1500, gen), H, 1, 64, seed=8)
    step = torch.compile(lambda q, t, s: decode(q, cache, t, s, SCALE, backend=backend), fullgraph=True)
    out, lse = step(q, table, seq_lens)
    ref, ref_lse = _softmax64(q, cache, table, seq_lens, SCALE)
    assert_attention_close(out, lse, ref, ref_lse, BF)

    st = {"q": q.clone(), "lens": seq_lens.clone()}
    graph, (out, lse) = capture(lambda: step(st["q"], table, st["lens"]))
    for _ in range(3):
        new = torch.tensor(lens_with_empty(B, 1500, gen), dtype=torch.int32, device="cuda")
        st["lens"].copy_(torch.minimum(new, seq_lens))  # within each sequence's written positions
        st["q"].copy_(torch.randn(B, 1, H, DC + DR, generator=gen).to("cuda", BF))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = _softmax64(st["q"], cache, table, st["lens"], SCALE)
        assert_attention_close(out, lse, ref, ref_lse, BF)


# "seesaw-persist": decode_gluon_seesaw_persist (one program an SM over balanced runs of tiles, then the merge);
# only for whole 64-row blocks of query rows, so its own shapes. Its first GPU run: run these under a timeout first.
_PERSIST_SHAPES = [  # lens (a list, or (B, max_len): drawn with empty sequences among them), H, s_q, page size
    ([16384], 128, 1, 64),              # one sequence over every program: each piece part of it, all merged
    ((5, 2500), 128, 1, 64),            # a few sequences, each split between programs
    ((128, 1100), 128, 1, 64),          # 256 items over the SMs: whole items and split ones
    ((400, 64), 64, 1, 64),             # items of one tile: the next piece's tile 1 started when a piece starts
    ((300, 200), 128, 1, 128),          # items of 1-4 tiles, pages of 128
    ((3, 1500), 128, 2, 128),           # MTP rows (256 a sequence)
    ([0, 0, 0], 128, 1, 64),            # no tile at all: every row 0 / -inf, written by the merge
    ([1, 0, 65, 64, 128, 129], 64, 4, 64),  # MTP over short sequences: rows that see no key in a piece
]


_SWAP_PERSIST_SHAPES = [  # as _PERSIST_SHAPES, for the persistent swapped kernel (16-row items)
    ([16384], 16, 1, 64),               # one sequence over every program
    ((128, 2000), 16, 1, 64),           # #27's H=16 row's batch: 128 items over the SMs
    ((256, 1100), 16, 1, 64),           # #28's batch: one balanced pass instead of two waves
    ((400, 64), 16, 1, 64),             # items of one tile
    ((50, 300), 16, 1, 128),            # pages of 128
    ((3, 700), 20, 2, 64),              # 40 rows a sequence: row blocks of 16, 16 and 8
]


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("kernel,lens,H,s_q,bs", [("seesaw-persist", *c) for c in _PERSIST_SHAPES]
                         + [("swap-persist", *c) for c in _SWAP_PERSIST_SHAPES])
def test_persistent_shapes(kernel, lens, H, s_q, bs):
    gen = torch.Generator().manual_seed(H + s_q + bs)
    if isinstance(lens, tuple):
        lens = lens_with_empty(lens[0], lens[1], gen)
    _check(lens, H, s_q, bs, seed=len(lens) + H, kernel=kernel)


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("kernel,B,H", [("seesaw-persist", 70, 128), ("swap-persist", 200, 16)])
def test_persistent_graph_replay(kernel, B, H):
    """``decode_gluon.launch(..., PERSIST)`` captured in a CUDA graph: replays take new lengths and queries (the
    schedule is found from the lengths on the device, nothing read on the host; the workspaces are the graph's)."""
    from mla_compile.ops.triton import decode_gluon

    gen = torch.Generator().manual_seed(9)
    q, cache, table, seq_lens = _inputs(lens_with_empty(B, 1500, gen), H, 1, 64, seed=9)
    st = {"q": q.clone(), "lens": seq_lens.clone()}
    graph, (out, lse) = capture(lambda: decode_gluon.launch(st["q"], cache, table, st["lens"], SCALE, DC,
                                                            config=KERNEL_CONFIG[kernel]))
    for _ in range(3):
        new = torch.tensor(lens_with_empty(B, 1500, gen), dtype=torch.int32, device="cuda")
        st["lens"].copy_(torch.minimum(new, seq_lens))  # within each sequence's written positions
        st["q"].copy_(torch.randn(B, 1, H, DC + DR, generator=gen).to("cuda", BF))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = _softmax64(st["q"], cache, table, st["lens"], SCALE)
        assert_attention_close(out, lse, ref, ref_lse, BF)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_the_swapped_kernel_is_the_default_for_few_rows_a_sequence_or_in_all():
    from mla_compile.ops.triton import decode_gluon as g

    assert g.swap_by_default(256, 16) and g.swap_by_default(1, 16) and g.swap_by_default(3, 8)
    assert g.swap_by_default(1, 128) and g.swap_by_default(2, 128) and g.swap_by_default(1, 256)  # 128 heads
    assert g.swap_by_default(3, 80) and not g.swap_by_default(4, 80)  # 40 heads x 2 query positions
    assert not g.swap_by_default(3, 128) and not g.swap_by_default(64, 128) and not g.swap_by_default(2, 256)
    # a config key the kernels do not have (e.g. a removed variant) is refused before anything is launched
    q = torch.randn(1, 1, 16, 576)
    with pytest.raises(ValueError, match=r"unknown config keys \['FUSED_REDUCE'\]"):
        g.launch(q, torch.randn(1, 64, 576), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                 1.0, 512, config={"FUSED_REDUCE": True})


@pytest.mark.parametrize("backend", ["gluon", "gluon-ws", "gluon-seesaw"])
def test_declaration_serves_only_sm90_bf16_deepseek_pages_of_64(backend):
    """What the selector lets backends "gluon" / "gluon-ws" / "gluon-seesaw" serve (no GPU needed: facts given),
    and that "auto" takes them where the measured timings say so: the shipped H200 table (BENCHMARKS run 231) has
    "gluon" the fastest at 16 heads; at 128 heads, where no peer library is installed, "gluon" up to 2 sequences
    and "gluon-seesaw" above, split on the batch inside one graph (the selector tests cover the picks with the
    peers: FlashInfer / FlashMLA at 128 heads)."""
    spec = backends_for("decode")[backend]
    assert spec.gpu_tested

    def facts(**kw):
        return sm90_facts(**{"cache_dtype": BF, "cache_align": 128, **kw})

    if HAS_TRITON:
        assert why_not(spec, facts()) is None
        assert why_not(spec, facts(block_size=128, query_len=2)) is None
    for bad in (dict(cap=(10, 0)), dict(cap=(8, 0)), dict(dtype=torch.float16, cache_dtype=torch.float16),
                dict(cache_dtype=torch.float16), dict(block_size=32), dict(head_dims=(512, 32)),
                dict(packed_rows=False)):
        assert why_not(spec, facts(**bad)) is not None, bad
    if HAS_TRITON:
        assert select("decode", facts(num_heads=16)).name == "gluon"
        if not any(importlib.util.find_spec(m) for m in ("flash_mla", "flashinfer")):
            assert select("decode", facts()).name == "split:gluon:2/gluon-seesaw"


def _compile_sm90(kernel, consts, warps):
    """The sm_90 compile of one of the module's kernels, its pointers and the q strides 16-byte divisible as the
    JIT specializes them for a real launch."""
    from mla_compile.ops.triton import decode_gluon as g

    types = dict(q_ptr="*bf16", bt_ptr="*i32", seq_lens_ptr="*i32", lse_ptr="*fp32",
                 o_ptr="*bf16" if consts["DIRECT"] else "*fp32", scale_log2="fp32",
                 desc_c=f"tensordesc<bf16[8, 64, 64],{g.BOX_SL!r}>", desc_r=f"tensordesc<bf16[64, 64],{g.SMEM_SL!r}>",
                 desc_o=f"tensordesc<bf16[8, 64, 64],{g.BOX_SL!r}>")
    if not consts.get("TMA_OUT"):
        types.pop("desc_o")
    return gluon_sm90(kernel, consts, warps, types, ("stride_q",))


@sm90_compile
def test_sm90_compile_tma_out():
    """``decode_gluon_kernel`` with ``TMA_OUT`` (one split): its output rows by one TMA copy (``check_tma_out``)."""
    from mla_compile.ops.triton import decode_gluon as g

    base = dict(DC=DC, DR=DR, BLOCK_SIZE=64, DIRECT=True, PIPE=False)
    check_tma_out(_compile_sm90(g.decode_gluon_kernel, base, g.NUM_WARPS),
                  _compile_sm90(g.decode_gluon_kernel, dict(base, TMA_OUT=True), g.NUM_WARPS))


@sm90_compile
@pytest.mark.parametrize("block_size,direct,pipe", [  # each pair of the three settings' values once (4 of 8)
    (64, False, True), (64, True, False), (128, False, False), (128, True, True)])
def test_sm90_compile_resources(direct, block_size, pipe):
    """The kernel compiles for sm_90 with 8 warps, no spills, at most 255 registers a thread (two warpgroups
    fit one SM's register file), shared memory of its buffers' formula plus under 1 KB of scratch and within
    an SM's 227 KB; the loop's dots (S twice: the first tile and the loop, 36 k-steps each; P V, 4) and the
    two TMA copies a tile (three places) are there."""
    from mla_compile.ops.triton import decode_gluon as g
    from mla_compile.ops.triton._sm90 import resources

    compiled = _compile_sm90(g.decode_gluon_kernel,
                             dict(DC=DC, DR=DR, BLOCK_SIZE=block_size, DIRECT=direct, PIPE=pipe), g.NUM_WARPS)
    assert compiled.metadata.num_warps == 8
    shared = compiled.metadata.shared
    assert g.smem_bytes() <= shared < g.smem_bytes() + 1024
    assert shared <= 227 * 1024
    res = resources(compiled)
    assert res["stack"] == 0 and res["LDL"] == 0 and res["STL"] == 0, res
    assert res["regs"] <= 255, res
    assert res["HGMMA"] == 2 * (DC + DR) // 16 + 64 // 16, res
    assert res["UTMALDG"] == 6, res
    # the query rows' latent and rope parts loaded in one round trip (16 bytes a load, every thread's share)
    assert longest_load_run(compiled.asm["ptx"]) >= 64 * (DC + DR) * 2 // 16 // (32 * g.NUM_WARPS)


@sm90_compile
@pytest.mark.parametrize("direct", [False, True])
def test_sm90_compile_resources_warp_specialized(direct):
    """The warp-specialized kernel compiles for sm_90: 4 producer warps and two 4-warp consumers (12 warps),
    shared memory of its formula plus under 1 KB of captured arguments, within 227 KB; the consumers spill
    little (at most 160 bytes of stack: constant parts of the S dot's descriptors reloaded in consumer 0's
    loop); each consumer's dots are there (consumer 0: tile 0's S and P V, then per own tile S and two P V,
    the last tile's P V; consumer 1 the same without tile 0's) and the producer's two TMA copies."""
    from mla_compile.ops.triton import decode_gluon as g
    from mla_compile.ops.triton._sm90 import resources

    compiled = _compile_sm90(g.decode_gluon_ws_kernel, dict(DC=DC, DR=DR, BLOCK_SIZE=64, DIRECT=direct),
                             g.WS_WARPS)
    assert compiled.metadata.num_warps == 12
    shared = compiled.metadata.shared
    assert g.smem_bytes(ws=True) <= shared < g.smem_bytes(ws=True) + 1024
    assert shared <= 227 * 1024
    res = resources(compiled)
    assert res["stack"] <= 160, res
    s_dot, pv = (DC + DR) // 16, 64 // 16
    assert res["HGMMA"] == (s_dot + pv + s_dot + 2 * pv + pv) + (s_dot + 2 * pv + pv), res
    assert res["UTMALDG"] == 2, res


@sm90_compile
@pytest.mark.parametrize("block_size,direct,pdl,early", [(64, False, True, False), (128, True, False, False),
                                                         (64, False, True, True)])  # each value once
def test_sm90_compile_resources_swapped(direct, block_size, pdl, early):
    """The swapped kernel compiles for sm_90 with 4 warps, 16 query rows a program, no spills, shared memory of
    its formula plus under 1 KB (two programs do not fit an SM: one, as the launch plans); its dots (S^T twice,
    36 k-steps each; O^T's 8 blocks of 64 value columns times 4 k-steps) and the two TMA copies a tile (three
    places; five with ``EARLY``: the first two tiles' copies before and after the wait) are there; with ``PDL``
    (the launch an sm_90 device gets) the wait and the trigger, without neither."""
    from mla_compile.ops.triton import decode_gluon as g
    from mla_compile.ops.triton._sm90 import resources

    compiled = _compile_sm90(g.decode_gluon_swap_kernel, dict(DC=DC, DR=DR, BLOCK_SIZE=block_size, DIRECT=direct,
                                                             BLOCK_R=g.SWAP_ROWS, PDL=pdl, EARLY=early),
                             g.SWAP_WARPS)
    for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
        assert (instruction in compiled.asm["ptx"]) is pdl, instruction
    assert compiled.metadata.num_warps == 4
    shared = compiled.metadata.shared
    assert g.smem_bytes(swap=True) <= shared < g.smem_bytes(swap=True) + 1024
    assert 227 * 1024 // 2 < shared <= 227 * 1024
    res = resources(compiled)
    assert res["stack"] == 0 and res["LDL"] == 0 and res["STL"] == 0, res
    assert res["HGMMA"] == 2 * (DC + DR) // 16 + (DC // 64) * (64 // 16), res
    assert res["UTMALDG"] == (10 if early else 6), res


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("s_q", [1, 2])
def test_swapped_early_copies_see_the_keys_the_kernel_before_writes(s_q):
    """``EARLY`` starts a program's first copies before its PDL wait, but only of tiles that end before the step's
    new keys: here the kernel launched directly before (``mla::write_latent_cache_fused``, itself under PDL) writes
    those keys over NaN rows, eagerly and in a replayed CUDA graph with new keys each replay; the decode equals the
    float64 one over the written cache (a tile copied too early would carry the NaNs into its rows)."""
    from mla_compile.ops.triton import decode_gluon

    lens = [64 * 3, 64 * 3 + 1, 2, 0, 130, 64 * 40 + 5]  # new keys ending a tile, opening one, short, empty, long
    q, cache, table, seq_lens = _inputs(lens, 16, s_q, 64, seed=21)
    gen = torch.Generator().manual_seed(22)
    slots = torch.full((len(lens) * s_q,), -1, dtype=torch.int64)
    for b, n in enumerate(lens):
        for i in range(s_q):
            pos = n - s_q + i
            if pos >= 0:
                slots[b * s_q + i] = int(table[b, pos // 64]) * 64 + pos % 64
    slots = slots.cuda()
    live = slots[slots >= 0]
    T = slots.shape[0]
    w = torch.randn(DC, generator=gen).to("cuda", BF)
    cos, sin = (torch.randn(T, DR // 2, generator=gen).cuda() for _ in range(2))
    src = {"lat": torch.empty(T, DC, dtype=BF, device="cuda"), "kpe": torch.empty(T, DR, dtype=BF, device="cuda")}

    def fresh(seed):
        g = torch.Generator().manual_seed(seed)
        src["lat"].copy_(torch.randn(T, DC, generator=g))
        src["kpe"].copy_(torch.randn(T, DR, generator=g))
        cache.view(-1, DC + DR)[live] = float("nan")

    def step():
        torch.ops.mla.write_latent_cache_fused(src["lat"], src["kpe"], w, cos, sin, slots, cache, 1e-6, True)
        return decode_gluon.launch(q, cache, table, seq_lens, SCALE, DC, config={"SWAP": True, "EARLY": True})

    fresh(1)
    out, lse = step()
    torch.cuda.synchronize()
    assert not cache.view(-1, DC + DR)[live].isnan().any()
    ref, ref_lse = _softmax64(q, cache, table, seq_lens, SCALE)
    assert_attention_close(out, lse, ref, ref_lse, BF)
    graph, (out, lse) = capture(step)
    for seed in (2, 3):
        fresh(seed)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = _softmax64(q, cache, table, seq_lens, SCALE)
        assert_attention_close(out, lse, ref, ref_lse, BF)
