"""FlashMLA's sparse kernel as backend "flashmla" of ``mla::v4_attention``, against a fake ``flash_mla`` whose
``flash_mla_sparse_fwd`` has the documented contract (natural-log LSE, sink on the output only, -1 / ``>= s_kv``
invalid, ``topk_length``, h_q 64 / 128, undefined rows without a valid index): the index lists, head padding,
the LSE merge of the window and compressed calls, the sink applied once, the rope back-rotation, empty rows,
and the registry's declaration, all against the float64 reference of the paper's equations."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.testing import assert_close

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile.ops import v4_attention
from mla_compile.ops.adapters import flashmla_v4 as fv4
from mla_compile.ops.registry import SM90, backends_for
from mla_compile.ops.select import Facts, auto_skip, select, why_not
from ..ref_v4 import v4_attention64

BF16, I32 = torch.bfloat16, torch.int32
NAN = float("nan")
D, ROPE, SCALE = 512, 64, 512 ** -0.5
OUT_TOL = dict(atol=1e-2, rtol=2e-2)  # bf16 partial outputs merged in float32, one final bf16 rounding


def _case(seed, H, T=6, W=8, K=20, bs=16, nb=4, nbc=3, same_cache=False):
    """Query rows with: row 0 at position 3 (window boundary: its first W - 4 columns are -1), row 1 with an
    empty compressed list, row 2 with no slot at all (a padding token), duplicates allowed elsewhere; head 0's
    sink dominates. Cache rows that no list names are NaN."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(BF16)
    kv = torch.randn(nb, bs, D, generator=g).to(BF16)
    comp = kv if same_cache else torch.randn(nbc, bs, D, generator=g).to(BF16)
    n_kv, n_c = nb * bs, comp.shape[0] * comp.shape[1]
    ws = torch.stack([torch.randperm(n_kv, generator=g)[:W] for _ in range(T)]).to(I32)
    ws[0, : W - 4] = -1
    ws[2] = -1
    cs = torch.randint(0, n_c, (T, K), generator=g).to(I32)  # duplicates count twice
    cs[torch.rand(T, K, generator=g) < 0.3] = -1
    cs[1] = cs[2] = -1
    cs[3, -5:] = -1  # trailing -1: topk_length stops before them
    listed = torch.zeros(n_kv, dtype=torch.bool)
    listed[ws[ws >= 0].long()] = True
    used_c = torch.zeros(n_c, dtype=torch.bool)
    used_c[cs[cs >= 0].long()] = True
    if same_cache:
        listed |= used_c
    else:
        comp.view(-1, D)[~used_c] = NAN
    kv.view(-1, D)[~listed] = NAN
    sinks = torch.randn(H, generator=g)
    sinks[0] = 30.0
    pos = torch.tensor([3, 100, 0, 4000, 77, 1 << 16], dtype=I32)[:T]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    return q, kv, ws, comp, cs, sinks, pos, inv_freq


def _check(out, lse, args):
    ref, ref_lse = v4_attention64(*args, SCALE)
    q = args[0]
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2] and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(ref_lse)
    assert empty.any() and torch.equal(torch.isneginf(lse), empty) and (out[empty[:, 0]] == 0).all()
    assert_close(out.double(), ref, **OUT_TOL)
    assert_close(lse[~empty].double(), ref_lse[~empty], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H", [3, 64, 130])
def test_two_caches_two_calls_merged_by_lse(fake_flash_mla, H):
    args = _case(H, H)
    out, lse = fv4.flashmla_v4_attention_core(*args, SCALE)
    _check(out, lse, args)
    q, kv, ws, comp, cs, sinks = args[:6]
    sent = fake_flash_mla.named("flash_mla_sparse_fwd")
    width = 64 if H <= 64 else 128
    groups = -(-H // width)
    assert len(sent) == 2 * groups  # window and compressed lists, each per head group
    for n, (a, kw) in enumerate(sent):
        q_in, kv_in, idx, scale = a
        cache, slots = (kv, ws) if n % 2 == 0 else (comp, cs)  # per head group: the window, then the entries
        h0, h1 = (n // 2) * width, min((n // 2 + 1) * width, H)
        assert q_in.shape == (q.shape[0], width, D) and torch.equal(q_in[:, :h1 - h0], q[:, h0:h1])
        assert (q_in[:, h1 - h0:] == 0).all()
        assert kv_in.shape == (cache.shape[0] * cache.shape[1], 1, D) and kv_in.data_ptr() == cache.data_ptr()
        assert scale == SCALE and kw["d_v"] == 512 and kw["use_legacy"] is True
        assert kw["attn_sink"] is None, "two partial calls: the sink is applied once, after the merge"
        L = slots.shape[1]
        assert idx.shape == (q.shape[0], 1, -(-L // 128) * 128) and idx.dtype == I32
        assert torch.equal(idx[:, 0, :L], slots) and (idx[:, 0, L:] == -1).all()
        valid = slots >= 0
        want_len = torch.where(valid, torch.arange(1, L + 1), 0).amax(dim=1)
        assert torch.equal(kw["topk_length"], want_len.to(I32))


def test_one_list_one_call_with_attn_sink(fake_flash_mla):
    """A sliding layer (no compressed list): one call per head group, FlashMLA applies the sink (padded heads
    get -inf, which has no effect)."""
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(7, 5)
    cs = cs[:, :0]
    args = (q, kv, ws, kv, cs, sinks, pos, inv_freq)
    out, lse = fv4.flashmla_v4_attention_core(*args, SCALE)
    _check(out, lse, args)
    [(a, kw)] = fake_flash_mla.named("flash_mla_sparse_fwd")
    sink = kw["attn_sink"]
    assert sink.shape == (64,) and torch.equal(sink[:5], sinks) and torch.isneginf(sink[5:]).all()


def test_both_lists_on_one_cache_are_one_call(fake_flash_mla):
    args = _case(8, 4, same_cache=True)
    out, lse = fv4.flashmla_v4_attention_core(*args, SCALE)
    _check(out, lse, args)
    [(a, kw)] = fake_flash_mla.named("flash_mla_sparse_fwd")
    ws, cs = args[2], args[4]
    assert torch.equal(a[2][:, 0, : ws.shape[1] + cs.shape[1]], torch.cat([ws, cs], dim=1))
    assert kw["attn_sink"] is not None


def test_dominating_sink_and_no_sink(fake_flash_mla):
    """A sink of 40 takes (almost) all the mass without touching the LSE; -inf sinks give plain attention."""
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(9, 64)
    plain, plain_lse = fv4.flashmla_v4_attention_core(q, kv, ws, comp, cs, torch.full_like(sinks, float("-inf")), pos,
                                                      inv_freq, SCALE)
    _check(plain, plain_lse, (q, kv, ws, comp, cs, torch.full_like(sinks, float("-inf")), pos, inv_freq))
    big = torch.full_like(sinks, 40.0)
    out, lse = fv4.flashmla_v4_attention_core(q, kv, ws, comp, cs, big, pos, inv_freq, SCALE)
    assert torch.equal(lse, plain_lse)
    assert out.abs().max() < 1e-6 * plain.abs().max()
    _check(out, lse, (q, kv, ws, comp, cs, big, pos, inv_freq))


def test_no_slot_lists_at_all(fake_flash_mla):
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(10, 4)
    out, lse = fv4.flashmla_v4_attention_core(q, kv, ws[:, :0], comp, cs[:, :0], sinks, pos, inv_freq, SCALE)
    assert (out == 0).all() and torch.isneginf(lse).all() and not fake_flash_mla


def test_out_of_range_slots_are_skipped(fake_flash_mla, monkeypatch):
    """Slots outside the cache become -1 (FlashMLA's decode checks no bound), as the Triton kernel masks them
    (data checks off, as on CUDA outside checked mode)."""
    monkeypatch.setattr(sys.modules["mla_compile.ops.v4_attention"], "data_checks_enabled", lambda t: False)
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(11, 4)
    bad = cs.clone()
    bad[4, :3] = torch.tensor([comp.shape[0] * comp.shape[1], 10 ** 6, -7], dtype=I32)
    out, lse = fv4.flashmla_v4_attention_core(q, kv, ws, comp, bad, sinks, pos, inv_freq, SCALE)
    sent = fake_flash_mla.named("flash_mla_sparse_fwd")[1][0][2]
    assert (sent[4, 0, :3] == -1).all()
    masked = torch.where((bad >= 0) & (bad < comp.shape[0] * comp.shape[1]), bad, -1)
    _check(out, lse, (q, kv, ws, comp, masked, sinks, pos, inv_freq))


def test_index_mapping_pads_and_measures_lengths():
    slots = torch.tensor([[5, -1, 3, -1], [-1, -1, -1, -1], [-1, 9, 99, 2]], dtype=torch.int64)
    idx, length, live = fv4.sparse_indices(slots, n_rows=10)
    assert idx.shape == (3, 1, 128) and idx.dtype == I32 and idx.is_contiguous()
    assert idx[:, 0, :4].tolist() == [[5, -1, 3, -1], [-1, -1, -1, -1], [-1, 9, -1, 2]]
    assert (idx[:, 0, 4:] == -1).all()
    assert length.tolist() == [3, 0, 4] and length.dtype == I32 and live.tolist() == [True, False, True]
    idx, length, _ = fv4.sparse_indices(torch.zeros(2, 0, dtype=I32), n_rows=10)
    assert idx.shape == (2, 1, 128) and (idx == -1).all() and length.tolist() == [0, 0]
    assert fv4.sparse_indices(torch.zeros(1, 129, dtype=I32), 10)[0].shape == (1, 1, 256)
    assert fv4.head_groups(3) == (64, [(0, 3)]) and fv4.head_groups(64) == (64, [(0, 64)])
    assert fv4.head_groups(128) == (128, [(0, 128)]) and fv4.head_groups(200) == (128, [(0, 128), (128, 200)])


def test_combine_merges_applies_the_sink_once_and_clears_empty_rows():
    """The LSE-level algebra on hand-made parts: the merge of two disjoint sets, then ``* sigmoid(lse - sink)``;
    a part that is not live contributes nothing whatever it holds."""
    g = torch.Generator().manual_seed(12)
    T, H, d = 4, 2, 8
    oa, ob = (torch.randn(T, H, d, generator=g, dtype=torch.float64) for _ in range(2))
    la, lb = (torch.randn(T, H, generator=g, dtype=torch.float64) for _ in range(2))
    live_a, live_b = torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])
    oa[2], la[2], ob[1], lb[1] = NAN, float("inf"), NAN, NAN  # what FlashMLA may leave in rows it did not define
    sinks = torch.tensor([0.5, -1.0])
    out, lse = fv4.combine([(oa, la, live_a), (ob, lb, live_b)], sinks, sink_applied=False)
    wa, wb = torch.exp(la[0]), torch.exp(lb[0])
    want0 = (oa[0] * wa[:, None] + ob[0] * wb[:, None]) / (wa + wb)[:, None]
    want_lse0 = torch.log(wa + wb)
    assert_close(lse[0].double(), want_lse0, atol=1e-6, rtol=1e-6)
    assert_close(out[0].double(), want0 * torch.sigmoid(want_lse0 - sinks.double())[:, None], atol=1e-6, rtol=1e-6)
    assert_close(out[1].double(), oa[1] * torch.sigmoid(la[1] - sinks.double())[:, None], atol=1e-6, rtol=1e-6)
    assert_close(out[2].double(), ob[2] * torch.sigmoid(lb[2] - sinks.double())[:, None], atol=1e-6, rtol=1e-6)
    assert (out[3] == 0).all() and torch.isneginf(lse[3]).all() and not out.isnan().any()


def test_public_function_compile_and_opcheck(fake_flash_mla, allow_cpu):
    allow_cpu("mla.v4_attention", "flashmla")
    args = _case(13, 64)
    want, want_lse = fv4.flashmla_v4_attention_core(*args, SCALE)
    out, lse = v4_attention(*args, SCALE, backend="flashmla")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    fn = torch.compile(lambda *a: v4_attention(*a, SCALE, backend="flashmla"), fullgraph=True, backend="aot_eager")
    out, lse = fn(*args)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    torch.library.opcheck(torch.ops.mla.v4_attention_flashmla.default, (*args, SCALE),
                          test_utils=("test_schema", "test_faketensor"))


def test_refuses_what_flashmla_cannot_take(fake_flash_mla):
    q, kv, ws, comp, cs, sinks, pos, inv_freq = _case(14, 4)
    with pytest.raises(TypeError, match="backend 'flashmla' needs q in"):
        fv4.flashmla_v4_attention_core(q.float(), kv, ws, comp, cs, sinks, pos, inv_freq, SCALE)
    with pytest.raises(TypeError, match="backend 'flashmla' needs comp_cache in"):
        fv4.flashmla_v4_attention_core(q, kv, ws, comp.float(), cs, sinks, pos, inv_freq, SCALE)
    small = lambda t: t[..., :256].contiguous()  # noqa: E731
    with pytest.raises(ValueError, match=r"needs head dim \(q.shape\[-1\]\) in \[512\]"):
        fv4.flashmla_v4_attention_core(small(q), small(kv), ws, small(comp), cs, sinks, pos, inv_freq[:8], SCALE)
    gappy = torch.zeros(kv.shape[0], kv.shape[1] + 3, D, dtype=BF16)[:, : kv.shape[1]]  # blocks not back to back
    with pytest.raises(ValueError, match="kv_cache as one row array"):
        fv4.flashmla_v4_attention_core(q, gappy, ws, comp, cs, sinks, pos, inv_freq, SCALE)
    assert not fake_flash_mla


def test_registry_declaration_and_why_not(fake_flash_mla):
    """Declared with what FlashMLA takes; "auto" weighs it on sm90 for bf16 head 512 (any head count), says why
    not elsewhere, and passes it over while it is not declared GPU-tested."""
    spec = backends_for("v4_attention")["flashmla"]
    assert spec.fn is torch.ops.mla.v4_attention_flashmla and spec.available()
    assert spec.dtypes == spec.cache_dtypes == (BF16,) and spec.head_dims == ((512,),)
    assert spec.min_capability == spec.max_capability == SM90 and spec.cuda_graph == "full" and spec.lse
    assert not spec.host_sync and not spec.needs_plan
    f = dict(device=torch.device("cuda"), dtype=BF16, cache_dtype=BF16, block_size=64, num_heads=64, head_dims=(512,),
             cap=(9, 0), cache_align=256, packed_rows=True, cuda_graph=True)
    assert why_not(spec, Facts(**f)) is None
    assert why_not(spec, Facts(**{**f, "num_heads": 7})) is None  # padded to 64
    assert "head dims (128,) not in [(512,)]" in why_not(spec, Facts(**{**f, "head_dims": (128,)}))
    assert "dtype torch.float32 not in ['bfloat16']" in why_not(spec, Facts(**{**f, "dtype": torch.float32}))
    assert "cache dtype torch.float32 not supported" in why_not(spec, Facts(**{**f, "cache_dtype": torch.float32}))
    assert "needs sm90 (this GPU is sm100)" in why_not(spec, Facts(**{**f, "cap": (10, 0)}))
    assert "runs on cuda, not cpu" in why_not(spec, Facts(**{**f, "device": torch.device("cpu")}))
    choice = select("v4_attention", Facts(**f))
    if not spec.gpu_tested:  # until its CUDA tests pass on the H200
        assert "not yet tested on a GPU" in auto_skip(spec)
        assert choice.name != "flashmla" and "not yet tested on a GPU" in choice.rejected["flashmla"]
    else:
        assert auto_skip(spec) is None and "flashmla" not in choice.rejected
    assert "flashmla" in select("v4_attention", Facts(**{**f, "head_dims": (256,)})).rejected
    assert select("v4_attention", Facts(**f), requested="flashmla").name == "flashmla"
    with pytest.raises(ValueError, match="head dims"):
        select("v4_attention", Facts(**{**f, "head_dims": (64,)}), requested="flashmla")


def test_not_available_without_flash_mla(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    spec = backends_for("v4_attention")["flashmla"]
    f = Facts(device=torch.device("cuda"), dtype=BF16, cache_dtype=BF16, head_dims=(512,), cap=(9, 0))
    assert "not installed (pip install sgl-flash-mla)" in why_not(spec, f)


def test_adapter_reads_nothing_on_the_host(fake_flash_mla, monkeypatch):
    """Index building, head padding, merge, sink and rotation never read a device value on the host (the
    dispatch mode of ``tests/ops/test_no_host_reads.py``; the fake kernel itself runs outside it)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from ..test_no_host_reads import NoHostReads

    monkeypatch.setattr(sys.modules["mla_compile.ops.v4_attention"], "data_checks_enabled", lambda t: False)
    flash_mla = sys.modules["flash_mla"]
    kernel = flash_mla.flash_mla_sparse_fwd

    def outside_the_mode(*a, **kw):
        with _disable_current_modes():
            return kernel(*a, **kw)

    monkeypatch.setattr(flash_mla, "flash_mla_sparse_fwd", outside_the_mode)
    args = _case(15, 130)
    with NoHostReads():
        out, lse = fv4.flashmla_v4_attention_core(*args, SCALE)
    _check(out, lse, args)
    q, kv, ws, comp, cs, sinks, pos, inv_freq = args
    with NoHostReads():
        out, lse = fv4.flashmla_v4_attention_core(q, kv, ws, kv, cs[:, :0], sinks, pos, inv_freq, SCALE)
    _check(out, lse, (q, kv, ws, kv, cs[:, :0], sinks, pos, inv_freq))
