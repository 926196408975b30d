"""FlashMLA adapter against a fake ``flash_mla``: the call measured on the H200 (fresh schedule metadata
per call, ``k_cache [blocks, 64, 1, 576]``, int32 tables, head_dim_v 512, ``use_legacy=True``, causal only
for s_q > 1), LSE ``[B, H, s_q] -> [B, s_q, H]``, undefined empty rows -> ``0 / -inf``, and outputs equal
to the float64 reference."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mla_compile.ops.adapters.flashmla import flashmla_decode_core
from ..ref64 import LSE_TOL, OUT_TOL, Paged, decode_ref64, fill_paged_cache, generator, randn

BF16 = torch.bfloat16
# lengths 0 (a padding slot), 1 (with s_q = 2 its first query sees nothing), across block edges
LAYOUT = Paged(64, 6, (0, 70, 1, 128), ((), (4, 1), (0,), (5, 2)), 3, 3)


def _inputs(s_q: int, heads: int = 2, seed: int = 0, dtype=BF16, layout=LAYOUT):
    gen = generator(seed)
    cache = fill_paged_cache(layout, 576, dtype, gen)
    q = randn(gen, len(layout.seq_lens), s_q, heads, 576, dtype=dtype)
    return q, cache, layout.block_table(torch.int64), layout.seq_lens_tensor(torch.int64)


@pytest.mark.parametrize("s_q", [1, 2])
def test_call_contract_and_result(fake_flash_mla, s_q):
    q, cache, table, lens = _inputs(s_q)
    scale = 192 ** -0.5
    out, lse = flashmla_decode_core(q, cache, table, lens, scale, 512)

    assert len(fake_flash_mla.named("get_mla_metadata")) == 1
    [(args, kw)] = fake_flash_mla.named("flash_mla_with_kvcache")
    q_in, k_cache, bt, seqlens, head_dim_v, _meta = args
    assert q_in is q and k_cache.shape == (6, 64, 1, 576) and k_cache.data_ptr() == cache.data_ptr()
    assert bt.dtype == seqlens.dtype == torch.int32 and torch.equal(bt.long(), table) and head_dim_v == 512
    assert kw["softmax_scale"] == scale and kw["causal"] is (s_q > 1) and kw["use_legacy"] is True
    assert kw["indices"] is None and kw["is_fp8_kvcache"] is False

    ref_out, ref_lse = decode_ref64(q, cache, LAYOUT, scale, 512)
    assert out.shape == (4, s_q, 2, 512) and lse.shape == (4, s_q, 2) and lse.dtype == torch.float32
    assert out.is_contiguous() and lse.is_contiguous()
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])
    empty = ref_lse == float("-inf")
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all() and not out.isnan().any()


def test_each_call_gets_a_fresh_schedule(fake_flash_mla):
    q, cache, table, lens = _inputs(1)
    flashmla_decode_core(q, cache, table, lens, 0.1, 512)
    flashmla_decode_core(q, cache, table, lens + 0, 0.1, 512)  # the fake asserts the metadata is fresh
    assert len(fake_flash_mla.named("get_mla_metadata")) == 2


def test_the_custom_op_compiles_fullgraph(fake_flash_mla):
    q, cache, table, lens = _inputs(1, seed=3)
    fn = torch.compile(lambda *a: torch.ops.mla.decode_flashmla(*a, 0.1, 512), fullgraph=True, backend="aot_eager")
    out, lse = fn(q, cache, table, lens)
    want_out, want_lse = flashmla_decode_core(q, cache, table, lens, 0.1, 512)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    torch.library.opcheck(torch.ops.mla.decode_flashmla.default, (q, cache, table, lens, 0.1, 512),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("change, message", [
    (dict(dtype=torch.float16), "backend 'flashmla' needs q in"),
    (dict(layout=Paged(16, 8, (20,), ((0, 1),), 2, 0)), r"needs block_size \(kv_cache.shape\[1\]\) in \[64\]"),
])
def test_refuses_what_flashmla_cannot_take(fake_flash_mla, change, message):
    q, cache, table, lens = _inputs(1, **change)
    with pytest.raises((TypeError, ValueError), match=message):
        flashmla_decode_core(q, cache, table, lens, 0.1, 512)
    assert not fake_flash_mla


def test_a_step_schedule_is_made_once_and_shared_by_the_layers(fake_flash_mla):
    """``flashmla_decode_schedule`` asks FlashMLA for the dense legacy schedule of the step (int32 lengths, s_q * H
    query rows on one KV head); two layers' calls with it take its tensors and schedule nothing themselves, with
    the same results as the calls that schedule inside."""
    from mla_compile.ops.adapters.flashmla import flashmla_decode_schedule

    q, cache, table, lens = _inputs(2, heads=3, seed=5)
    sched = flashmla_decode_schedule(lens, 3, 2)
    [(args, kw)] = fake_flash_mla.named("get_mla_decoding_metadata")
    assert args[0].dtype == torch.int32 and torch.equal(args[0].long(), lens) and args[1:] == (6, 1)
    assert kw == dict(h_q=3, is_fp8_kvcache=False, topk=None, use_legacy=True)
    want = flashmla_decode_core(q, cache, table, lens, 0.1, 512)
    fake_flash_mla.clear()
    for _ in range(2):  # two layers
        got = torch.ops.mla.decode_flashmla_scheduled(q, cache, table, lens, 0.1, 512, *sched)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    calls = fake_flash_mla.named("flash_mla_with_kvcache")
    assert len(calls) == 2 and not fake_flash_mla.named("get_mla_decoding_metadata")
    for args, _ in calls:
        meta = args[5]
        assert meta.tile_scheduler_metadata is sched.tile_scheduler_metadata and meta.num_splits is sched.num_splits


def test_schedule_reaches_only_the_backends_that_take_one(fake_flash_mla):
    from mla_compile.ops.adapters.flashmla import flashmla_decode_schedule
    from mla_compile.ops.registry import backends_for, call_impl

    q, cache, table, lens = _inputs(1)
    sched = flashmla_decode_schedule(lens, 2)
    args = (q, cache, table, lens, 0.1, 512)
    out, lse = call_impl("decode", backends_for("decode")["flashmla"], args, None, sched)
    assert fake_flash_mla.named("flash_mla_with_kvcache")[-1][0][5].num_splits is sched.num_splits
    want = flashmla_decode_core(*args)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    with pytest.raises(ValueError, match=r"schedule= is a step schedule of the backends that take one "
                                         r"\(\['flashmla-tiered', 'flashmla'\], and the splits that run them\).*backend 'reference' takes none"):
        call_impl("decode", backends_for("decode")["reference"], args, None, sched)
    with pytest.raises(ValueError, match="backend 'flashmla' got plan= too"):
        call_impl("decode", backends_for("decode")["flashmla"], args, object(), sched)


@pytest.mark.parametrize("which,bad,message", [
    (1, lambda t: t[:-1], r"schedule.num_splits must be int32 \[5\]"),
    (1, lambda t: t.long(), r"schedule.num_splits must be int32"),
    (0, lambda t: t[:, :4], r"schedule.tile_scheduler_metadata must be int32 \['\*', 8\]"),
])
def test_a_schedule_of_another_step_is_refused_before_flashmla_runs(fake_flash_mla, which, bad, message):
    from mla_compile.ops.adapters.flashmla import flashmla_decode_schedule

    q, cache, table, lens = _inputs(1)
    sched = list(flashmla_decode_schedule(lens, 2))
    sched[which] = bad(sched[which])
    with pytest.raises(ValueError, match=message):
        torch.ops.mla.decode_flashmla_scheduled(q, cache, table, lens, 0.1, 512, *sched)
    assert not fake_flash_mla.named("flash_mla_with_kvcache")


def test_a_scheduled_step_compiles_fullgraph(fake_flash_mla):
    """The schedule op and two scheduled calls in one graph (the schedule's row count known on the host:
    ``schedule_parts``); outputs equal eager."""
    from mla_compile.ops.adapters.flashmla import flashmla_decode_schedule

    q, cache, table, lens = _inputs(1, seed=4)

    def step(q, cache, table, lens):
        sched = flashmla_decode_schedule(lens, 2)
        a = torch.ops.mla.decode_flashmla_scheduled(q, cache, table, lens, 0.1, 512, *sched)
        b = torch.ops.mla.decode_flashmla_scheduled(q * 2, cache, table, lens, 0.1, 512, *sched)
        return a[0], b[1]

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, cache, table, lens)
    want = step(q, cache, table, lens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.library.opcheck(torch.ops.mla.decode_flashmla_scheduled.default,
                          (q, cache, table, lens, 0.1, 512, *flashmla_decode_schedule(lens, 2)),
                          test_utils=("test_schema", "test_faketensor"))
