"""DeepSeek-V4 through the serving :class:`~mla_compile.serving.engine.Engine` (a ``V4DecodeBuilder`` runner:
``V4BlockManager`` caches, token rows released as the window moves, chunked prefill, greedy and seeded sampling,
stop tokens, abort) and ``mla-compile generate`` on a tiny V4 checkpoint.

The toy (:func:`mla_compile.app.v4_toy.toy_v4_model`) has a CSA layer (rate 4, top-3 of the compressed entries),
an HCA layer (rate 8), a sliding layer (window 6), a hash-routed MoE layer and mHC. References: HF eager (float32,
each request alone, its own cache) and each request alone through the model with fixed block tables
(:class:`~mla_compile.models.v4_model.V4Sequences`, float64 so that batching never flips a token). Caches are
NaN-filled: a read of a row nothing wrote shows up.
"""

from __future__ import annotations

import contextlib
import io
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from mla_compile.app.cli import main  # noqa: E402
from mla_compile.app.textgen import generate_text, load_tokenizer  # noqa: E402
from mla_compile.app.v4_toy import toy_v4_model  # noqa: E402
from mla_compile.graphs.cuda_graph import DecodeGraphRunner  # noqa: E402
from mla_compile.models.model import patch  # noqa: E402
from mla_compile.models.v4_model import V4Sequences  # noqa: E402
from mla_compile.serving.admission import RequestRejected  # noqa: E402
from mla_compile.serving.engine import Engine, StepFailed  # noqa: E402
from mla_compile.serving.sampling import SamplingParams, sample_rows  # noqa: E402
from mla_compile.serving.v4_blocks import V4BlockManager  # noqa: E402
from mla_compile.serving.v4_builder import V4DecodeBuilder  # noqa: E402
from tests.checkpoints import write_tokenizer  # noqa: E402
from tests.model.test_v4_model import hf_greedy, prompts  # noqa: E402

NAN = float("nan")
TOL = dict(rtol=1e-4, atol=1e-4)


def v4_engine(model, *, num_blocks, num_entry, max_seqs, block_size=4, max_batch=3, max_tokens=12,
              max_blocks=32, max_entry_blocks=8, step_fn=None, device="cpu", enabled=False, sampling=False,
              strict_sync=False, **kw):
    """An engine over ``model`` (its caches allocated here, NaN-filled) through a ``DecodeGraphRunner``."""
    model.allocate_cache(num_blocks, block_size, num_entry, max_seqs, fill=NAN)
    builder = V4DecodeBuilder(max_batch=max_batch, max_blocks_per_seq=max_blocks, max_entry_blocks=max_entry_blocks,
                              rates=model.rates, block_size=block_size, device=device, max_tokens=max_tokens)
    sizes = sorted({2, max_batch})
    runner = DecodeGraphRunner(model if step_fn is None else step_fn, builder, capture_sizes=sizes, enabled=enabled,
                               sampling=sampling, strict_sync=strict_sync)
    return Engine(runner, num_blocks=num_blocks, **kw)


@torch.no_grad()
def alone(model, prompt, params):
    """One request alone through the model: its prompt in one step on fixed block tables, then decode steps,
    each token drawn under ``params`` at its index (greedy: argmax), until a stop token or max_new_tokens."""
    seqs = V4Sequences(model, 1, len(prompt) + params.max_new_tokens, 4, fill=NAN)
    out, chunk = [], list(prompt)
    while len(out) < params.max_new_tokens and not (out and out[-1] in params.stop_token_ids):
        logits = seqs.step(model, [0], [chunk])
        out.append(int(logits[0].argmax() if params.greedy else sample_rows(logits, [params], [len(out)])[0]))
        chunk = [out[-1]]
    return out


@pytest.fixture(scope="module")
def model64():
    return patch(toy_v4_model(31).double())


def _trace(seed, n):
    """``n`` requests of random lengths and arrival steps, greedy or seeded sampling, some with stop tokens."""
    rng = random.Random(seed)
    ps = prompts(seed, [rng.randint(1, 30) for _ in range(n)])
    for i in range(1, n):  # some prompts extend a cut of an earlier one (prefix-cache hits, many mid-window)
        if rng.random() < 0.5:
            src = ps[rng.randrange(i)]
            ps[i] = src[:rng.randint(1, len(src))] + ps[i]
    reqs = []
    for i, p in enumerate(ps):
        kind = rng.choice(["greedy", "sample", "topk"])
        params = SamplingParams(max_new_tokens=rng.randint(1, 14),
                                **({} if kind == "greedy" else dict(temperature=rng.choice([0.7, 1.0, 1.3]),
                                                                     seed=rng.randrange(1 << 30))),
                                **(dict(top_k=5, top_p=0.9) if kind == "topk" else {}),
                                stop_token_ids=tuple(rng.sample(range(96), 16)) if rng.random() < 0.5 else ())
        reqs.append((rng.randint(0, 12), p, params))
    return reqs


@pytest.mark.parametrize("seed,prefix", [(0, False), (1, False), (0, True), (2, True)])
def test_seeded_trace_equals_each_request_alone(model64, seed, prefix):
    """Random arrivals and lengths (some prompts extending cuts of earlier ones), at most 3 running
    (compressor-state rows reused), a 12-token step budget (prompts chunked across compression and window
    boundaries, mixed with decodes), with and without prefix caching: every request gets the tokens it gets
    alone, and its finish reason; afterwards every block and state row is free again (or held by a snapshot)."""
    trace = _trace(seed, 9)
    eng = v4_engine(model64, num_blocks=60, num_entry=30, max_seqs=5, enable_prefix_caching=prefix)
    ids, step = {}, 0
    while len(ids) < len(trace) or eng.running or eng.waiting:
        for i, (arrive, p, params) in enumerate(trace):
            if arrive == step and i not in ids:
                ids[i] = eng.add_request(p, params)
        eng.step()
        step += 1
        assert len(eng.running) <= 3
    for i, (_, p, params) in enumerate(trace):
        req = eng.requests[ids[i]]
        want = alone(model64, p, params)
        assert req.output == want, (i, p, params)
        assert req.finish_reason == ("stop" if want[-1] in params.stop_token_ids else "length")
    assert any(r.finish_reason == "stop" for r in eng.finished) and any(len(r.prompt) > 12 for r in eng.finished)
    m = eng.blocks
    assert m.num_free == m.usable_blocks
    assert sorted(m.free_slots + [s.row for s in m.snapshots.values()]) == [0, 1, 2, 3, 4]
    assert all(e.num_free == len(e.blocks) - sum(r in s.entry_blocks for s in m.snapshots.values())
               for r, e in m.entries.items())
    assert (eng.cached_prompt_tokens > 0) == prefix


@torch.no_grad()
def test_engine_greedy_equals_hf_eager():
    """Three requests batched through the engine (float32): the tokens of HF eager greedy decoding, and the logits
    of each one's steps (its prefill's last row, then its decode rows) within 1e-4."""
    hf = toy_v4_model(2)
    ps = prompts(2, [13, 30, 5])
    refs = [hf_greedy(hf, p, 9) for p in ps]
    model = patch(hf)
    eng = v4_engine(model, num_blocks=40, num_entry=20, max_seqs=3, max_tokens=48)
    rids = [eng.add_request(p, 10) for p in ps]
    rows = {r: [] for r in rids}
    while eng.running or eng.waiting:
        order = [r.id for r in eng.running] or rids  # step 0 prefills all three prompts; then all decode
        eng.step(keep_logits=True)
        for row, rid in enumerate(order):
            rows[rid].append(eng.step_logits[-1][row])
    for rid, (_, ref_logits, ref_tokens) in zip(rids, refs):
        assert eng.requests[rid].output == ref_tokens
        torch.testing.assert_close(torch.stack(rows[rid]), torch.stack(ref_logits), **TOL)


@pytest.mark.parametrize("budget", [3, 5, 7])
@torch.no_grad()
def test_chunked_prefill_across_compression_boundaries_equals_hf(budget):
    """Step budgets of 3, 5 and 7 tokens chunk a 37-token prompt across the CSA (4), HCA (8) and window (6)
    boundaries at every phase (a second request decodes beside it); greedy tokens and logits as HF eager."""
    hf = toy_v4_model(3)
    p, q = prompts(3, [37, 2])
    model = patch(hf)
    eng = v4_engine(model, num_blocks=40, num_entry=20, max_seqs=2, max_batch=2, max_tokens=budget)
    a, b = eng.add_request(q, 12), eng.add_request(p, 8)
    first = None
    while eng.running or eng.waiting:
        req = eng.requests[b]
        was = req.prefilling
        rows = [r.id for r in eng.running if not r.prefilling] + [r.id for r in eng.running if r.prefilling]
        eng.step(keep_logits=True)
        if was and not req.prefilling:
            first = eng.step_logits[-1][rows.index(b)]
    _, ref_logits, ref_tokens = hf_greedy(hf, p, 7)
    assert eng.requests[b].output == ref_tokens
    torch.testing.assert_close(first, ref_logits[0], **TOL)
    assert eng.requests[a].output == hf_greedy(hf, q, 11)[2]


@torch.no_grad()
def test_long_contexts_release_window_blocks():
    """Two requests of 5 or 9 + 60 tokens (over 10 windows of 6) in 1 null + 2 x 3 token blocks of 4, where each
    would need 17 or 18 without release: they run side by side, never hold more than their peaks, the null block is
    never written, and the tokens are each one's alone."""
    model = patch(toy_v4_model(5).double())
    ps = prompts(5, [5, 9])
    eng = v4_engine(model, num_blocks=7, num_entry=40, max_seqs=2, max_batch=2, max_entry_blocks=8)
    assert eng.blocks.peak_blocks(9, 69) == 3  # a window of 6 in blocks of 4: 2 blocks + the one being filled
    rids = [eng.add_request(p, 60) for p in ps]
    released, both = 0, 0
    while eng.running or eng.waiting:
        eng.step()
        both += len(eng.running) == 2
        assert sum(b.ref > 0 for b in eng.blocks.tokens.blocks) - 1 <= 6  # less the pinned null block
        released = max([released] + [r.alloc.tokens.released for r in eng.running])
    assert both >= 55 and released >= 12
    assert all(torch.isnan(a.kv_cache[0]).all() for a in model.attn)  # the null block: never written
    for rid, p in zip(rids, ps):
        assert eng.requests[rid].output == alone(model, p, SamplingParams(max_new_tokens=60))


def test_stop_abort_and_admission(model64):
    """A stop token ends a request with its stop token kept; abort (waiting or running) frees everything; requests
    whose compressed entries can never fit are rejected at add_request."""
    p = prompts(7, [10])[0]
    greedy = alone(model64, p, SamplingParams(max_new_tokens=8))
    eng = v4_engine(model64, num_blocks=20, num_entry=4, max_seqs=2, max_batch=2, max_entry_blocks=4)
    stop = eng.add_request(p, SamplingParams(max_new_tokens=8, stop_token_ids=(greedy[3],)))
    run = eng.add_request(p, 8)
    wait = eng.add_request(p, 8)  # only 2 state rows: waits
    eng.step()
    eng.step()
    assert eng.abort(wait).finish_reason == "abort" and eng.requests[wait].output == []
    out = eng.abort(run).output
    assert eng.requests[run].finish_reason == "abort" and 1 <= len(out) < 8 and out == greedy[:len(out)]
    eng.run()
    first = greedy.index(greedy[3])
    assert eng.requests[stop].output == greedy[:first + 1] and eng.requests[stop].finish_reason == "stop"
    m = eng.blocks
    assert m.num_free == m.usable_blocks and sorted(m.free_slots) == [0, 1]
    with pytest.raises(RequestRejected, match="compressed-entry blocks of rate 4"):
        eng.add_request(p, 60)  # 70 tokens: 17 entries of rate 4, 5 blocks > 4
    with pytest.raises(ValueError, match="exceeds the 20 token-row blocks"):
        Engine(eng.runner, num_blocks=21)


def _shared_prefix_requests(seed):
    """Prompts sharing prefixes of a 37-token prompt P: P[:29] + 9 others (29 is mid-window for CSA 4, HCA 8 and
    the sliding window 6), all of P + 5 others, P[:3] + 20 others (too short a share for a hit), P again, and a
    prompt sharing nothing."""
    p, a, b, c, d = prompts(seed, [37, 9, 5, 20, 15])
    return [p, p[:29] + a, p + b, p[:3] + c, list(p), d]


@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_hits_ending_mid_window_equal_the_no_cache_run(model64, overlap):
    """Prefix caching (block size 4: snapshots every 8 tokens, the lcm of 4, 4 and 8): the requests of
    :func:`_shared_prefix_requests`, some arriving while P still runs (its blocks shared live), some after it
    finished (its blocks evictable), get every token of the run without prefix caching, and reuse the prefix
    rounded down to a snapshot: 24 of 29 shared tokens, 32 of P's 37 (its last chunk split at 32), none of 3."""
    ps = _shared_prefix_requests(11)
    params = [SamplingParams(max_new_tokens=6, **({} if i % 2 else dict(temperature=1.0, seed=i))) for i in range(6)]
    arrivals = [0, 6, 6, 7, 30, 30]  # P prefills in steps 0-4 (chunks end at 8, 16, 24, 32, 37)

    def serve(prefix):
        eng = v4_engine(model64, num_blocks=60, num_entry=30, max_seqs=8, enable_prefix_caching=prefix,
                        overlap=overlap)
        ids, step = {}, 0
        while len(ids) < len(ps) or eng.running or eng.waiting or eng._inflight is not None:
            for i, at in enumerate(arrivals):
                if at == step:
                    ids[i] = eng.add_request(ps[i], params[i])
            eng.step()
            step += 1
        return eng, [eng.requests[ids[i]] for i in range(len(ps))]

    plain, want = serve(False)
    assert plain.cached_prompt_tokens == 0
    eng, got = serve(True)
    assert [r.output for r in got] == [r.output for r in want]
    assert [r.alloc.cached_tokens for r in got] == [0, 24, 32, 0, 32, 0]
    assert eng.blocks.snapshots  # kept for later requests
    assert got[0].output == alone(model64, ps[0], params[0])


def test_a_failed_read_under_overlap_forgets_the_v4_prefix_blocks_and_snapshot_its_launch_made(model64):
    """Overlap registers a V4 prompt chunk's blocks and state snapshot at launch. When reading that step's tokens
    fails (an asynchronous device error), a request admitted meanwhile on a hit of that snapshot fails with it,
    and neither the blocks nor the snapshot are found later: the same prompt is computed afresh, as alone."""

    class Broken:
        def synchronize(self):
            raise RuntimeError("injected asynchronous error")

    (p,) = prompts(13, [16])
    eng = v4_engine(model64, num_blocks=60, num_entry=30, max_seqs=8, enable_prefix_caching=True, overlap=True)
    a = eng.add_request(p, 4)
    copy = eng._host_tokens.copy
    eng._host_tokens.copy = lambda tokens: (copy(tokens)[0], Broken())
    eng.step()  # launches p's first chunk (it ends at 8: blocks and a snapshot findable now)
    eng._host_tokens.copy = copy
    m = eng.blocks
    assert len(m.snapshots) == 1 and m.tokens.cached
    b = eng.add_request(p[:10] + [1, 2], 4)
    with pytest.raises(StepFailed) as info:
        eng.step()  # admits b on the snapshot, launches it, then meets the error reading the first step
    assert eng.requests[b].alloc.cached_tokens == 8 and sorted(info.value.request_ids) == [a, b]
    assert not m.snapshots and not m.tokens.cached and not any(e.cached for e in m.entries.values())
    c = eng.add_request(p, 4)
    eng.run()
    assert eng.requests[c].alloc.cached_tokens == 0
    assert eng.requests[c].output == alone(model64, p, SamplingParams(max_new_tokens=4))


def test_prefix_cache_snapshots_make_room_for_running_requests(model64):
    """Snapshots take only spare state rows and entry blocks: with one spare row the older snapshots are
    evicted as newer ones come, admission evicts them when a request needs the rows, and every token still
    equals each request alone; a hit on a prefix whose snapshot was evicted computes it again."""
    p, p29, p_more, p3, p_again, other = _shared_prefix_requests(12)
    ps = [p, other, p_more, p29, p_again, p3]  # 2 at a time: P and another, then P + 5 hits P's last snapshot
    eng = v4_engine(model64, num_blocks=60, num_entry=30, max_seqs=3, max_batch=2, enable_prefix_caching=True)
    rids = [eng.add_request(q, 5) for q in ps]
    m = eng.blocks
    while eng.running or eng.waiting:
        eng.step()
        assert len(m.free_slots) + len(m.snapshots) + len(eng.running) == 3  # every state row accounted for
    for rid, q in zip(rids, ps):
        assert eng.requests[rid].output == alone(model64, q, SamplingParams(max_new_tokens=5))
    assert eng.requests[rids[2]].alloc.cached_tokens == 32 and eng.requests[rids[3]].alloc.cached_tokens < 24


def test_v4_block_manager_needs_a_v4_model_with_caches():
    builder = V4DecodeBuilder(max_batch=2, max_blocks_per_seq=4, max_entry_blocks=2, rates=[4], block_size=4,
                              device="cpu")
    with pytest.raises(ValueError, match="V4ForCausalLM"):
        V4BlockManager.for_runner(DecodeGraphRunner(lambda *a: None, builder), num_blocks=4)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_engine_equals_eager(model64):
    """The steps through ``torch.compile(fullgraph=True)`` (aot_eager on CPU) and the runner's padded decode steps,
    sampled inside the step (``sampling=True``), without and with overlap: the eager run's tokens; the compiled
    graphs serve both runs (prefill, mixed and decode steps of every size) without recompiling."""
    trace = _trace(4, 5)
    eager = v4_engine(model64, num_blocks=40, num_entry=24, max_seqs=3)
    for _, p, params in trace:
        eager.add_request(p, params)
    want = [r.output for r in eager.run()]
    compiled = torch.compile(model64, fullgraph=True, backend="aot_eager")
    for overlap in (False, True):
        eng = v4_engine(model64, num_blocks=40, num_entry=24, max_seqs=3, step_fn=compiled, sampling=True,
                        overlap=overlap)
        for _, p, params in trace:
            eng.add_request(p, params)
        with torch.compiler.set_stance("fail_on_recompile") if overlap else contextlib.nullcontext():
            assert [r.output for r in eng.run()] == want


@pytest.mark.cuda
def test_engine_cuda_graphs_match_cpu():
    """On the GPU: the compiled model (inductor, float32) with captured decode steps sampling inside the graph,
    without overlap, and with overlap and prefix caching (snapshot copies on the device); the seeded trace's
    tokens equal each request alone on CPU (float32), decode steps replayed with no host sync in their fill and
    replay (``strict_sync``)."""
    cpu = patch(toy_v4_model(31))
    trace = _trace(0, 9)
    want = [alone(cpu, p, params) for _, p, params in trace]
    torch._dynamo.reset()
    model = patch(toy_v4_model(31).cuda())
    compiled = torch.compile(model, fullgraph=True)  # one compile serves both runs
    for overlap in (False, True):
        eng = v4_engine(model, num_blocks=60, num_entry=30, max_seqs=5, step_fn=compiled, device="cuda",
                        enabled=True, sampling=True, overlap=overlap, enable_prefix_caching=overlap, strict_sync=True)
        for _, p, params in trace:
            eng.add_request(p, params)
        assert [r.output for r in eng.run()] == want
        assert eng.runner.replays > 10 and set(eng.runner.graphs) == {2, 3}


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    """A tiny V4 checkpoint (the toy with the test tokenizer's 300-token vocabulary) and its HF model."""
    hf = toy_v4_model(23, vocab_size=304)
    root = tmp_path_factory.mktemp("v4-ckpt")
    hf.save_pretrained(str(root))
    write_tokenizer(root)
    return hf, root


def test_generate_text_on_a_v4_checkpoint_is_hf_greedy(v4_checkpoint):
    hf, root = v4_checkpoint
    stream = io.StringIO()
    res = generate_text(root, "the quick brown fox", max_new_tokens=12, dtype=torch.float32, compile=False,
                        stream=stream, block_size=4)
    tok = load_tokenizer(root)
    _, _, want = hf_greedy(hf, res.prompt_ids, 11)
    eos = tok.eos_token_id
    assert res.tokens == (want[:want.index(eos)] if eos in want else want)
    assert stream.getvalue() == res.text + "\n" and res.text == tok.decode(res.tokens, skip_special_tokens=True)


def test_cli_generate_v4(v4_checkpoint, capsys):
    _, root = v4_checkpoint
    argv = ["generate", "--model", str(root), "--prompt", "hello there", "--max-new-tokens", "5", "--dtype",
            "float32", "--block-size", "4"]
    assert main(argv + ["--no-compile"]) == 0
    out, err = capsys.readouterr()
    assert "tokens/s" in err and "3 layers" in err
    assert main(argv + ["--no-compile", "--temperature", "1.0", "--seed", "3"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_from_pretrained_v4_regional_compile(v4_checkpoint):
    """``from_pretrained(regional_compile=True)`` on a V4 checkpoint: a regional ``V4ForCausalLM``, whose eager
    steps (the split layers) give HF's greedy tokens."""
    from mla_compile.models.loader import from_pretrained

    hf, root = v4_checkpoint
    model = from_pretrained(root, dtype=torch.float32, regional_compile=True)
    assert model.regional_compile
    p = prompts(5, [9])[0]
    seqs = V4Sequences(model, 1, 32, 4, fill=float("nan"))
    with torch.no_grad():
        out = seqs.step(model, [0], [p])
        tokens = [int(out[0].argmax())]
        for _ in range(3):
            tokens.append(int(seqs.step(model, [0], [[tokens[-1]]])[0].argmax()))
    assert tokens == hf_greedy(hf, p, 3)[2]
