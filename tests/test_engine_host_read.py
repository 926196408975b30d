"""The engine's vectorised read of a decode-only step (one pass over its DecodeRows: outputs, streamed tokens,
stop tokens, ``max_new_tokens``, retiring under overlap) does exactly what the per-request path does: step for
step the same returned and finished requests in the same order, the same streamed tokens in the same order, the
same running list and the same block manager state, over seeded traces with arrivals, shared prefixes, sampling,
stop tokens (of varied counts), aborts between steps, a windowed cache and overlap on and off."""

import pytest
import torch

from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.serving.admission import RequestRejected
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.engine import Engine, Request, StepFailed
from mla_compile.serving.sampling import SamplingParams

from tests.engine_load import make_trace, with_sampling
from tests.test_engine_decode_rows import BS, VOCAB, FakeModel


def _drive(trace, overlap, window, rows_on, max_batch=12):
    """Serve ``trace`` (arrivals, aborts, steps) and record after every step what a client and the engine see;
    returns the record and the engine (``engine.vectorised_reads``: the steps read in one pass)."""
    builder = MetadataBuilder(max_batch=max_batch, max_blocks_per_seq=16, max_tokens=4 * max_batch,
                              block_size=BS, device="cpu")
    runner = DecodeGraphRunner(FakeModel(window), builder, sampling=True)
    engine = Engine(runner, num_blocks=120, vocab_size=VOCAB, max_positions=64, overlap=overlap)
    assert engine._rows is not None
    if not rows_on:
        engine._rows = None  # the per-request SeqChunk path (and its per-request read)
    engine.vectorised_reads = 0
    take_rows = engine._take_rows

    def counted(*args):
        engine.vectorised_reads += 1
        return take_rows(*args)

    engine._take_rows = counted
    ids, log, step, pending = {}, [], 0, list(range(len(trace)))
    aborts = sorted((r.abort_at, i) for i, r in enumerate(trace) if r.abort_at is not None)
    while pending or engine.waiting or engine.running or engine._inflight is not None:
        while pending and trace[pending[0]].at <= step:
            i = pending.pop(0)
            try:
                ids[i] = engine.add_request(trace[i].prompt, trace[i].max_new_tokens)
            except RequestRejected:
                pass
        while aborts and aborts[0][0] <= step:
            _, i = aborts.pop(0)
            if i in ids:
                r = engine.abort(ids[i])
                log.append(("abort", r.id, r.finish_reason, list(r.output)))
        try:
            done = engine.step()
        except StepFailed as exc:  # not expected here: recorded so a difference shows
            done = [("failed", exc.request_ids)]
        step += 1
        log.append((step, [(r.id, r.finish_reason, list(r.output)) if isinstance(r, Request) else r for r in done],
                    list(engine.new_tokens.items()), [r.id for r in engine.running],
                    [(r.id, r.finish_reason) for r in engine.finished],
                    engine.blocks.num_free, list(engine.blocks.free_ids)))
        assert step < 2000, "the engine does not drain"
    return log, engine


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("window", [None, (4, 8)])
def test_vectorised_read_streams_what_the_per_request_read_streams(overlap, window):
    for seed in (21, 22):
        trace = with_sampling(make_trace(seed, 40, vocab_size=VOCAB, max_total=64, max_new=30, max_prompt=12, gap=3),
                              seed=seed, vocab_size=VOCAB, stops=True)
        got, engine = _drive(trace, overlap, window, True)
        want, chunks = _drive(trace, overlap, window, False)
        assert got == want
        assert engine.vectorised_reads > 20 and chunks.vectorised_reads == 0
        reasons = [r.finish_reason for r in engine.finished]
        # the trace exercises every way out of the decode rows
        assert {"stop", "length", "abort"} <= set(reasons), reasons
        assert sum(len(r.output) for r in engine.finished) > 200


@pytest.mark.parametrize("overlap", [False, True])
def test_vectorised_read_with_every_request_stopping_on_one_token(overlap):
    """Every request with the same single stop token (an end-of-sequence id) and long ``max_new_tokens``: each
    finishes at its first draw of it, whichever path reads the step."""
    trace = make_trace(5, 24, vocab_size=VOCAB, max_total=64, max_new=40, max_prompt=12, gap=2, abort_rate=0.0,
                       invalid_rate=0.0)
    for r in trace:
        r.max_new_tokens = SamplingParams(temperature=1.0, seed=r.at * 131 + len(r.prompt), stop_token_ids=(7,),
                                          max_new_tokens=r.max_new_tokens)
    got, engine = _drive(trace, overlap, None, True, max_batch=8)
    want, _ = _drive(trace, overlap, None, False, max_batch=8)
    assert got == want and engine.vectorised_reads > 20
    stopped = [r for r in engine.finished if r.finish_reason == "stop"]
    assert stopped and all(r.output[-1] == 7 and 7 not in r.output[:-1] for r in stopped)
    assert all(7 not in r.output for r in engine.finished if r.finish_reason == "length")


def test_running_drops_requests_by_identity():
    """The engine's running list removes a request itself, not one equal to it field by field."""
    engine = Engine(DecodeGraphRunner(FakeModel(), MetadataBuilder(max_batch=4, max_blocks_per_seq=4, max_tokens=16,
                                                                   block_size=BS, device="cpu")),
                    num_blocks=8, vocab_size=VOCAB)
    a, twin, b = Request(1, [1, 2], 3), Request(1, [1, 2], 3), Request(2, [3], 3)
    assert a == twin and a is not twin
    engine.running = [twin, b, a]
    version = engine.running.version
    assert engine.running.index_of(a) == 2 and engine.running.index_of(Request(9, [], 1)) == -1
    assert engine.running.drop(a) and engine.running == [twin, b] and engine.running[0] is twin
    assert engine.running.version != version
    version = engine.running.version
    assert not engine.running.drop(a) and engine.running.version == version
