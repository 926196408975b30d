"""Serving under data-parallel attention: one Engine per attention group, each step's shape agreed on the host
(mla_compile/serving/dp_sync.py) and every group's step padded to it.

- plan_step / MetadataBuilder padding to a given token and row count: the real part unchanged, padding tokens
  write nothing, and a toy model's logits of the real rows equal the unpadded step's (single process).
- the agreement itself, without a model: the pure rule and DPStepSync over 2 gloo processes.
- two attention groups (dp_attention=2 on 2 gloo processes) serving different seeded traces: every request's
  tokens equal the unsharded model serving it alone; padding-only steps while a group is idle; no hang.
"""

import copy

import numpy as np
import pytest
import torch

from mla_compile.models.metadata import SeqChunk, plan_step, step_size
from mla_compile.serving.dp_sync import StepAgreement, StepDemand, StepShape, agree_shape
from tests import dp_serving_workers as w
from tests.dist_helpers import run_ranks

BS = 4


def _random_chunks(gen, n_dec, prefill_lens, vocab=50):
    perm = torch.randperm(64, generator=gen).tolist()
    dec, pre, at = [], [], 0
    for _ in range(n_dec):
        start = int(torch.randint(1, 12, (1,), generator=gen))
        need = start // BS + 1
        dec.append(SeqChunk(perm[at:at + need], [int(torch.randint(0, vocab, (1,), generator=gen))], start))
        at += need
    for n in prefill_lens:
        start = int(torch.randint(0, 2, (1,), generator=gen)) * BS
        need = -(-(start + n) // BS)
        pre.append(SeqChunk(perm[at:at + need], torch.randint(0, vocab, (n,), generator=gen).tolist(), start))
        at += need
    return dec, pre


@pytest.mark.parametrize("n_dec,prefill_lens", [(0, [5]), (3, []), (1, [1]), (2, [3, 7]), (0, [1]), (5, [2, 2, 9])])
def test_plan_step_pads_to_tokens_and_rows_without_touching_the_real_part(n_dec, prefill_lens):
    gen = torch.Generator().manual_seed(n_dec * 31 + len(prefill_lens))
    dec, pre = _random_chunks(gen, n_dec, prefill_lens)
    base = plan_step(dec, pre, BS)
    T, R = step_size(n_dec, sum(prefill_lens), len(prefill_lens))
    assert (base.input_ids.shape[0], base.meta.logits_indices.shape[0]) == (T, R)
    with pytest.raises(ValueError, match="tokens=.* is below"):
        plan_step(dec, pre, BS, tokens=T - 1)
    with pytest.raises(ValueError, match="rows=.* is below"):
        plan_step(dec, pre, BS, rows=R - 1)
    step = plan_step(dec, pre, BS, tokens=T + 5, rows=R + 3)
    assert step.input_ids.shape[0] == T + 5 and step.meta.logits_indices.shape[0] == R + 3
    assert step.num_rows == base.num_rows
    for a, b in ((step.input_ids, base.input_ids), (step.positions, base.positions),
                 (step.meta.slot_mapping, base.meta.slot_mapping),
                 (step.meta.logits_indices, base.meta.logits_indices)):
        assert torch.equal(a[:b.shape[0]], b)
    assert (step.meta.slot_mapping[T:] == -1).all() and (step.input_ids[T:] == 0).all()
    assert (step.meta.logits_indices[R:] < T + 5).all()
    pm = step.meta.prefill
    assert pm is not None  # padding tokens always belong to a prefill part
    if pre:
        assert torch.equal(pm.cu_seqlens_q, base.meta.prefill.cu_seqlens_q)
    else:  # an empty one: no sequence
        assert int(pm.cu_seqlens_q.abs().sum()) == 0 and pm.block_table.shape[0] == pm.cu_seqlens_q.shape[0] - 1
    if dec:
        assert torch.equal(step.meta.decode.block_table, base.meta.decode.block_table)


def test_padding_only_steps_and_decode_batch_without_chunks():
    step = plan_step([], [], BS, tokens=6, rows=3)
    assert step.num_rows == 0 and step.input_ids.shape[0] == 6 and step.meta.decode is None
    assert (step.meta.slot_mapping == -1).all() and step.meta.logits_indices.tolist() == [0, 0, 0]
    step = plan_step([], [], BS, decode_batch=4)
    assert step.meta.decode.seq_lens.tolist() == [0] * 4 and (step.meta.slot_mapping == -1).all()
    with pytest.raises(ValueError, match="at least one decode or prefill"):
        plan_step([], [], BS)


def test_padded_steps_give_the_same_logits_and_cache_on_a_toy_model():
    """The toy model over a NaN-filled cache: a step padded to more tokens / rows (and a padding-only step)
    gives the unpadded step's logits on its real rows and writes exactly the same cache slots (float32; other
    token counts round the later layers' inputs differently, hence the 1e-5 tolerance)."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.model import patch
    from mla_compile.serving.builder import MetadataBuilder

    model = patch(toy.toy_hf_model("v3", seed=5, num_hidden_layers=2))
    gen = torch.Generator().manual_seed(8)
    dec, pre = _random_chunks(gen, 2, [6], vocab=model.config.vocab_size)
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=8, max_tokens=64, block_size=BS, device="cpu")

    def run(decode, prefill, **kw):
        model.allocate_cache(64, BS, fill=float("nan"))
        with torch.no_grad():
            for c in [*decode, *prefill]:  # each sequence's context: written first, the same way each time
                if c.start:
                    model(*_prefill_inputs(c, torch.Generator().manual_seed(c.start), model.config.vocab_size))
            step = builder.build(decode, prefill, **kw)
            logits = model(step.input_ids, step.positions, step.meta)[:step.num_rows].clone()
        return logits, [a.kv_cache.clone() for a in model.attentions]

    want, cache = run(dec, pre)
    T, R = step_size(2, 6, 1)
    for d, p, kw in ((dec, pre, dict(tokens=T + 7, rows=R + 2)), (dec, [], dict(tokens=T + 3, rows=R + 1))):
        got, got_cache = run(d, p, **kw)
        base, base_cache = run(d, p)
        torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_cache, base_cache):  # the same slots written (later layers: rounding of other shapes)
            assert torch.equal(torch.isnan(a), torch.isnan(b))
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
    got, _ = run(dec, pre, tokens=T + 7, rows=R + 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(want).all()
    _, empty_cache = run([], [], tokens=9, rows=4)  # padding only: writes nothing
    assert all(bool(torch.isnan(c).all()) for c in empty_cache)


def test_v4_builder_pads_to_tokens_and_rows_and_the_real_rows_do_not_change():
    """``V4DecodeBuilder.build(tokens=, rows=)``: the chunks' tokens first, padding tokens of no sequence after
    (token 0, position 0, sequence -1, slot -1), the extra logits rows repeating the last; the DeepSeek-V4 toy over
    NaN-filled caches gives the unpadded step's logits on the real rows and writes the same cache rows; a
    padding-only step writes nothing; sizes below the step's own, or past max_tokens, are refused."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers has no DeepseekV4ForCausalLM")
    from mla_compile.app.v4_toy import toy_v4_model
    from mla_compile.models.model import patch
    from mla_compile.serving.v4_builder import V4Chunk, V4DecodeBuilder

    model = patch(toy_v4_model(3))
    builder = V4DecodeBuilder(max_batch=4, max_blocks_per_seq=8, max_entry_blocks=4, rates=model.rates,
                              block_size=BS, device="cpu", max_tokens=32)
    gen = torch.Generator().manual_seed(9)
    toks = torch.randint(0, model.config.vocab_size, (20,), generator=gen).tolist()
    entries = {r: [2 * i, 2 * i + 1] for i, r in enumerate(model.rates)}
    chunks = [V4Chunk(toks[:7], 0, [0, 1], entries, 0), V4Chunk(toks[7:12], 0, [2, 3], {r: [b + 4 for b in e]
                                                                                       for r, e in entries.items()}, 1)]

    def run(chunks, **kw):
        model.allocate_cache(16, BS, 16, 4, fill=float("nan"))
        step = builder.build([], chunks, **kw)
        with torch.no_grad():
            logits = model(step.input_ids, step.positions, step.meta)
        return step, logits, [a.kv_cache.clone() for a in model.attn]

    base, want, base_cache = run(chunks)
    step, got, cache = run(chunks, tokens=17, rows=5)
    assert step.input_ids.shape == (17,) and step.meta.logits_indices.tolist() == [6, 11, 11, 11, 11]
    assert step.meta.query_seq[12:].tolist() == [-1] * 5 and step.meta.slot_mapping[12:].tolist() == [-1] * 5
    assert step.num_rows == 2 and torch.isfinite(want).all()
    torch.testing.assert_close(got[:2], want, rtol=1e-5, atol=1e-5)
    for a, b in zip(cache, base_cache):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
    _, _, empty = run([], tokens=6, rows=3)
    assert all(bool(torch.isnan(c).all()) for c in empty)
    for kw in (dict(tokens=11, rows=2), dict(tokens=12, rows=1), dict(tokens=40, rows=2)):
        with pytest.raises(ValueError, match="tokens="):
            builder.build([], chunks, **kw)


def _prefill_inputs(chunk, gen, vocab):
    """A plain prefill of ``chunk``'s first ``start`` positions (its context), seeded tokens."""
    toks = torch.randint(0, vocab, (chunk.start,), generator=gen).tolist()
    step = plan_step([], [SeqChunk(chunk.blocks, toks, 0)], BS)
    return step.input_ids, step.positions, step.meta


def test_agree_shape_rule():
    def vecs(*demands):
        return list(np.max([StepDemand(*d).vector() for d in demands], axis=0))

    idle = (False, 0, False, 0, 0)
    assert agree_shape(vecs(idle, idle)) == StepAgreement(False, None)
    # in flight only (overlap): keep stepping, no model step
    assert agree_shape(vecs((True, 0, False, 0, 0), idle)) == StepAgreement(True, None)
    # decode only: the most decode rows; the idle group pads
    assert agree_shape(vecs((True, 3, False, 3, 3), idle, (True, 1, False, 2, 2))) == \
        StepAgreement(True, StepShape(True, decode_rows=3))
    # some group prefills: a mixed step of the most tokens and rows of any group
    a = (True, 5, False, *step_size(5, 0, 0))
    b = (True, 1, True, *step_size(1, 40, 2))
    assert agree_shape(vecs(a, b, idle)) == StepAgreement(True, StepShape(False, tokens=42, rows=5))
    # an idle group's tokens / rows never count
    assert StepDemand(True, 0, False, 2, 2).vector()[4:] == [0, 0]


def test_dp_step_sync_two_processes():
    demands = {0: [(True, 2, False, 2, 2), (True, 0, False, 0, 0), (False, 0, False, 0, 0), (True, 1, True, 9, 3)],
               1: [(True, 4, False, 4, 4), (True, 3, True, 20, 5), (False, 0, False, 0, 0), (False, 0, False, 0, 0)]}
    # fresh processes: the worker makes its own default group, and rank 1 ending it is what rank 0 must see
    res = run_ranks(w.sync_agreements, 2, demands, timeout=60, fresh=True)
    want = [StepAgreement(True, StepShape(True, decode_rows=4)),
            StepAgreement(True, StepShape(False, tokens=20, rows=5)),
            StepAgreement(False, None), StepAgreement(True, StepShape(False, tokens=9, rows=3))]
    for r in res:
        assert r["agreements"] == want
        assert r["any"] == [True, False]
        assert r["mismatch"] is not None and "differ across ranks" in r["mismatch"]
    assert res[1]["stopped"] is None and "a peer engine stopped stepping" in res[0]["stopped"]


@pytest.mark.parametrize("pconf,overlap", [(dict(tp=2, dp_attention=2, ep=2), False),
                                           (dict(tp=2, dp_attention=2), True)])
def test_two_attention_groups_serve_their_own_traces_with_the_tokens_of_each_request_alone(pconf, overlap):
    pytest.importorskip("transformers")
    res = run_ranks(w.dp_engine_equals_alone, 2, pconf, overlap, timeout=150)
    for r in res:
        assert r["same"], (r["got"], r["want"])
        assert r["finished"] == r["requests"] and r["after_run"] == 0
    a, b = res
    assert a["group"] != b["group"]
    # lockstep: the same steps and model calls everywhere, each call of one token count on both ranks
    assert a["steps"] == b["steps"] and a["calls"] == b["calls"] and a["agreements"] == b["agreements"]
    idle_first = res[[r["group"] for r in res].index(1)]
    assert len(idle_first["padding"]) >= 3 and idle_first["padding"][0] == 0  # group 1 pads before its arrivals
    assert any(r["mixed_padded"] for r in res)  # a decode-only group padded into another group's prefill step


@pytest.mark.parametrize("overlap", [False, True])
def test_deepseek_v4_two_attention_groups_serve_their_own_traces_as_each_request_alone(overlap):
    """DeepSeek-V4 sharded (DP attention + EP) under ``dp_sync``: each group's requests get the tokens the unsharded
    model gives each alone, and both ranks run the same model calls with the same token counts."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers has no DeepseekV4ForCausalLM")
    res = run_ranks(w.dp_v4_engine_equals_alone, 2, overlap, timeout=300)
    for r in res:
        assert r["same"], (r["got"], r["want"])
        assert r["finished"] == r["requests"]
    a, b = res
    assert {a["group"], b["group"]} == {0, 1} and a["local_experts"] * 2 == b["local_experts"] * 2 > 0
    assert a["steps"] == b["steps"] and a["calls"] == b["calls"] and len(a["calls"]) >= 10


def test_deepseek_v4_two_attention_groups_of_two_ranks_splitting_heads_four_processes():
    """DeepSeek-V4 as tp=4, dp_attention=2, ep=4 under ``dp_sync``: each group's two ranks split its heads and run the
    same engine on the group's trace; every request's tokens equal the unsharded model's alone."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers has no DeepseekV4ForCausalLM")
    res = run_ranks(w.dp_v4_engine_equals_alone, 4, False, 2, timeout=300)
    for r in res:
        assert r["same"], (r["got"], r["want"])
        assert r["finished"] == r["requests"] and r["local_experts"] * 4 == 4
    assert [r["group"] for r in res] == [0, 0, 1, 1]
    assert all(r["steps"] == res[0]["steps"] and r["calls"] == res[0]["calls"] for r in res)


def test_two_attention_groups_of_two_ranks_each_four_processes():
    """tp=4, dp_attention=2: each group's two ranks split its heads and run the same engine on the same trace."""
    pytest.importorskip("transformers")
    res = run_ranks(w.dp_engine_equals_alone, 4, dict(tp=4, dp_attention=2, ep=2), False, timeout=240)
    assert [r["group"] for r in res] == [0, 0, 1, 1]
    for r in res:
        assert r["same"], (r["got"], r["want"])
        assert r["calls"] == res[0]["calls"] and r["steps"] == res[0]["steps"]
    assert res[0]["padding"] == res[1]["padding"] and len(res[2]["padding"]) >= 3


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (a multi-GPU machine)")
@pytest.mark.parametrize("overlap", [False, True])
def test_two_attention_groups_on_two_gpus_compiled_and_captured(overlap):
    """NCCL on 2 GPUs: the sharded model compiled, its decode steps (padding-only ones too) replayed in CUDA graphs
    of the agreed capture size; every request gets the tokens of the unsharded model serving it alone."""
    pytest.importorskip("transformers")
    res = run_ranks(w.dp_engine_equals_alone, 2, dict(tp=2, dp_attention=2, ep=2), overlap, True, timeout=480,
                    fresh=True)
    for r in res:
        assert r["same"], (r["got"], r["want"])
        assert r["finished"] == r["requests"] and r["replays"] > 10
    assert res[0]["steps"] == res[1]["steps"] and res[0]["agreements"] == res[1]["agreements"]
    assert any(len(r["padding"]) >= 3 for r in res)


def test_engine_refuses_a_runner_or_builder_that_cannot_pad_before_any_collective():
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.engine import Engine

    class NoSync:  # any collective would fail: the checks must come first
        def __getattr__(self, name):
            raise AssertionError(f"collective {name} called before the runner was checked")

    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=8, max_tokens=64, block_size=BS, device="cpu")

    class OldRunner:
        def __init__(self, builder):
            self.builder = builder

        def run(self, decode, prefill=()):
            raise AssertionError

        def decode(self, chunks):
            raise AssertionError

    with pytest.raises(ValueError, match=r"runner whose run\(\) takes shape="):
        Engine(OldRunner(builder), num_blocks=16, vocab_size=10, dp_sync=NoSync())

    class OtherBuilder(MetadataBuilder):
        def build(self, decode, prefill=(), *, decode_batch=None, logits="last"):
            raise AssertionError

    class ShapeRunner(OldRunner):
        def run(self, decode, prefill=(), shape=None):
            raise AssertionError

        def decode(self, chunks, shape=None):
            raise AssertionError

    other = OtherBuilder(max_batch=4, max_blocks_per_seq=8, max_tokens=64, block_size=BS, device="cpu")
    with pytest.raises(ValueError, match=r"builder whose build\(\) pads to tokens= and rows="):
        Engine(ShapeRunner(other), num_blocks=16, vocab_size=10, dp_sync=NoSync())


@pytest.mark.parametrize("pconf,overlap", [(dict(tp=2, dp_attention=2, ep=2), False),
                                           (dict(tp=2, dp_attention=2), True)])
def test_a_step_failing_before_the_model_on_one_rank_fails_only_its_requests_and_every_rank_goes_on(pconf, overlap):
    """Rank 0's runner raises before calling its model at one step and its builder at another: rank 0 runs a
    padding-only step in their place, fails those steps' requests exactly as an engine without dp_sync failing the
    same steps does, and both ranks finish their traces (rank 1's requests with the tokens each gets alone)."""
    pytest.importorskip("transformers")
    res = run_ranks(w.dp_fail_before_model, 2, pconf, overlap, timeout=150)
    a, b = res
    assert a["group"] == 0 and b["group"] == 1
    assert len(a["failures"]) == 2 and all(a["failures"]) and a["failures"] == a["single_failures"]
    assert a["got"] == a["single"]  # the same tokens and finish reasons as without dp_sync
    failed = {i for ids in a["failures"] for i in ids}
    for i, ((out, reason), want) in enumerate(zip(a["got"], a["want"])):
        if i in failed:
            assert reason == "error" and out == want[:len(out)] and len(out) < len(want)
        else:
            assert (out, reason) == (want, "length")
    assert b["failures"] == [] and b["got"] == [(want, "length") for want in b["want"]]
    for r in res:
        assert r["finished"] == len(r["got"]) and r["all_free"]
    # lockstep: the same agreements and as many model runs on both ranks (rank 0's padding steps included)
    assert a["agreements"] == b["agreements"] and a["model_calls"] == b["model_calls"]


@pytest.mark.parametrize("overlap,linger", [(False, 0.0), (True, 11.0)])
def test_a_step_failing_inside_the_model_on_one_rank_ends_every_rank_with_dp_step_fatal(overlap, linger):
    """Rank 0's model raises inside a step (after the collectives of its first layer): no rank can go on in
    lockstep, so both ranks raise DPStepFatal instead of hanging, finish every request they hold, and every later
    step raises again. Rank 1 raises when its collective of that step fails: at once when rank 0's process ends,
    else (rank 0 lingers) at the 8 s process-group timeout."""
    pytest.importorskip("transformers")
    res = run_ranks(w.dp_fail_inside_model, 2, dict(tp=2, dp_attention=2, ep=2), overlap, 8, linger, timeout=120,
                    fresh=True)  # rank 0's process ends
    a, b = res
    assert "inside the model" in a["message"] and "injected failure inside the model" in a["message"]
    assert "inside the model" in b["message"]  # its collective of that step failed
    if linger:
        assert "timed out" in b["message"].lower()
    for r in res:
        assert r["error"] == "DPStepFatal" and r["ids"], r
        assert "stopped at an earlier fatal" in r["later"]
        assert "error" in r["reasons"] and set(r["reasons"]) <= {"error", "length"}
        assert r["unfinished"] == 0 and r["all_free"]


class _OneRankSync:
    """A DPStepSync of one rank without torch.distributed: each agreement is this rank's own demand."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.steps, self.fail_at = 0, fail_at

    def check_same(self, what, values):
        pass

    def agree(self, demand):
        from mla_compile.serving.dp_sync import DPStepFatal

        self.steps += 1
        if self.steps - 1 == self.fail_at:
            raise DPStepFatal("DPStepSync: the all-reduce of the step agreement failed (injected)")
        return agree_shape(demand.vector())


class _RaiseAfterModel(w.RaiseBeforeModel):
    """Raises on its calls ``fail_at`` (counted as ``RaiseBeforeModel`` counts) after the wrapped runner ran the
    step's model: from the engine's side, a runner that raised once its model had started."""

    def _after(self, decode, prefill):
        if len(decode) or len(prefill):
            self.calls += 1
            if self.calls - 1 in self.fail_at:
                raise RuntimeError(f"injected failure after the model in runner call {self.calls - 1}")

    def run(self, decode, prefill=(), shape=None):
        out = self.runner.run(decode, prefill, shape=shape)
        self._after(decode, prefill)
        return out

    def decode_sampled(self, chunks, params, steps, shape=None):
        out = self.runner.decode_sampled(chunks, params, steps, shape=shape)
        self._after(chunks, ())
        return out


@pytest.mark.parametrize("case", ["before_model", "builder", "after_runner", "inside_runner", "no_counter",
                                  "padding_fails", "agreement_fails"])
def test_which_step_failures_a_dp_engine_recovers_from(case):
    """One engine under a one-rank stand-in for DPStepSync, a step failing in each way: before the model (a
    runner raising before calling it, a builder error) it fails the step's requests (StepFailed) after running a
    padding-only step in its place (one more model run), after the runner returned it fails them without one;
    raising once the runner's model ran, without a model_calls counter, in the padding step that stands in or in
    the agreement is DPStepFatal: every request finished with "error", every block free, every later step raising
    it again."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.model import patch
    from mla_compile.serving.dp_sync import DPStepFatal
    from mla_compile.serving.engine import StepFailed

    model = patch(toy.toy_hf_model("v3", seed=2, num_hidden_layers=1, dtype=torch.float32))
    eng = w._engine(model, dp_sync=_OneRankSync(fail_at=1 if case == "agreement_fails" else None))
    inner = eng.runner
    if case == "before_model":
        eng.runner = w.RaiseBeforeModel(inner, {1})
    elif case == "builder":
        w.failing_build(inner.builder, 1)
    elif case == "inside_runner":
        eng.runner = _RaiseAfterModel(inner, {1})
    elif case == "no_counter":
        eng.runner = type("Uncounted", (w.RaiseBeforeModel,), {"model_calls": None})(inner, {1})
    elif case == "padding_fails":
        w.failing_build(inner.builder, 1)
        build = inner.builder.build
        inner.builder.build = lambda d, p=(), **kw: build(d, p, **kw) if len(d) or len(p) else 1 / 0
    elif case == "after_runner":
        sample, seen = eng._sample, []
        eng._sample = lambda logits, rows: sample(logits, rows) if seen.append(1) or len(seen) != 2 else 1 / 0
    ids = [eng.add_request(list(range(3 + i, 9 + 2 * i)), 6) for i in range(3)]
    eng.step()  # prefills
    before = inner.model_calls
    fatal = case in ("inside_runner", "no_counter", "padding_fails", "agreement_fails")
    with pytest.raises(DPStepFatal if fatal else StepFailed) as info:
        eng.step()
    assert isinstance(info.value, DPStepFatal) == fatal and not isinstance(info.value, StepFailed) == fatal
    if not fatal:
        # one model run: the padding step in place of a step that failed before its model, or the step itself
        # when it failed after the runner returned (no padding step then)
        assert inner.model_calls - before == 1
        assert info.value.request_ids and set(info.value.request_ids) <= set(ids)
        eng.run()
        assert all(eng.requests[i].finish_reason == ("error" if i in info.value.request_ids else "length")
                   for i in ids)
        return
    assert sorted(info.value.request_ids) == ids
    assert all(eng.requests[i].finish_reason == "error" for i in ids) and not eng.running and not eng.waiting
    assert eng.blocks.num_free == len(eng.blocks.blocks)
    for _ in range(2):
        with pytest.raises(DPStepFatal, match="stopped at an earlier fatal"):
            eng.step()
