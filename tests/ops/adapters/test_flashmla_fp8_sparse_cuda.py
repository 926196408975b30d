"""GPU: FlashMLA's fp8 dense and fp8 sparse decode through our adapters, against the reference ops
(float64 math over the dequantized rows), eager, under torch.compile(fullgraph=True) and in CUDA-graph
replay with changed lengths/indices. Dense fp8 runs FlashMLA's sparse (V3.2) kernel over causal slot
lists, and head counts other than 64/128 are padded (H200 run 4: "Unsupported h_q: 16" before).
Skips without ``flash_mla`` or off sm90."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from mla_compile.ops import decode_fp8, sparse_decode
from mla_compile.ops.fp8_cache import quantize_fp8_rows
from tests.cuda_capture import capture

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SCALE = 1 / math.sqrt(192)


@pytest.fixture(autouse=True)
def _need_flashmla():
    if importlib.util.find_spec("flash_mla") is None:
        pytest.skip("flash_mla (sgl-flash-mla) is not installed")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FlashMLA adapters use the sm90 kernels")
    torch._dynamo.reset()


def _fp8_paged(lens, seed, H=16, s_q=1):
    gen = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // 64)) for n in lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    lat = torch.randn(nb * 64, 512, generator=gen).bfloat16()
    kpe = torch.randn(nb * 64, 64, generator=gen).bfloat16()
    cache = quantize_fp8_rows(lat, kpe).view(nb, 64, 656)
    q = torch.randn(len(lens), s_q, H, 576, generator=gen).bfloat16()
    return q.cuda(), cache.cuda(), table.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(), gen


def _check(out, lse, ref, ref_lse):
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (out[empty] == 0).all()
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < 1.5e-2, rel
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty].double(), atol=1.5e-2, rtol=1e-3)  # fp8 keys rounded to bf16


@pytest.mark.parametrize("B,H,s_q,L", [(32, 16, 1, 3000), (16, 128, 1, 2048), (8, 128, 2, 700)])
def test_fp8_decode(B, H, s_q, L):
    gen = torch.Generator().manual_seed(B)
    lens = torch.randint(0, L + 1, (B,), generator=gen).tolist()
    lens[0], lens[1] = L, 0
    q, cache, table, seq_lens, _ = _fp8_paged(lens, B + H, H, s_q)
    out, lse = decode_fp8(q, cache, table, seq_lens, SCALE, backend="flashmla")
    ref, ref_lse = torch.ops.mla.decode_fp8_ref(q.double(), cache, table, seq_lens, SCALE, 512)
    _check(out, lse, ref, ref_lse)
    triton_out, _ = decode_fp8(q, cache, table, seq_lens, SCALE, backend="triton")
    assert float((out.double() - triton_out.double()).norm() / triton_out.double().norm()) < 2e-2


def _indices(seq_lens, table, s_q, topk, gen):
    """Random distinct positions < seq_len per query as physical slots, -1 padded, shuffled."""
    B = seq_lens.shape[0]
    lens = seq_lens.cpu().long()
    scores = torch.rand(B, s_q, table.shape[1] * 64, generator=gen)
    scores[torch.arange(table.shape[1] * 64)[None, None, :].expand(B, s_q, -1) >= lens[:, None, None]] = -1
    top = scores.topk(min(topk, scores.shape[-1]), dim=-1)
    pos = top.indices
    slots = table.cpu().long().gather(1, (pos // 64).view(B, -1)).view(pos.shape) * 64 + pos % 64
    slots = torch.where(top.values >= 0, slots, -1)
    out = torch.full((B, s_q, topk), -1, dtype=torch.int32)
    out[..., :slots.shape[-1]] = slots.to(torch.int32)
    return out.cuda()


@pytest.mark.parametrize("B,H,topk", [(16, 16, 2048), (8, 128, 2048), (4, 64, 100)])
def test_sparse_decode(B, H, topk):
    gen = torch.Generator().manual_seed(topk + H)
    lens = torch.randint(0, 5000, (B,), generator=gen).tolist()
    lens[0] = 0  # an all -1 index row
    q, cache, table, seq_lens, gen = _fp8_paged(lens, B + H, H)
    idx = _indices(seq_lens, table, 1, topk, gen)
    out, lse = sparse_decode(q, cache, idx, SCALE, backend="flashmla")
    ref, ref_lse = torch.ops.mla.sparse_decode_ref(q.double(), cache, idx, SCALE, 512)
    _check(out, lse, ref, ref_lse)


def test_sparse_decode_compiled_and_graph_replay():
    B, H, topk = 8, 16, 512
    q, cache, table, seq_lens, gen = _fp8_paged([3000] * B, 5, H)
    st = {"q": q.clone(), "idx": _indices(seq_lens, table, 1, topk, gen)}
    fn = torch.compile(lambda q, i: sparse_decode(q, cache, i, SCALE, backend="flashmla"), fullgraph=True)
    graph, (out, lse) = capture(lambda: fn(st["q"], st["idx"]))
    for step in range(3):
        new_lens = torch.randint(0, 3001, (B,), generator=gen).to(torch.int32).cuda()
        new_lens[step] = 0
        st["idx"].copy_(_indices(new_lens, table, 1, topk, gen))
        st["q"].copy_(torch.randn(q.shape, generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = torch.ops.mla.sparse_decode_ref(st["q"].double(), cache, st["idx"], SCALE, 512)
        _check(out, lse, ref, ref_lse)


def test_fp8_decode_graph_replay_with_new_lengths():
    """Dense fp8 through FlashMLA (slot lists built from the table on the GPU) captured once, replayed
    with new lengths: the lists follow the lengths, nothing is read on the host."""
    B, H, s_q = 6, 16, 2
    q, cache, table, seq_lens, gen = _fp8_paged([700] * B, 11, H, s_q)
    st = {"q": q.clone(), "lens": seq_lens.clone()}
    fn = torch.compile(lambda q, n: decode_fp8(q, cache, table, n, SCALE, backend="flashmla"), fullgraph=True)
    graph, (out, lse) = capture(lambda: fn(st["q"], st["lens"]))
    for step in range(3):
        new_lens = torch.randint(0, 701, (B,), generator=gen).to(torch.int32)
        new_lens[step], new_lens[step + 1] = 0, 1  # nothing visible; only the second query sees a row
        st["lens"].copy_(new_lens.cuda())
        st["q"].copy_(torch.randn(q.shape, generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = torch.ops.mla.decode_fp8_ref(st["q"].double(), cache, table, st["lens"], SCALE, 512)
        _check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("H, s_q", [(16, 1), (128, 1), (130, 2)])
def test_flashmla_sparse_schedule_reuse_equals_calls_that_schedule_themselves(H, s_q, monkeypatch):
    """``REUSE_SPARSE_SCHEDULE`` (on by default): decode_fp8 through FlashMLA with the schedule
    of the first eager call kept for the later ones gives the same outputs, bit for bit, as calls that schedule
    themselves; a captured step replays with it and new lengths."""
    import mla_compile.ops.adapters.flashmla as fm

    q, cache, table, seq, _ = _fp8_paged([700, 64, 1, 2000, 130], seed=H + s_q, H=H, s_q=s_q)
    want = decode_fp8(q, cache, table, seq, SCALE, backend="flashmla")
    monkeypatch.setattr(fm, "REUSE_SPARSE_SCHEDULE", True)
    monkeypatch.setattr(fm, "_SPARSE_SCHEDULES", {})
    for _ in range(3):
        got = decode_fp8(q, cache, table, seq, SCALE, backend="flashmla")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(fm._SPARSE_SCHEDULES) == 1
    graph, outs = capture(lambda *a: decode_fp8(*a, SCALE, backend="flashmla"), q, cache, table, seq)
    seq.copy_(torch.tensor([1, 2000, 64, 700, 0], dtype=torch.int32))
    graph.replay()
    fresh = decode_fp8(q, cache, table, seq, SCALE, backend="flashmla")
    monkeypatch.setattr(fm, "REUSE_SPARSE_SCHEDULE", False)
    alone = decode_fp8(q, cache, table, seq, SCALE, backend="flashmla")
    for a, b, c in zip(outs, fresh, alone):
        assert torch.equal(a, c) and torch.equal(b, c)
