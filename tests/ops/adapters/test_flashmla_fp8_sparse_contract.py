"""FlashMLA fp8 and sparse decode adapters against a fake ``flash_mla``: the cache passed as a
``float8_e4m3fn [blocks, 64, 1, 656]`` view (no copy) with ``is_fp8_kvcache=True``; sparse calls with
int32 indices padded by -1 to a multiple of 64, no table, ``causal=False``; LSE ``[B, H, s_q] ->
[B, s_q, H]``; FlashMLA's undefined empty rows (NaN / +inf here) -> ``0 / -inf``; outputs equal to the
float64 references over the dequantized rows."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mla_compile.ops import decode_fp8, sparse_decode
from mla_compile.ops.adapters.flashmla import flashmla_decode_fp8_core, flashmla_sparse_decode_core
from ..ref64 import LSE_TOL, OUT_TOL, Paged, decode_ref64, generator, randn
from ..ref_sparse import dequantize64, fill_fp8_cache, sparse_decode_ref64

BF16 = torch.bfloat16
# lengths 0 (a padding slot), 1 (with s_q = 2 its first query sees nothing), across block edges
LAYOUT = Paged(64, 6, (0, 70, 1, 128), ((), (4, 1), (0,), (5, 2)), 3, 3)
SCALE = 192 ** -0.5


def _inputs(s_q: int, heads: int = 2, seed: int = 0, dtype=BF16, layout=LAYOUT):
    gen = generator(seed)
    cache = fill_fp8_cache(layout, 512, 64, gen)
    q = randn(gen, len(layout.seq_lens), s_q, heads, 576, dtype=dtype)
    return q, cache, layout.block_table(torch.int64), layout.seq_lens_tensor(torch.int64), gen


def _check(out, lse, ref_out, ref_lse, shape):
    assert out.shape == shape and lse.shape == shape[:3] and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])
    empty = ref_lse == float("-inf")
    assert empty.any(), "the inputs must hold a query that sees nothing"
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all() and not out.isnan().any()


def _sparse_calls(calls, q, cache, topk_padded):
    """The recorded sparse calls: q's heads zero-padded to 64 / 128 per call, the cache as an fp8 view."""
    sent = calls.named("flash_mla_with_kvcache")
    width = 64 if q.shape[2] <= 64 else 128
    assert len(sent) == -(-q.shape[2] // width) == len(calls.named("get_mla_metadata")), "one fresh schedule per call"
    for n, (args, kw) in enumerate(sent):
        q_in, k_cache, bt, seqlens, head_dim_v, _meta = args
        h0, h1 = n * width, min((n + 1) * width, q.shape[2])
        assert q_in.shape == (*q.shape[:2], width, 576) and q_in.is_contiguous()
        assert torch.equal(q_in[:, :, :h1 - h0], q[:, :, h0:h1]) and (q_in[:, :, h1 - h0:] == 0).all()
        assert k_cache.shape == (cache.shape[0], 64, 1, 656) and k_cache.dtype == torch.float8_e4m3fn
        assert k_cache.data_ptr() == cache.data_ptr(), "the cache must be passed as a view, never copied"
        assert bt is None and seqlens is None and head_dim_v == 512
        assert kw["softmax_scale"] == SCALE and kw["causal"] is False and kw["is_fp8_kvcache"] is True
        assert kw["use_legacy"] is True and kw["indices"].shape == (*q.shape[:2], topk_padded)
    return [kw["indices"] for _, kw in sent]


@pytest.mark.parametrize("s_q,heads", [(1, 2), (2, 2), (1, 130)])
def test_fp8_decode_runs_the_sparse_kernel_over_causal_slot_lists(fake_flash_mla, s_q, heads):
    """FlashMLA's dense fp8 kernel reads another format (576 bytes, per-tensor descales): dense fp8 decode
    goes through the sparse kernel with each query's causal slots, in order, -1 after (no ``topk_length``: the
    V3.2 kernel refuses it)."""
    q, cache, table, lens, _ = _inputs(s_q, heads=heads)
    out, lse = flashmla_decode_fp8_core(q, cache, table, lens, SCALE, 512)

    assert not fake_flash_mla.named("get_mla_decoding_metadata")
    for _, kw in fake_flash_mla.named("flash_mla_with_kvcache"):  # the V3.2 kernel refuses topk_length
        assert kw["topk_length"] is None
    for idx in _sparse_calls(fake_flash_mla, q, cache, 3 * 64):
        for b, n in enumerate(LAYOUT.seq_lens):
            for i in range(s_q):
                visible = max(n - (s_q - 1 - i), 0)
                want = [LAYOUT.tables[b][p // 64] * 64 + p % 64 for p in range(visible)]
                assert idx[b, i, :visible].tolist() == want and (idx[b, i, visible:] == -1).all()

    ref_out, ref_lse = decode_ref64(q, dequantize64(cache, 512), LAYOUT, SCALE, 512)
    _check(out, lse, ref_out, ref_lse, (4, s_q, heads, 512))


def test_the_fake_enforces_flashmla_requirements(fake_flash_mla):
    """What the H200 run hit: the fake refuses h_q outside {64, 128} for sparse decode and a dense fp8 call
    without ``get_mla_decoding_metadata`` (or with the 656-byte rows, which that kernel does not read)."""
    import flash_mla

    q, cache, table, lens, _ = _inputs(1)
    k_cache = cache.view(torch.float8_e4m3fn).unsqueeze(2)
    idx = torch.full((4, 1, 64), -1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="Unsupported h_q: 2"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, flash_mla.get_mla_metadata()[0],
                                         softmax_scale=SCALE, indices=idx, is_fp8_kvcache=True, use_legacy=True)
    with pytest.raises(AssertionError, match="get_mla_decoding_metadata"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, table.int(), lens.int(), 512, flash_mla.get_mla_metadata()[0],
                                         softmax_scale=SCALE, is_fp8_kvcache=True, use_legacy=True)
    meta = flash_mla.FlashMLASchedMeta()
    meta.tile_scheduler_metadata, meta.num_splits = flash_mla.get_mla_decoding_metadata(
        lens.int(), 1, 1, is_fp8_kvcache=True, use_legacy=True)
    with pytest.raises(AssertionError, match="head_size_k == 576"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, table.int(), lens.int(), 512, meta,
                                         softmax_scale=SCALE, is_fp8_kvcache=True, use_legacy=True)


def _sparse_indices(gen, B, s_q, topk, n_slots, live_slots, dtype=torch.int32):
    """Distinct written slots in random order, -1 anywhere; query (0, 0) gets only -1."""
    rows = []
    for b in range(B):
        for i in range(s_q):
            k = 0 if (b, i) == (0, 0) else int(torch.randint(1, topk + 1, (1,), generator=gen))
            chosen = live_slots[torch.randperm(len(live_slots), generator=gen)[:k]].tolist()
            row = chosen + [-1] * (topk - len(chosen))
            rows.append([row[j] for j in torch.randperm(topk, generator=gen).tolist()])
    return torch.tensor(rows, dtype=dtype).view(B, s_q, topk)


@pytest.mark.parametrize("s_q,topk,idx_dtype", [(1, 40, torch.int64), (2, 64, torch.int32), (1, 130, torch.int32)])
def test_sparse_decode_call_contract_and_result(fake_flash_mla, s_q, topk, idx_dtype):
    q, cache, _, _, gen = _inputs(s_q, seed=topk)
    rows = dequantize64(cache, 512).reshape(-1, 576)
    live = torch.nonzero(~rows.isnan().any(dim=1)).flatten()
    indices = _sparse_indices(gen, 4, s_q, topk, rows.shape[0], live, idx_dtype)
    out, lse = flashmla_sparse_decode_core(q, cache, indices, SCALE, 512)

    padded = -(-topk // 64) * 64
    [sent] = _sparse_calls(fake_flash_mla, q, cache, padded)
    assert sent.dtype == torch.int32
    assert torch.equal(sent[..., :topk].long(), indices.long()) and (sent[..., topk:] == -1).all()

    slots = [[[int(x) for x in indices[b, i].tolist()] for i in range(s_q)] for b in range(4)]
    ref_out, ref_lse = sparse_decode_ref64(q, rows, slots, SCALE, 512)
    _check(out, lse, ref_out, ref_lse, (4, s_q, 2, 512))


def test_sparse_slots_out_of_range_are_skipped(fake_flash_mla, monkeypatch):
    """FlashMLA treats only -1 as invalid: the adapter turns slots >= num_blocks * 64 (and < -1) into -1,
    as the Triton kernel masks them (data checks off, as on CUDA outside checked mode)."""
    import sys

    monkeypatch.setattr(sys.modules["mla_compile.ops.sparse_decode"], "data_checks_enabled", lambda t: False)
    q, cache, _, _, gen = _inputs(1, heads=3, seed=9)
    rows = dequantize64(cache, 512).reshape(-1, 576)
    live = torch.nonzero(~rows.isnan().any(dim=1)).flatten()
    indices = _sparse_indices(gen, 4, 1, 64, rows.shape[0], live)
    bad = indices.clone()
    bad[1:, 0, :3] = torch.tensor([rows.shape[0], 10 ** 6, -7], dtype=torch.int32)
    out, lse = flashmla_sparse_decode_core(q, cache, bad, SCALE, 512)
    [sent] = _sparse_calls(fake_flash_mla, q, cache, 64)
    assert (sent[1:, 0, :3] == -1).all()
    masked = torch.where((bad >= 0) & (bad < rows.shape[0]), bad, -1)
    slots = [[[int(x) for x in masked[b, 0].tolist()]] for b in range(4)]
    ref_out, ref_lse = sparse_decode_ref64(q, rows, slots, SCALE, 512)
    _check(out, lse, ref_out, ref_lse, (4, 1, 3, 512))


def test_public_functions_dispatch_to_flashmla(fake_flash_mla, allow_cpu):
    allow_cpu("mla.decode_fp8", "flashmla")
    allow_cpu("mla.sparse_decode", "flashmla")
    q, cache, table, lens, gen = _inputs(1, seed=5)
    out, lse = decode_fp8(q[:, 0], cache, table, lens, SCALE, backend="flashmla")
    want, want_lse = flashmla_decode_fp8_core(q, cache, table, lens, SCALE, 512)
    assert torch.equal(out, want[:, 0]) and torch.equal(lse, want_lse[:, 0])
    rows = dequantize64(cache, 512).reshape(-1, 576)
    live = torch.nonzero(~rows.isnan().any(dim=1)).flatten()
    indices = _sparse_indices(gen, 4, 1, 64, rows.shape[0], live)
    out, lse = sparse_decode(q[:, 0], cache, indices[:, 0], SCALE, backend="flashmla")
    want, want_lse = flashmla_sparse_decode_core(q, cache, indices, SCALE, 512)
    assert torch.equal(out, want[:, 0]) and torch.equal(lse, want_lse[:, 0])


def test_the_custom_ops_compile_fullgraph(fake_flash_mla):
    q, cache, table, lens, gen = _inputs(1, seed=3)
    rows = dequantize64(cache, 512).reshape(-1, 576)
    live = torch.nonzero(~rows.isnan().any(dim=1)).flatten()
    indices = _sparse_indices(gen, 4, 1, 64, rows.shape[0], live)
    m = torch.ops.mla
    fn = torch.compile(lambda *a: m.decode_fp8_flashmla(*a, SCALE, 512), fullgraph=True, backend="aot_eager")
    out, lse = fn(q, cache, table, lens)
    want, want_lse = flashmla_decode_fp8_core(q, cache, table, lens, SCALE, 512)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    fn = torch.compile(lambda *a: m.sparse_decode_flashmla(*a, SCALE, 512), fullgraph=True, backend="aot_eager")
    out, lse = fn(q, cache, indices)
    want, want_lse = flashmla_sparse_decode_core(q, cache, indices, SCALE, 512)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(m.decode_fp8_flashmla.default, (q, cache, table, lens, SCALE, 512), test_utils=checks)
    torch.library.opcheck(m.sparse_decode_flashmla.default, (q, cache, indices, SCALE, 512), test_utils=checks)


def test_refuses_what_flashmla_cannot_take(fake_flash_mla):
    q, cache, table, lens, _ = _inputs(1)
    with pytest.raises(TypeError, match="backend 'flashmla' needs q in"):
        flashmla_decode_fp8_core(q.half(), cache, table, lens, SCALE, 512)
    small = fill_fp8_cache(Paged(16, 8, (20,), ((0, 1),), 2, 0), 512, 64, generator(1))
    with pytest.raises(ValueError, match=r"needs block_size \(kv_cache.shape\[1\]\) in \[64\]"):
        flashmla_decode_fp8_core(q[:1], small, torch.tensor([[0, 1]]), torch.tensor([20]), SCALE, 512)
    idx = torch.full((4, 1, 64), -1, dtype=torch.int32)
    bf16_cache = torch.randn(6, 64, 576).to(BF16)
    with pytest.raises(TypeError, match="backend 'flashmla' needs kv_cache in"):
        flashmla_sparse_decode_core(q, bf16_cache, idx, SCALE, 512)
    assert not fake_flash_mla


def test_a_sparse_schedule_is_kept_for_the_calls_of_its_shapes(fake_flash_mla, monkeypatch):
    """With ``REUSE_SPARSE_SCHEDULE``: the schedule FlashMLA handed back after the first eager call of some shapes
    (batch, queries, padded heads, index-list width) goes to every later call of those shapes, the second head group
    of a 130-head call included; other shapes schedule themselves; a call being captured keeps nothing; the results
    are those of the calls that schedule themselves."""
    import mla_compile.ops.adapters.flashmla as fm

    q, cache, _, _, gen = _inputs(1, heads=130, seed=7)
    rows = dequantize64(cache, 512).reshape(-1, 576)
    live = torch.nonzero(~rows.isnan().any(dim=1)).flatten()
    indices = _sparse_indices(gen, 4, 1, 70, rows.shape[0], live)
    want = flashmla_sparse_decode_core(q, cache, indices, SCALE, 512)
    monkeypatch.setattr(fm, "REUSE_SPARSE_SCHEDULE", True)
    monkeypatch.setattr(fm, "_SPARSE_SCHEDULES", {})
    monkeypatch.setattr(fm, "_capturing", lambda t: True)
    flashmla_sparse_decode_core(q, cache, indices, SCALE, 512)  # captured: nothing kept
    assert fm._SPARSE_SCHEDULES == {}
    monkeypatch.setattr(fm, "_capturing", lambda t: False)
    fake_flash_mla.clear()
    got = [flashmla_sparse_decode_core(q, cache, indices, SCALE, 512) for _ in range(2)]
    for out, lse in got:
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    sent = fake_flash_mla.named("flash_mla_with_kvcache")
    assert len(sent) == 4  # two head groups a call
    first = sent[0][0][5]  # the meta FlashMLA filled on the first group of the first call
    assert sent[0][1]["schedule"] is None
    assert all(kw["schedule"] is first.tile_scheduler_metadata for _, kw in sent[1:])
    fake_flash_mla.clear()
    flashmla_sparse_decode_core(q, cache, indices[..., :60], SCALE, 512)  # width 64, not 128: its own schedule
    flashmla_sparse_decode_core(q[:3], cache, indices[:3], SCALE, 512)  # batch 3: its own schedule
    scheduled = [kw["schedule"] is None for _, kw in fake_flash_mla.named("flash_mla_with_kvcache")]
    assert scheduled == [True, False, True, False]
    assert len(fm._SPARSE_SCHEDULES) == 3
