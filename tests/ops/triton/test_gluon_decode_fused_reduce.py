"""The swapped Gluon bf16 decode with its opt-in in-kernel merge of the splits (``decode_gluon.launch(...,
config={"FUSED_REDUCE": True})``: the last split program of each row block merges the splits, on the arrival
counters of ``_plan.split_counters``, which it sets back to 0).

On any machine: the counters' buffer contract and the refusal of the flag for the other kernels; with Triton's
compiler, its sm_90 compile (no spills, the arrival's fences and atomics there). On an sm_90 GPU: against a
float64 softmax written here (NaN-poisoned cache rows, outputs and workspaces; one split and several, splits
past a short sequence's tiles, empty sequences, MTP rows, 128 heads), the counters back at 0 after every call,
two calls back to back, and many replays of a captured CUDA graph with new lengths and queries."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import mla_compile  # noqa: F401
from mla_compile.ops.triton._plan import split_counters
from tests.cuda_capture import capture
from tests.ops.triton.test_gluon_decode import _softmax64  # the float64 decode from the math
from _sparse_test_util import lens_with_empty
from _triton_test_util import assert_attention_close, paged_cache, poison_allocator, sm90_compile

HAS_TRITON = importlib.util.find_spec("triton") is not None
SCALE = 1 / math.sqrt(192)
DC, DR = 512, 64
BF = torch.bfloat16
FUSED = {"FUSED_REDUCE": True}


def _sm90() -> bool:
    return HAS_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU and triton")


def _inputs(lens, H, s_q, seed, bs=64):
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens = paged_cache(lens, bs, DC + DR, BF, device="cuda", gen=gen)
    q = torch.randn(len(lens), s_q, H, DC + DR, generator=gen).to("cuda", BF)
    return q, cache, table, seq_lens


def _counters_zero(q):
    torch.cuda.synchronize()
    buf = split_counters(q.device, 1)
    assert int(buf.count_nonzero()) == 0, "an arrival counter was left set"


def test_split_counters_grow_and_stay_alive():
    """The counters are zeroed int32, shared while large enough, replaced by a larger zeroed buffer when a call
    needs more (the old one kept: a captured graph may still use it)."""
    dev = torch.device("cpu")
    a = split_counters(dev, 10)
    assert a.dtype == torch.int32 and a.numel() >= 10 and int(a.count_nonzero()) == 0
    assert split_counters(dev, a.numel()) is a
    b = split_counters(dev, a.numel() + 1)
    assert b is not a and b.numel() > a.numel() and int(b.count_nonzero()) == 0
    assert split_counters(dev, 3) is b


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("config", [{"WS": True}, {"SWAP": False}, {"MERGE_GROUP": 3}])
def test_fused_reduce_is_refused_for_the_other_kernels(config):
    from mla_compile.ops.triton import decode_gluon

    q = torch.zeros(1, 1, 16, DC + DR, dtype=BF)
    cache = torch.zeros(2, 64, DC + DR, dtype=BF)
    with pytest.raises(ValueError, match="FUSED_REDUCE|MERGE_GROUP"):
        decode_gluon.launch(q, cache, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                            SCALE, DC, config=dict(config, **FUSED))


_CASES = [  # lens, H, s_q, SPLITS (None: the plan's)
    ([4096], 16, 1, None),            # the B=1 decode step: many splits
    ([4096, 3000], 16, 1, None),      # B=2
    ([4096], 128, 1, None),           # 128 heads: 8 row blocks a sequence, each with its counter
    ([4096], 16, 1, 1),               # one split: the kernel writes the result, nothing to merge
    ([4096], 16, 1, 64),              # the most splits
    ([3000, 0, 1234, 64, 1], 16, 1, 3),  # empty and one-key sequences, lengths off the tile size
    ([1, 0, 65], 16, 1, 8),           # splits past every tile: empty partials
    ([0, 0], 16, 1, 4),               # no keys at all: LSE -inf, output 0
    ([1000, 1, 700], 16, 2, None),    # MTP: 32 rows, two row blocks; one key: the first query sees nothing
    ([4096, 2500], 16, 1, 7),         # groups of 4 splits: 4 and 3
    ([4096], 16, 1, 5),               # groups of 4 splits: 4 and 1
]


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("group", [0, 4])
@pytest.mark.parametrize("lens,H,s_q,splits", _CASES)
def test_fused_reduce_matches_the_reference(lens, H, s_q, splits, group):
    """One merge (MERGE_GROUP 0) and two levels (groups of 4 splits: a last group of fewer where the split count
    is not a multiple of 4)."""
    from mla_compile.ops.triton import decode_gluon

    q, cache, table, seq_lens = _inputs(lens, H, s_q, seed=len(lens) + H + s_q)
    config = dict(FUSED, SWAP=True, MERGE_GROUP=group, **({} if splits is None else {"SPLITS": splits}))
    poison_allocator()
    out, lse = decode_gluon.launch(q, cache, table, seq_lens, SCALE, DC, config=config)
    ref, ref_lse = _softmax64(q, cache, table, seq_lens, SCALE)
    assert_attention_close(out, lse, ref, ref_lse, BF)
    _counters_zero(q)
    base, base_lse = decode_gluon.launch(q, cache, table, seq_lens, SCALE, DC, config={"SWAP": True,
                                         **({} if splits is None else {"SPLITS": splits})})
    torch.testing.assert_close(out.float(), base.float(), atol=8e-3, rtol=8e-3)  # the reduce kernel's math
    torch.testing.assert_close(lse, base_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@needs_sm90
def test_fused_reduce_back_to_back_calls():
    """Two calls with other lengths and heads queued without a sync: each sees zeroed counters."""
    from mla_compile.ops.triton import decode_gluon

    first = _inputs([4096, 77], 16, 1, seed=11)
    second = _inputs([2048, 0, 4000], 16, 1, seed=12)
    poison_allocator()
    configs = (FUSED, dict(FUSED, MERGE_GROUP=2), FUSED)
    got = [decode_gluon.launch(*a, SCALE, DC, config=c) for a, c in zip((first, second, first), configs)]
    for a, (out, lse) in zip((first, second, first), got):
        ref, ref_lse = _softmax64(*a, SCALE)
        assert_attention_close(out, lse, ref, ref_lse, BF)
    assert torch.equal(got[0][0], got[2][0]) and torch.equal(got[0][1], got[2][1])  # deterministic
    _counters_zero(first[0])


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("group", [0, 4])
@pytest.mark.parametrize("B,H", [(1, 16), (3, 128)])
def test_fused_reduce_graph_replays(B, H, group):
    """A captured call replayed many times with new lengths (empty ones included) and queries, outputs poisoned
    before each replay: every replay matches the reference and leaves the counters at 0."""
    from mla_compile.ops.triton import decode_gluon

    gen = torch.Generator().manual_seed(B + H)
    q, cache, table, seq_lens = _inputs([4096] * B, H, 1, seed=B * H)
    st = {"q": q.clone(), "lens": seq_lens.clone()}
    graph, (out, lse) = capture(lambda: decode_gluon.launch(st["q"], cache, table, st["lens"], SCALE, DC,
                                                            config=dict(FUSED, SWAP=True, MERGE_GROUP=group)))
    for i in range(12):
        lens = [0] * B if i == 5 else lens_with_empty(B, 4096, gen)
        st["lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        st["q"].copy_(torch.randn(B, 1, H, DC + DR, generator=gen).to("cuda", BF))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = _softmax64(st["q"], cache, table, st["lens"], SCALE)
        assert_attention_close(out, lse, ref, ref_lse, BF)
        _counters_zero(q)


@pytest.mark.cuda
@needs_sm90
def test_defaults_turn_it_on_through_the_op(monkeypatch):
    """``DEFAULTS`` set: ``mla::decode`` backend "gluon" runs the variant for 16 heads (no reduce-kernel launch)
    and the 64-row kernel, which has no such variant, as before for 128 heads."""
    from mla_compile.ops import decode
    from mla_compile.ops.triton import decode_gluon

    monkeypatch.setitem(decode_gluon.DEFAULTS, "FUSED_REDUCE", True)
    monkeypatch.setitem(decode_gluon.DEFAULTS, "MERGE_GROUP", 4)
    launched = []
    monkeypatch.setattr(decode_gluon, "wrap_triton", lambda k: launched.append(k) or k)
    for H in (16, 128):
        q, cache, table, seq_lens = _inputs([4096, 0], H, 1, seed=H)
        out, lse = decode(q, cache, table, seq_lens, SCALE, backend="gluon")
        ref, ref_lse = _softmax64(q, cache, table, seq_lens, SCALE)
        assert_attention_close(out, lse, ref, ref_lse, BF)
        _counters_zero(q)
        assert len(launched) == (0 if H == 16 else 1), launched  # the reduce kernel: only without the variant


@pytest.mark.cuda
@needs_sm90
def test_capture_that_needs_more_counters_is_refused():
    """A capture may not allocate the counters (they would live in the graph's pool): a clear error."""
    need = split_counters(torch.device("cuda"), 1).numel() + 1
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="outside the capture"):
        with torch.cuda.graph(graph):
            split_counters(torch.device("cuda"), need)


@sm90_compile
@pytest.mark.parametrize("group", [0, 4])
def test_sm90_compile_fused_reduce(group):
    """With FUSED_REDUCE (one merge, and two levels) the swapped kernel still compiles without spills (stack, local loads / stores), its
    registers and shared memory as the default's (one program an SM), the loop's dots and copies unchanged; the
    arrival is there: a ``fence.acq_rel.gpu`` before and after, one ``atom.acq_rel.gpu`` add, the merge's
    workspace loads from L2 (``.cg``) and the counter's reset."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_compile.ops.triton import decode_gluon as g
    from mla_compile.ops.triton._sm90 import resources

    kernel = g.decode_gluon_swap_kernel
    consts = dict(DC=DC, DR=DR, BLOCK_SIZE=64, DIRECT=False, BLOCK_R=g.SWAP_ROWS, FUSED_REDUCE=True,
                  MERGE_GROUP=group)
    types = dict(q_ptr="*bf16", bt_ptr="*i32", seq_lens_ptr="*i32", lse_ptr="*fp32", o_ptr="*fp32",
                 scale_log2="fp32", fin_o_ptr="*bf16", fin_lse_ptr="*fp32", cnt_ptr="*i32",
                 desc_c=f"tensordesc<bf16[8, 64, 64],{g.BOX_SL!r}>", desc_r=f"tensordesc<bf16[64, 64],{g.SMEM_SL!r}>")
    sig = {p.name: "constexpr" if p.name in consts else types.get(p.name, "i32") for p in kernel.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if sig[p.name].startswith("*") or p.name.startswith("stride_q")}
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=g.SWAP_WARPS))
    shared = compiled.metadata.shared
    assert g.smem_bytes(swap=True) <= shared < g.smem_bytes(swap=True) + 1024
    assert 227 * 1024 // 2 < shared <= 227 * 1024
    res = resources(compiled)
    assert res["stack"] == 0 and res["LDL"] == 0 and res["STL"] == 0, res
    assert res["regs"] <= 255, res
    assert res["HGMMA"] == 2 * (DC + DR) // 16 + (DC // 64) * (64 // 16), res
    assert res["UTMALDG"] == 6, res
    ptx = compiled.asm["ptx"]
    levels = 2 if group > 1 else 1  # an arrival (a fence before) and a merge (a fence after) a level
    assert ptx.count("fence.acq_rel.gpu") == 2 * levels, ptx.count("fence.acq_rel.gpu")
    assert ptx.count("atom.global.gpu.acq_rel.add") == levels
    assert "atom.global.gpu.relaxed.exch" in ptx or "atom.global.gpu.exch" in ptx
    assert "ld.global.cg" in ptx
