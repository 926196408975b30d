"""The reference engine: arrivals, admission, block reuse, tokens equal to HF greedy decoding."""

import copy

import pytest
import torch

from mla_compile.app import toy
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.admission import RequestRejected
from mla_compile.serving.engine import Engine, StepFailed
from mla_compile.serving.generate import hf_greedy_reference
from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.models.model import patch
from mla_compile.serving.sampling import SamplingParams

from tests.engine_load import TINY_V3, FailingRunner, alone_outputs, check_trace, make_trace, run_trace

pytest.importorskip("transformers")


def _engine(model, num_blocks=64, max_batch=4, max_tokens=64, **kw):
    builder = MetadataBuilder(max_batch=max_batch, max_blocks_per_seq=16, max_tokens=max_tokens, block_size=4,
                              device="cpu")
    return Engine(DecodeGraphRunner(model, builder), num_blocks=num_blocks, **kw)


@pytest.mark.parametrize("kind", toy.KINDS)
def test_requests_joining_running_ones_match_hf(kind):
    hf = toy.toy_hf_model(kind, seed=8, num_hidden_layers=1, first_k_dense_replace=0)
    ref = copy.deepcopy(hf)
    model = patch(hf)
    model.allocate_cache(64, 4, fill=float("nan"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (6, 11, 2, 15, 4, 9)]
    new_tokens = [5, 3, 7, 4, 6, 2]
    engine = _engine(model)
    for p, n in zip(prompts[:3], new_tokens[:3]):
        engine.add_request(p, n)
    engine.step()
    engine.step()
    for p, n in zip(prompts[3:], new_tokens[3:]):  # max_batch 4: some wait for running ones to finish
        engine.add_request(p, n)
    done = engine.run()
    want = [hf_greedy_reference(ref, [p], n)[0][0] for p, n in zip(prompts, new_tokens)]
    assert [r.output for r in done] == want
    assert engine.blocks.num_free == 64  # every block came back (free or evictable)


def test_engine_rejects_requests_that_cannot_fit():
    model = patch(toy.toy_hf_model("v2-lite", seed=0, num_hidden_layers=1))
    model.allocate_cache(8, 4)
    engine = _engine(model, num_blocks=8, max_tokens=16)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        engine.add_request([1] * 60, 10)
    with pytest.raises(ValueError, match="non-empty"):
        engine.add_request([], 3)


def test_engine_rejects_a_request_larger_than_the_whole_cache():
    model = patch(toy.toy_hf_model("v2-lite", seed=0, num_hidden_layers=1))
    model.allocate_cache(2, 4)
    engine = _engine(model, num_blocks=2)
    with pytest.raises(RequestRejected, match=r"request 0: .* 14 tokens exceed the paged cache"):
        engine.add_request([1] * 12, 2)  # needs 3 blocks, only 2 exist: it could never be admitted
    assert not engine.waiting and not engine.requests


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefixes_and_long_prompts_in_chunks_match_hf(prefix_caching):
    """Prompts sharing a system prefix hit the prefix cache; a prompt longer than the step budget is
    prefilled in chunks while others decode. Tokens equal HF's either way."""
    hf = toy.toy_hf_model("v3", seed=12, num_hidden_layers=1, first_k_dense_replace=0)
    ref = copy.deepcopy(hf)
    model = patch(hf)
    model.allocate_cache(64, 4, fill=float("nan"))
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(0, 1024, (13,), generator=gen).tolist()
    prompts = [system + torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (3, 6, 1)]
    prompts.append(torch.randint(0, 1024, (40,), generator=gen).tolist())  # > the 16-token step budget
    engine = _engine(model, max_tokens=16, enable_prefix_caching=prefix_caching)
    engine.add_request(prompts[0], 4)
    engine.step()  # the first request computes (and registers) the shared prefix
    engine.step()
    for p in prompts[1:]:
        engine.add_request(p, 5)
    done = engine.run()
    want = [hf_greedy_reference(ref, [p], n)[0][0] for p, n in zip(prompts, [4, 5, 5, 5])]
    assert [r.output for r in done] == want
    assert (engine.cached_prompt_tokens == 24) if prefix_caching else (engine.cached_prompt_tokens == 0)


# ---------------------------------------------------------------- bad requests, aborts, failing steps


@pytest.fixture(scope="module")
def tiny():
    """A float64 tiny V3 toy (97-token vocabulary, 64 positions) with a 40-block cache of 4 tokens."""
    model = patch(toy.toy_hf_model("v3", seed=3, dtype=torch.float64, **TINY_V3))
    model.allocate_cache(40, 4, fill=float("nan"))
    return model


def _tiny_engine(model, num_blocks=40, fail_from=None, sampling=False, **kw):
    builder = MetadataBuilder(max_batch=8, max_blocks_per_seq=16, max_tokens=16, block_size=4, device="cpu")
    runner = DecodeGraphRunner(model, builder, sampling=sampling)
    if fail_from is not None:
        runner = FailingRunner(runner, fail_from)
    return Engine(runner, num_blocks=num_blocks, **kw)


# The clean trace (no aborts, bad requests or failures) is shorter: each request's tokens alone cost most of the
# time, and the faulty trace already drives 875 of its requests to their last token.
@pytest.mark.parametrize("n_requests, abort_rate, invalid_rate, fail_from", [(200, 0.0, 0.0, None),
                                                                          (1000, 0.1, 0.05, 300)])
def test_trace_with_aborts_bad_requests_and_a_failing_step_gives_each_request_its_tokens_alone(
        tiny, n_requests, abort_rate, invalid_rate, fail_from):
    """Seeded clients with shared prefixes arrive over time into a cache far smaller than their total;
    some abort, some send bad requests, one step fails. Every other request gets the tokens it gets
    alone, the aborted and failed ones a prefix of them; every block comes back."""
    trace = make_trace(7, n_requests, vocab_size=97, max_total=64, abort_rate=abort_rate,
                       invalid_rate=invalid_rate)
    engine = _tiny_engine(tiny, fail_from=fail_from)
    seen = run_trace(engine, trace)
    alone = alone_outputs(_tiny_engine(tiny, enable_prefix_caching=False), trace)
    counts = check_trace(engine, trace, seen, alone)
    demand = sum(-(-(len(r.prompt) + r.max_new_tokens) // 4) for r in trace if r.valid)
    # cache pressure (the valid requests' blocks: 24x the cache at 200 requests) and prefix hits
    assert demand > 20 * 40 and engine.cached_prompt_tokens > n_requests
    if fail_from is None:
        assert counts["finished"] == n_requests and not seen.failures
        return
    (failure,) = seen.failures
    assert isinstance(failure.__cause__, RuntimeError) and "injected" in str(failure.__cause__)
    assert counts["failed"] == len(failure.request_ids) >= 2
    assert counts["rejected"] > 30 and counts["aborted"] > 50
    assert min(seen.abort_states[s] for s in ("waiting", "prefill", "decode")) >= 5
    kinds = {e.field for e in seen.rejected.values()}
    assert kinds == {"prompt", "max_new_tokens", "prompt + max_new_tokens"}


def test_bad_requests_are_rejected_at_admission_and_the_valid_one_beside_them_finishes(tiny):
    """The issue's report: ids past the vocabulary, negative or float ids were queued and the next
    step raised inside the embedding, leaving the valid request stuck in ``running``."""
    engine = _tiny_engine(tiny)
    good = engine.add_request([0], 3)
    for prompt, message in (([5000], r"request 1: prompt\[0\] = 5000 is not a token id in \[0, 97\)"),
                            ([-1], r"request 2: prompt\[0\] = -1 is not a token id"),
                            ([1, 2, 1.5], r"request 3: prompt\[2\] = 1.5 \(float\) is not an int token id")):
        with pytest.raises(RequestRejected, match=message) as info:
            engine.add_request(prompt, 3)
        assert isinstance(info.value, ValueError) and info.value.position == len(prompt) - 1
    with pytest.raises(RequestRejected, match="request 4: .* exceed the model's max_position_embeddings = 64"):
        engine.add_request([1] * 60, 5)
    assert [r.id for r in engine.waiting] == [good]
    (done,) = engine.run()
    assert done.id == good and done.finish_reason == "length" and len(done.output) == 3
    assert engine.blocks.num_free == 40


def test_engine_limits_come_from_the_model_or_are_passed():
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=4, max_tokens=16, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(DecodeGraphRunner(lambda *a: None, builder), num_blocks=8)
    engine = Engine(DecodeGraphRunner(lambda *a: None, builder), num_blocks=8, vocab_size=10, max_positions=12)
    assert (engine.limits.vocab_size, engine.limits.max_positions, engine.limits.max_seq_tokens) == (10, 12, 16)
    with pytest.raises(RequestRejected, match=r"prompt\[1\] = 10 is not a token id in \[0, 10\)"):
        engine.add_request([9, 10], 1)
    model = patch(toy.toy_hf_model("v3", seed=3, **TINY_V3))
    assert Engine(DecodeGraphRunner(torch.compile(model), builder), num_blocks=8).limits.vocab_size == 97
    with pytest.raises(ValueError, match="vocab_size=98 exceeds the model's 97"):
        Engine(DecodeGraphRunner(model, builder), num_blocks=8, vocab_size=98)


def test_abort_while_waiting_prefilling_and_decoding_frees_blocks_and_keeps_shared_prefixes(tiny):
    """An abort takes effect at once in every state; a prefix block shared with an aborted request
    keeps serving the other one, whose tokens stay those it gets alone."""
    prefix = list(range(40, 52))  # 3 blocks
    a_prompt, b_prompt, long_prompt = prefix + [1, 2], prefix + [3], list(range(30))  # 30 > 16-token budget
    alone = _tiny_engine(tiny, enable_prefix_caching=False)
    want_b = alone.requests[alone.add_request(b_prompt, 6)]
    alone.run()
    engine = _tiny_engine(tiny)
    a = engine.add_request(a_prompt, 8)
    engine.step()  # a's prompt computed and its 3 full prefix blocks registered
    b = engine.add_request(b_prompt, 6)
    long = engine.add_request(long_prompt, 4)
    engine.step()  # b hits the prefix; long computes its first chunk
    shared = engine.requests[a].blocks[:3]
    assert engine.requests[b].blocks[:3] == shared and engine.requests[b].alloc.cached_tokens == 12
    assert engine.requests[long].prefilling and engine.requests[long].computed > 0
    for _ in range(7):
        engine.add_request([5, 6, 7], 2)  # more than max_batch: the last ones wait
    waiting = engine.waiting[-1].id
    decoded = len(engine.requests[a].output)
    assert engine.abort(a).output == engine.requests[a].output and len(engine.requests[a].output) == decoded
    assert [engine.blocks.blocks[i].ref for i in shared] == [1, 1, 1]  # b still holds them
    assert engine.abort(long).finish_reason == "abort" and engine.requests[long].output == []
    assert engine.abort(waiting).blocks == [] and engine.requests[waiting] not in engine.waiting
    assert engine.abort(a).finish_reason == "abort"  # a second abort changes nothing
    with pytest.raises(ValueError, match="request 999 is unknown"):
        engine.abort(999)
    done = engine.run()
    assert engine.requests[b].output == want_b.output and engine.requests[b].finish_reason == "length"
    assert engine.abort(b).finish_reason == "length"  # finished: a no-op
    assert {r.finish_reason for r in done} == {"length", "abort"} and len(done) == len(engine.requests)
    assert engine.blocks.num_free == 40 and all(blk.ref == 0 for blk in engine.blocks.blocks)


def test_a_failing_step_fails_its_requests_registers_nothing_half_done_and_serving_goes_on(tiny):
    """The failing step is the second chunk of a long prompt's prefill beside a decode: both requests
    fail; the block the failed chunk completed (its slots were written before the error) never becomes
    findable in the prefix cache; a running request that was not in the step finishes; the long prompt
    served again reuses only the first chunk's blocks and gets the tokens it gets alone."""
    long_prompt, short, queued = list(range(60, 90)), [1, 2, 3], [7, 8, 9]  # 30 tokens: chunks of 14, 14, 2
    alone = _tiny_engine(tiny, enable_prefix_caching=False)
    want = {tuple(p): alone.requests[alone.add_request(p, 5)].output for p in (long_prompt, short, queued)}
    alone.run()
    engine = _tiny_engine(tiny, fail_from=2)  # runner calls: prefill d | decode d + chunk 1 | d + chunk 2
    d = engine.add_request(short, 5)
    engine.step()
    long = engine.add_request(long_prompt, 5)
    engine.step()
    e = engine.add_request(queued, 5)  # admitted, but the step's token budget is spent before it
    with pytest.raises(StepFailed) as info:
        engine.step()
    assert engine.runner.failed_at == 2 and "injected" in str(info.value.__cause__)
    assert sorted(info.value.request_ids) == [d, long] and str(d) in str(info.value)
    assert [engine.requests[i].finish_reason for i in (d, long)] == ["error", "error"]
    assert engine.requests[d].output == want[tuple(short)][:2] and engine.requests[long].output == []
    assert [r.id for r in engine.running] == [e] and engine.requests[e].computed == 0
    registered = {b.key[1] for b in engine.blocks.blocks if b.key is not None}
    assert tuple(long_prompt[8:12]) in registered  # complete after chunk 1
    assert tuple(long_prompt[12:16]) not in registered  # completed only by the failed chunk 2
    again = engine.add_request(long_prompt, 5)
    engine.run()
    assert engine.requests[again].alloc.cached_tokens == 12
    assert engine.requests[again].output == want[tuple(long_prompt)]
    assert engine.requests[e].output == want[tuple(queued)]
    assert engine.blocks.num_free == 40 and all(blk.ref == 0 for blk in engine.blocks.blocks)


def test_run_admits_waiting_requests_after_every_running_one_finished_in_the_same_step(tiny):
    """``run`` used to call the engine stuck when the whole batch finished at once while others waited."""
    builder = MetadataBuilder(max_batch=2, max_blocks_per_seq=16, max_tokens=16, block_size=4, device="cpu")
    engine = Engine(DecodeGraphRunner(tiny, builder), num_blocks=40)
    for prompt in ([1, 2], [3, 4], [5, 6]):
        engine.add_request(prompt, 2)
    assert [len(r.output) for r in engine.run()] == [2, 2, 2]


def _mixed_requests():
    """Greedy (int) and seeded sampled requests, some sharing a prefix."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randint(0, 97, (9,), generator=gen).tolist()
    settings = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
                dict(temperature=1.0, top_k=8, top_p=0.9)]
    requests = []
    for i in range(10):
        prompt = (base[:5] if i % 3 == 0 else []) + torch.randint(0, 97, (1 + i % 4,), generator=gen).tolist()
        n = 4 + i % 5
        params = n if i % 4 == 1 else SamplingParams(**settings[i % 4], seed=1000 + i, max_new_tokens=n)
        requests.append((prompt, params))
    return requests


@pytest.mark.parametrize("sampling", [False, True], ids=["sampled after the step", "sampled in the step"])
def test_mixed_greedy_and_sampled_requests_each_get_their_tokens_alone(tiny, sampling):
    """Each request's tokens do not depend on its neighbours, whether the engine samples the logits or the
    runner samples inside the (padded, on CPU uncaptured) decode step over its persistent SamplingRows."""
    engine = _tiny_engine(tiny, sampling=sampling)
    requests = _mixed_requests()
    ids = [engine.add_request(p, params) for p, params in requests[:6]]
    for _ in range(3):
        engine.step()
    ids += [engine.add_request(p, params) for p, params in requests[6:]]
    engine.run()
    together = {rid: engine.requests[rid].output for rid in ids}
    for rid, (prompt, params) in zip(ids, requests):
        alone = _tiny_engine(tiny, enable_prefix_caching=False)
        alone.add_request(prompt, params)
        (req,) = alone.run()
        assert together[rid] == req.output and req.finish_reason == "length", (rid, params)
    sampled = [together[rid] for rid, (_, params) in zip(ids, requests) if isinstance(params, SamplingParams)]
    assert any(len(set(out)) > 1 for out in sampled)
    assert (engine.runner.sampling_rows is not None) == sampling


def test_stop_tokens_finish_with_stop_and_unseeded_requests_follow_the_engine_seed(tiny):
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=8)
    engine = _tiny_engine(tiny)
    engine.add_request([1, 2, 3], params)
    (full,) = engine.run()
    stop = full.output[2]
    first = full.output.index(stop)
    engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=7, max_new_tokens=8, stop_token_ids=(stop,)))
    stopped = engine.run()[-1]
    assert stopped.output == full.output[:first + 1] and stopped.finish_reason == "stop"
    assert engine.blocks.num_free == 40

    def unseeded(seed):
        engine = _tiny_engine(tiny, seed=seed)
        for prompt in ([4, 5], [6, 7, 8]):
            engine.add_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=6))
        return [r.output for r in engine.run()]

    assert unseeded(3) == unseeded(3) != unseeded(4)


def test_stream_yields_each_step_s_tokens_which_add_up_to_the_outputs_and_allows_aborts_between(tiny):
    """``Engine.stream()``: per step, the tokens each request produced (none while it prefills) and the requests
    it finished; concatenated per request they are its output; aborting between two items stops that request at
    once, and a request added between items joins the next step."""
    engine = _tiny_engine(tiny)
    requests = _mixed_requests()
    ids = [engine.add_request(p, params) for p, params in requests[:5]]
    seen: dict[int, list[int]] = {}
    finished: list[int] = []
    aborted = None
    for i, out in enumerate(engine.stream()):
        for rid, toks in out.tokens.items():
            assert len(toks) == 1
            seen.setdefault(rid, []).extend(toks)
        finished += [r.id for r in out.finished]
        if i == 2:
            ids.append(engine.add_request(*requests[5]))
        if i == 4 and aborted is None:
            aborted = next(r.id for r in engine.running if r.output)
            engine.abort(aborted)
    assert sorted(finished) == sorted(set(ids) - {aborted}) and len(finished) == len(set(finished))
    for rid in ids:
        assert seen.get(rid, []) == engine.requests[rid].output, rid
    assert engine.requests[aborted].finish_reason == "abort"
    assert not engine.waiting and not engine.running
    assert engine.blocks.num_free == 40  # every block came back (free or evictable)
