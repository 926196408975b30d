"""FlashMLA's split schedule made once a step (``ops.decode_step_schedule``) against a fake ``flash_mla``: its row
count known on the host, no scheduler launch for steps a split serves elsewhere, a split's and a tier's FlashMLA part
taking it, and the model making it once before its layers (eager and regionally compiled) with every layer's call
running on it."""

from __future__ import annotations

import copy

import pytest
import torch

from mla_compile.ops import decode_step_schedule
from mla_compile.ops.adapters import flashmla as fm
from mla_compile.ops.registry import backends_for, call_impl, declare_split, step_schedule
from ..ref64 import Paged, fill_paged_cache, generator, randn

BF16 = torch.bfloat16


def _inputs(batch: int, heads: int = 2, s_q: int = 1, seed: int = 0):
    """``batch`` sequences of mixed lengths (0 among them) over pages of 64."""
    lens = tuple((0, 70, 1, 128, 64, 3)[i % 6] for i in range(batch))
    tables = tuple(tuple(range(3 * i, 3 * i + -(-n // 64))) for i, n in enumerate(lens))
    layout = Paged(64, 3 * batch, lens, tables, 3, 3)
    gen = generator(seed)
    cache = fill_paged_cache(layout, 576, BF16, gen)
    q = randn(gen, batch, s_q, heads, 576, dtype=BF16)
    return q, cache, layout.block_table(torch.int64), layout.seq_lens_tensor(torch.int64)


@pytest.mark.parametrize("heads, s_q", [(2, 1), (16, 1), (64, 1), (65, 1), (128, 1), (128, 2)])
def test_the_schedule_rows_are_known_on_the_host(fake_flash_mla, heads, s_q):
    """The op's fake sizes the schedule as FlashMLA's legacy scheduler does (SMs over the SMs of a 64-row head tile),
    so a compiled step has no data-dependent size; the real op returns FlashMLA's tensors of that size."""
    _, _, _, lens = _inputs(3)
    parts = fm.schedule_parts(lens.device, heads, s_q)
    assert parts == fm.HOST_SM_COUNT // -(-heads * s_q // 64)
    tiles, splits = fm.flashmla_decode_schedule(lens, heads, s_q)
    assert tiles.shape == (parts, 8) and splits.shape == (4,) and tiles.dtype == splits.dtype == torch.int32
    [(args, kw)] = fake_flash_mla.named("get_mla_decoding_metadata")
    assert args[1:] == (s_q * heads, 1) and kw["h_q"] == heads and kw["use_legacy"] is True
    torch.library.opcheck(torch.ops.mla.flashmla_decode_schedule.default, (lens, heads, s_q, 0, -1),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_schedule_of_another_size_is_an_error(fake_flash_mla, monkeypatch):
    """A flash_mla whose scheduler sizes its schedule otherwise is refused with the sizes named, not run."""
    lib = __import__("sys").modules["flash_mla"]
    made = lib.get_mla_decoding_metadata
    monkeypatch.setattr(lib, "get_mla_decoding_metadata", lambda *a, **k: (made(*a, **k)[0][:1], made(*a, **k)[1]))
    _, _, _, lens = _inputs(3)
    with pytest.raises(RuntimeError, match=r"schedule of \[1, 8\] rows, schedule_parts expects \[4, 8\]"):
        fm.flashmla_decode_schedule(lens, 128)


@pytest.mark.parametrize("batch, min_rows, max_rows, made", [
    (4, 4, -1, False), (5, 4, -1, True), (3, 0, 2, False), (2, 0, 2, True), (2, 1, 2, True)])
def test_steps_outside_the_bounds_launch_no_scheduler(fake_flash_mla, batch, min_rows, max_rows, made):
    _, _, _, lens = _inputs(batch)
    tiles, splits = fm.flashmla_decode_schedule(lens, 2, min_rows=min_rows, max_rows=max_rows)
    assert tiles.shape == (fm.schedule_parts("cpu", 2), 8) and splits.shape == (batch + 1,)
    assert bool(fake_flash_mla.named("get_mla_decoding_metadata")) is made


def test_a_split_hands_the_step_schedule_to_its_flashmla_part(fake_flash_mla):
    """``split:reference:2/flashmla``: the schedule is made for steps of more than 2 rows only; such a step's
    FlashMLA call runs on it (no scheduling inside), a smaller step runs the reference on its own, both equal to
    the parts called directly."""
    split = declare_split("decode", ((2, "reference"), (None, "flashmla")))
    assert split.schedule_fn is not None
    for batch, part in ((5, "flashmla"), (2, "reference")):
        fake_flash_mla.clear()
        q, cache, table, lens = _inputs(batch, seed=batch)
        args = (q, cache, table, lens, 0.1, 512)
        sched = decode_step_schedule(lens, 2, split.name)
        assert len(fake_flash_mla.named("get_mla_decoding_metadata")) == (part == "flashmla")
        out, lse = call_impl("decode", split, args, None, sched)
        want = backends_for("decode")[part].fn(*args)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        if part == "flashmla":
            meta = fake_flash_mla.named("flash_mla_with_kvcache")[0][0][5]
            assert meta.tile_scheduler_metadata is sched[0] and meta.num_splits is sched[1]


def test_flashmla_tiered_schedules_only_the_steps_flashmla_serves(fake_flash_mla):
    """``flashmla-tiered`` (Triton up to ``SMALL_ROWS`` rows, FlashMLA above) takes the step schedule; it is made for
    steps of more than ``SMALL_ROWS`` rows, and such a step's call runs on it."""
    small = fm.SMALL_ROWS
    _, _, _, lens = _inputs(small)
    step_schedule("decode", "flashmla-tiered", lens, 2)
    assert not fake_flash_mla.named("get_mla_decoding_metadata")
    q, cache, table, lens = _inputs(small + 1, seed=3)
    sched = step_schedule("decode", "flashmla-tiered", lens, 2)
    assert len(fake_flash_mla.named("get_mla_decoding_metadata")) == 1
    args = (q, cache, table, lens, 0.1, 512)
    out, lse = call_impl("decode", backends_for("decode")["flashmla-tiered"], args, None, sched)
    meta = fake_flash_mla.named("flash_mla_with_kvcache")[-1][0][5]
    assert meta.num_splits is sched[1]
    want = fm.flashmla_decode_core(*args)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert step_schedule("decode", "gluon", lens, 2) is None and step_schedule("decode", "reference", lens, 2) is None


@pytest.mark.parametrize("regional", [False, True], ids=["eager", "regional compile"])
def test_the_model_makes_one_schedule_a_step_for_every_layer(fake_flash_mla, allow_cpu, regional):
    """A model whose decode runs FlashMLA makes the step's schedule once before its layers: one scheduler call a
    decode step, each layer's FlashMLA call on its tensors; tokens and logits equal those of the same model
    scheduling in every call (``step_schedule = False``); regionally compiled (fullgraph) the same."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.model import patch
    from mla_compile.serving.generate import greedy_generate

    allow_cpu("mla.decode", "flashmla")
    torch._dynamo.reset()
    layers, prompts, new = 3, toy.random_prompts(5, [9, 70]), 3
    hf = toy.toy_hf_model("v2-lite", seed=2, dtype=BF16, num_hidden_layers=layers)
    per_call = patch(copy.deepcopy(hf), backend="decode=flashmla")
    per_call.step_schedule = False
    per_call.allocate_cache(8, 64, fill=float("nan"))
    want = greedy_generate(per_call, prompts, new, block_size=64, num_blocks=8, keep_logits=True)
    assert not fake_flash_mla.named("get_mla_decoding_metadata")
    per_step_calls = len(fake_flash_mla.named("flash_mla_with_kvcache"))
    assert per_step_calls == (new - 1) * layers  # the decode steps (the first token comes from the prefill)

    fake_flash_mla.clear()
    model = patch(hf, backend="decode=flashmla", regional_compile=regional)
    model.allocate_cache(8, 64, fill=float("nan"))
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if regional else model
    got = greedy_generate(run, prompts, new, block_size=64, num_blocks=8, keep_logits=True)
    assert got.tokens == want.tokens
    for a, b in zip(got.step_logits, want.step_logits, strict=True):
        assert torch.equal(a, b)
    scheduled = fake_flash_mla.named("get_mla_decoding_metadata")
    calls = fake_flash_mla.named("flash_mla_with_kvcache")
    assert len(scheduled) == new - 1 and len(calls) == per_step_calls
    for step in range(new - 1):  # each step's layers share one schedule
        metas = [args[5] for args, _ in calls[step * layers:(step + 1) * layers]]
        assert len({id(m.num_splits) for m in metas}) == 1 and metas[0].num_splits.shape == (2 + 1,)
    torch._dynamo.reset()
