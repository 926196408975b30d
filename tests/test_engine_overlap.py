"""``Engine(overlap=True)``: tokens fed back on the device, the next step launched before the host reads the
last one's tokens. Seeded traces give the same tokens and finish reasons as without overlap; the one-step-late
bookkeeping (stop tokens, ``max_new_tokens``, aborts and failures while a step is in flight) is checked step
by step on the eager CPU runner (the padded steps the CUDA graphs replay, the token feed included)."""

import pytest
import torch

from mla_compile.app import toy
from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.models.model import patch
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.decode_rows import DecodeRows
from mla_compile.serving.engine import Engine, StepFailed
from mla_compile.serving.sampling import SamplingParams

from tests.engine_load import (TINY_V3, FailingRunner, check_trace, make_trace, run_trace, run_workload,
                               with_sampling)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():
    """A float64 tiny V3 toy (97-token vocabulary, 64 positions; tokens do not depend on the batch) with a
    40-block cache of 4 tokens."""
    model = patch(toy.toy_hf_model("v3", seed=3, dtype=torch.float64, **TINY_V3))
    model.allocate_cache(40, 4, fill=float("nan"))
    return model


class Spy:
    """Records every ``sample_step`` call of the runner it wraps (everything else is the runner's)."""

    def __init__(self, runner) -> None:
        self.runner, self.calls = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def sample_step(self, decode, prefill, params, steps, feed):
        if isinstance(decode, DecodeRows):  # the engine's decode batch: its rows as chunks, its own steps
            rec = dict(decode=decode.chunks(), prefill=[], steps=decode.steps[:len(decode)].tolist(),
                       feed=[int(f) for f in feed])
        else:
            rec = dict(decode=list(decode), prefill=list(prefill), steps=list(steps), feed=list(feed))
        self.calls.append(rec)
        return self.runner.sample_step(decode, prefill, params, steps, feed)


def _engine(model, overlap, sampling=False, fail_from=None, spy=False, max_batch=8, **kw):
    builder = MetadataBuilder(max_batch=max_batch, max_blocks_per_seq=16, max_tokens=16, block_size=4, device="cpu")
    runner = DecodeGraphRunner(model, builder, sampling=sampling)
    if fail_from is not None:
        runner = FailingRunner(runner, fail_from)
    if spy:
        runner = Spy(runner)
    return Engine(runner, num_blocks=40, overlap=overlap, **kw)


def _results(engine, seen):
    """Per trace index: (finish reason, output) of every admitted request."""
    return {i: (engine.requests[rid].finish_reason, engine.requests[rid].output) for i, rid in seen.ids.items()}


def test_a_sampled_trace_with_stop_tokens_and_aborts_gives_the_tokens_and_reasons_of_no_overlap(tiny):
    """A 1000-step trace: random arrivals, shared prefixes, greedy / seeded / unseeded sampling with stop tokens, bad requests and
    aborts. Stops are learned one step late with overlap (the stopped request has one more row, admissions
    may come a step later), so a request aborted at a given step may hold one token less or more; every other
    request gets exactly the same tokens and finish reason."""
    runs = []
    for overlap in (False, True):
        for sampling in ((False,) if not overlap else (False, True)):
            trace = with_sampling(make_trace(21, 1000, vocab_size=97, max_total=64), seed=5, vocab_size=97, stops=True)
            engine = _engine(tiny, overlap, sampling=sampling)
            seen = run_trace(engine, trace)
            assert not engine.waiting and not engine.running and engine._inflight is None
            assert engine.blocks.num_free == 40 and all(b.ref == 0 for b in engine.blocks.blocks)
            runs.append((_results(engine, seen), seen, trace))
    (want, want_seen, trace), *others = runs
    assert min(seen.steps for _, seen, _ in runs) >= 1000  # issue #26: a 1000-step trace
    reasons = [reason for reason, _ in want.values()]
    assert reasons.count("stop") > 15 and reasons.count("length") > 30 and reasons.count("abort") > 5
    for got, seen, _ in others:
        assert got.keys() == want.keys() and seen.rejected.keys() == want_seen.rejected.keys()
        aborted = {i for i, (reason, _) in (*got.items(), *want.items()) if reason == "abort"}
        for i in want:
            (reason, out), (want_reason, want_out) = got[i], want[i]
            if i in aborted:  # both prefixes of the request's one token sequence
                short, long = sorted((out, want_out), key=len)
                assert long[:len(short)] == short, (i, out, want_out)
            else:
                assert (reason, out) == (want_reason, want_out), (i, trace[i].max_new_tokens)
        assert sum(i not in aborted for i in want) > 100
    for i, (reason, out) in want.items():
        params = trace[i].max_new_tokens
        stops = params.stop_token_ids if isinstance(params, SamplingParams) else ()
        assert not any(t in stops for t in out[:-1])
        assert reason != "stop" or out[-1] in stops


@pytest.mark.parametrize("sampling", [False, True], ids=["sampled after the step", "sampled in the step"])
def test_a_trace_without_stop_tokens_is_served_step_for_step_as_without_overlap(tiny, sampling):
    """Without stop tokens the host knows every finish before the step that draws it is launched, so overlap
    runs the very same steps: same admissions, the same failing runner call, aborts that see (after waiting
    for the step in flight) the same tokens. Everything matches: tokens, reasons, the lengths at abort, the
    failed step's requests, the steps run."""
    runs = []
    for overlap in (False, True):
        trace = with_sampling(make_trace(13, 220, vocab_size=97, max_total=64), seed=8, vocab_size=97)
        engine = _engine(tiny, overlap, sampling=sampling, fail_from=120)
        seen = run_trace(engine, trace)
        counts = check_trace(engine, trace, seen)
        runs.append((_results(engine, seen), seen.aborted, dict(seen.abort_states),
                     [sorted(f.request_ids) for f in seen.failures], seen.steps, counts))
    assert runs[0] == runs[1]
    counts, states = runs[1][-1], runs[1][2]
    assert counts["aborted"] > 10 and counts["failed"] >= 2 and min(states.values()) >= 2


def test_a_stop_token_is_learned_one_step_late_and_its_extra_row_is_dropped(tiny):
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=12)
    plain = _engine(tiny, overlap=False)
    plain.add_request([1, 2, 3], params)
    (full,) = plain.run()
    stop = full.output[3]
    n = full.output.index(stop)  # the request stops on its n-th token (0-based)
    assert n >= 2  # a few decode steps before it
    engine = _engine(tiny, overlap=True, spy=True)
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_new_tokens=12,
                                                       stop_token_ids=(stop,)))
    req = engine.requests[rid]
    streamed = []
    for call in range(n + 1):  # call k launches the step drawing token k and reads token k - 1
        assert engine.step() == []
        streamed += engine.new_tokens.get(rid, [])
        assert req.output == full.output[:call] and req in engine.running
    assert engine.step() == [req]  # launches an extra row (token n + 1), then reads the stop token
    streamed += engine.new_tokens[rid]
    assert req.finish_reason == "stop" and req.output == full.output[:n + 1] == streamed
    extra = engine.runner.calls[n + 1]
    assert len(extra["decode"]) == 1 and not extra["prefill"] and extra["steps"] == [n + 1]
    assert extra["feed"] == [0]  # fed from the stop token's row
    assert engine._inflight is None  # nothing was left running: the extra row was waited for and dropped
    assert engine.step() == [] and len(engine.runner.calls) == n + 2 and req.output == full.output[:n + 1]
    assert engine.blocks.num_free == 40


def test_max_new_tokens_is_known_ahead_the_request_leaves_the_batch_when_its_last_step_is_launched(tiny):
    engine = _engine(tiny, overlap=True, spy=True)
    short = engine.requests[engine.add_request([4, 5, 6, 7, 8], 2)]  # 2 blocks
    long = engine.requests[engine.add_request([9, 10], 5)]
    assert engine.step() == []  # prefill both; nothing read yet
    free = engine.blocks.num_free
    assert engine.step() == [] and [len(r.output) for r in (short, long)] == [1, 1]
    # the step drawing short's last token is in flight: short left running and freed its blocks already
    assert short not in engine.running and short.finish_reason is None and engine.blocks.num_free == free + 2
    assert engine.step() == [short] and short.finish_reason == "length" and len(short.output) == 2
    assert [len(c["decode"]) for c in engine.runner.calls] == [0, 2, 1]  # no row for short after its last
    assert engine.runner.calls[1]["feed"] == [0, 1] and engine.runner.calls[2]["feed"] == [1]
    assert engine.runner.calls[1]["steps"] == [1, 1] and engine.runner.calls[2]["steps"] == [2]
    done = engine.run()
    assert long.finish_reason == "length" and len(long.output) == 5 and done[-1] is long
    plain = _engine(tiny, overlap=False)
    ids = [plain.add_request([4, 5, 6, 7, 8], 2), plain.add_request([9, 10], 5)]
    plain.run()
    assert [plain.requests[i].output for i in ids] == [short.output, long.output]


def test_a_prompt_completed_in_a_mixed_step_decodes_next_step_on_its_fed_first_token(tiny):
    """A long prompt in chunks beside decoding rows: the step after its last chunk decodes it with the first
    token gathered on the device from the chunk's row (the host id is only a placeholder)."""
    engine = _engine(tiny, overlap=True, spy=True)
    a = engine.requests[engine.add_request([1, 2, 3], 6)]
    engine.step()
    b = engine.requests[engine.add_request(list(range(20, 45)), 3)]  # 25 tokens: chunks of 14 and 11
    for _ in range(3):
        engine.step()
    calls = engine.runner.calls
    assert [len(c["prefill"]) for c in calls[:3]] == [1, 1, 1] and [len(c["decode"]) for c in calls[:4]] == [0, 1, 1, 2]
    assert calls[2]["prefill"][0].start == 14 and calls[2]["feed"] == [0]  # a decodes beside b's last chunk
    assert calls[3]["feed"] == [0, 1]  # b's first token: row 1 of the mixed step (after a's decode row)
    assert calls[3]["decode"][1].tokens == [0] and calls[3]["decode"][1].start == 25 and calls[3]["steps"] == [3, 1]
    engine.run()
    plain = _engine(tiny, overlap=False)
    ids = [plain.add_request([1, 2, 3], 6)]
    plain.step()
    ids.append(plain.add_request(list(range(20, 45)), 3))
    plain.run()
    assert [plain.requests[i].output for i in ids] == [a.output, b.output]


def test_abort_while_a_step_is_in_flight_keeps_that_step_s_token_and_nothing_after(tiny):
    plain, engine = _engine(tiny, overlap=False), _engine(tiny, overlap=True, spy=True)
    for e in (plain, engine):
        for prompt in ([1, 2, 3], [4, 5, 6, 7]):
            e.add_request(prompt, SamplingParams(temperature=1.0, seed=len(prompt), max_new_tokens=8))
        for _ in range(4):
            e.step()
    (learned,) = {tuple(engine.new_tokens)}  # what the 4th call read: the 3rd step's tokens
    assert learned == (0, 1) and [len(r.output) for r in engine.running] == [3, 3]
    got, want = engine.abort(0), plain.abort(0)
    assert got.finish_reason == "abort" and got.output == want.output and len(got.output) == 4
    assert engine._inflight is None and engine.blocks.num_free == plain.blocks.num_free
    engine.step()
    assert engine.new_tokens[0] == got.output[-1:]  # the token the abort waited for is reported next
    assert [c.start for c in engine.runner.calls[-1]["decode"]] == [4 + 3]  # only request 1 decodes
    assert engine.runner.calls[-1]["feed"] == [-1]  # its token was read by the abort: from the host
    engine.run()
    plain.run()
    assert engine.requests[1].output == plain.requests[1].output and engine.requests[0].output == got.output
    assert engine.abort(1).finish_reason == "length"  # finished: a no-op


def test_a_failing_launch_keeps_the_previous_step_s_tokens_and_fails_only_its_requests(tiny):
    """The third runner call raises while the second step is in flight: the second step's tokens are read
    first (kept), then the third step's requests fail; a request outside it goes on."""
    plain, engine = _engine(tiny, overlap=False, fail_from=2), _engine(tiny, overlap=True, fail_from=2)
    for e in (plain, engine):
        d = e.add_request([1, 2, 3], 5)
        e.step()
        long = e.add_request(list(range(60, 90)), 5)  # chunks of 14, 14, 2
        e.step()
        e.add_request([7, 8, 9], 5)  # admitted, but the budget is spent before it
        with pytest.raises(StepFailed) as info:
            e.step()
        assert sorted(info.value.request_ids) == [d, long] and "injected" in str(info.value.__cause__)
        e.run()
    for rid in plain.requests:
        a, b = plain.requests[rid], engine.requests[rid]
        assert (a.finish_reason, a.output) == (b.finish_reason, b.output)
    assert len(engine.requests[0].output) == 2 and engine.requests[2].finish_reason == "length"
    assert engine.blocks.num_free == 40


def test_stream_yields_each_step_s_tokens_one_step_late_and_they_add_up_to_the_outputs(tiny):
    engine = _engine(tiny, overlap=True)
    ids = [engine.add_request([i + 1, i + 2], SamplingParams(temperature=1.0, seed=i, max_new_tokens=3 + i))
           for i in range(4)]
    seen, finished, items = {}, [], 0
    for i, out in enumerate(engine.stream()):
        items += 1
        if i == 0:
            assert out.tokens == {} and out.finished == []  # the first step's tokens come with the second item
        for rid, toks in out.tokens.items():
            seen.setdefault(rid, []).extend(toks)
        finished += [r.id for r in out.finished]
        if i == 2:
            engine.abort(ids[3])  # waits for the step in flight; its token comes with the next item
    assert sorted(finished) == ids[:3] and engine.requests[ids[3]].finish_reason == "abort"
    assert all(seen[rid] == engine.requests[rid].output for rid in ids)
    # one step per token of the longest (5): once nothing is left running the last step is waited for at once
    assert items == 5


def test_overlap_needs_a_runner_that_feeds_tokens():
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=4, max_tokens=16, block_size=4, device="cpu")

    class Plain:
        def __init__(self):
            self.builder = builder

    with pytest.raises(ValueError, match="overlap=True needs a runner with enable_token_feed and sample_step"):
        Engine(Plain(), num_blocks=8, vocab_size=10, overlap=True)
    runner = DecodeGraphRunner(lambda *a: None, builder)
    Engine(runner, num_blocks=8, vocab_size=10, overlap=True)
    assert runner.token_feed is not None and runner.token_feed.index.tolist() == [-1] * 4
    with pytest.raises(ValueError, match="TokenFeed.fill: rows"):
        runner.token_feed.fill([8])


def test_kept_logits_and_tokens_of_a_workload_match_no_overlap():
    """``step(keep_logits=True)`` with overlap keeps each step's logits when its tokens are read: the same list,
    step for step, as without overlap (the toy's float32 logits are equal, not close: the same steps run)."""
    model = patch(toy.toy_hf_model("v2-lite", seed=9, num_hidden_layers=1))
    runs = []
    for overlap in (False, True):
        model.allocate_cache(96, 4)
        builder = MetadataBuilder(max_batch=8, max_blocks_per_seq=24, max_tokens=256, block_size=4, device="cpu")
        engine = Engine(DecodeGraphRunner(model, builder, capture_sizes=[2, 4, 8]), num_blocks=96, overlap=overlap)
        outputs, steps = run_workload(engine, seed=1, n_requests=8, max_new=30)
        runs.append((outputs, steps, engine.step_logits))
    (want, want_steps, want_logits), (got, got_steps, got_logits) = runs
    assert got == want and got_steps == want_steps > 20 and len(got_logits) == len(want_logits) == want_steps
    assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))


def test_an_error_met_reading_a_step_s_tokens_fails_that_step_s_requests_and_serving_goes_on(tiny):
    """An asynchronous device error shows only when the host waits for a step's tokens, after the next step
    was launched: that step's requests fail (``StepFailed``), the rows they still have in the step in flight
    are dropped, and a request added afterwards is served as alone."""

    class Broken:
        def synchronize(self):
            raise RuntimeError("injected asynchronous error")

    engine = _engine(tiny, overlap=True)
    ids = [engine.add_request([1, 2, 3], 8), engine.add_request([4, 5], 8)]
    engine.step()
    engine.step()
    copy = engine._host_tokens.copy
    engine._host_tokens.copy = lambda tokens: (copy(tokens)[0], Broken())
    engine.step()  # launches the poisoned step, reads the one before
    engine._host_tokens.copy = copy
    outputs = [list(engine.requests[i].output) for i in ids]
    with pytest.raises(StepFailed) as info:
        engine.step()  # launches one more step, then meets the error reading the poisoned one
    assert sorted(info.value.request_ids) == ids and "injected" in str(info.value.__cause__)
    assert [engine.requests[i].finish_reason for i in ids] == ["error", "error"] and not engine.running
    assert [engine.requests[i].output for i in ids] == outputs == [[o[0], o[1]] for o in outputs]
    late = engine.add_request([7, 8, 9], 4)
    engine.run()
    assert [engine.requests[i].output for i in ids] == outputs  # the dropped rows added nothing
    alone = _engine(tiny, overlap=False)
    alone.add_request([7, 8, 9], 4)
    assert engine.requests[late].output == alone.run()[0].output
    assert engine.blocks.num_free == 40 and all(b.ref == 0 for b in engine.blocks.blocks)


def test_a_failed_read_forgets_the_prompt_blocks_its_launch_registered_and_fails_the_step_fed_by_it(tiny):
    """Overlap registers a step's full prompt blocks at launch. If reading that step's tokens then fails (an
    asynchronous device error), its blocks may hold garbage: a request admitted meanwhile with a prefix hit on
    them (in the step launched after it) fails too, and no later prompt finds them."""

    class Broken:
        def synchronize(self):
            raise RuntimeError("injected asynchronous error")

    engine = _engine(tiny, overlap=True)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # three full blocks of 4
    a = engine.add_request(prompt, 4)
    copy = engine._host_tokens.copy
    engine._host_tokens.copy = lambda tokens: (copy(tokens)[0], Broken())
    engine.step()  # launches a's prompt (its blocks findable now); nothing to read yet
    engine._host_tokens.copy = copy
    assert len(engine.blocks.cached) == 3
    b = engine.add_request(prompt + [30, 31], 4)
    with pytest.raises(StepFailed) as info:
        engine.step()  # admits b on a prefix hit, launches it beside a's decode, then meets the error
    assert engine.requests[b].alloc.cached_tokens == 12  # b did read a's blocks
    assert sorted(info.value.request_ids) == [a, b]
    assert [engine.requests[i].finish_reason for i in (a, b)] == ["error", "error"]
    assert engine.blocks.cached == {} and engine._inflight is None
    c = engine.add_request(prompt, 4)
    engine.run()
    assert engine.requests[c].alloc.cached_tokens == 0  # computed afresh
    alone = _engine(tiny, overlap=False)
    alone.add_request(prompt, 4)
    assert engine.requests[c].output == alone.run()[0].output
    assert engine.blocks.num_free == 40 and all(b.ref == 0 for b in engine.blocks.blocks)


def test_a_request_admitted_on_a_hit_of_a_failed_step_s_blocks_fails_even_if_not_scheduled_yet(tiny):
    """The prefix hit can come before any step of its request: admitted while the failed step was in flight, on
    its (unverified) prompt blocks, but left out of the next step by the token budget. It fails too."""

    class Broken:
        def synchronize(self):
            raise RuntimeError("injected asynchronous error")

    engine = _engine(tiny, overlap=True)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    a = engine.add_request(prompt, 4)
    copy = engine._host_tokens.copy
    engine._host_tokens.copy = lambda tokens: (copy(tokens)[0], Broken())
    engine.step()
    engine._host_tokens.copy = copy
    d = engine.add_request(list(range(40, 55)), 4)  # a fresh prompt: the next step's budget goes to it
    hit = engine.add_request(prompt + [30, 31], 4)
    with pytest.raises(StepFailed) as info:
        engine.step()
    assert engine.requests[hit].alloc.cached_tokens == 12  # admitted on a's blocks, not scheduled
    assert sorted(info.value.request_ids) == sorted([a, d, hit])
    assert engine.requests[hit].finish_reason == "error" and not engine.running and engine.blocks.cached == {}
    assert engine.blocks.num_free == 40 and all(b.ref == 0 for b in engine.blocks.blocks)
