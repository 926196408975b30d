"""Per-rank bodies of the DCP tests of sink + window attention and of multi-token op-level ``dcp_decode``
(run by ``tests.dist_helpers.run_ranks`` in spawned processes; plain Python data back to the parent test)."""

from __future__ import annotations

import copy

import torch

from mla_compile.app import toy
from mla_compile.models.metadata import SeqChunk, mark_dynamic, plan_step
from mla_compile.models.model import patch
from mla_compile.parallel import ParallelConfig, init
from tests.parallel_workers import BS, NUM_BLOCKS, _blocks, _dcp_script, _max_err, _run


def _own_blocks(ends, world, rank, interleave, seed):
    """This rank's own cache blocks of sequences ending at ``ends`` (enough for its part of each)."""
    from mla_compile.parallel.dcp import local_seq_lens

    own = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed + rank)).tolist()
    out, at = [], 0
    for n in ends:
        need = max(1, -(-int(local_seq_lens(torch.tensor([n]), world, rank, interleave)[0]) // BS))
        out.append(own[at:at + need])
        at += need
    return out


def _other_batch(vocab: int, q: int):
    """Four other prompts prefilled, then one ``q``-token decode of all four (the structure of two steps of
    :func:`_dcp_script`, other batch sizes and lengths): ``(script(blocks, planner), ends)``."""
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 14, 2, 10)]
    nxt = [torch.randint(0, vocab, (q,), generator=gen).tolist() for _ in prompts]

    def script(blocks, planner):
        return [planner([], [SeqChunk(b, p) for b, p in zip(blocks, prompts)], logits="all"),
                planner([SeqChunk(b, t, len(p)) for b, t, p in zip(blocks, nxt, prompts)], [], logits="all",
                        query_len=q)]

    return script, [len(p) + q for p in prompts]


def dcp_sink_window_equals_single(rank, world, kind, interleave, sink, window, query_len, compile_too, dcp_size=2):
    """A sink + window model under DCP (tp=2, dcp=``dcp_size``; 1: TP alone, whole cache rows on every rank) over
    :func:`_dcp_script` (prefill, chunked prefill over a cached context, ``query_len``-token decode; contexts past
    ``sink + window``): logits against the single-process
    sink + window model, planned per rank (``plan_dcp_step``) and localized from the global plan. Also how far the
    dense model is (the window must matter), and (``compile_too``) fullgraph compile: breaks, collectives, and
    other batch sizes without a recompile."""
    from mla_compile.parallel.dcp import localize, plan_dcp_step

    state = init(ParallelConfig(tp=world, dcp=dcp_size), timeout=60)
    P, rank = state.dcp.size, state.dcp.rank
    hf = toy.toy_hf_model(kind, seed=17, **({"num_hidden_layers": 1} if compile_too else {}))  # compile: 1 layer
    vocab = hf.config.vocab_size
    dense = patch(copy.deepcopy(hf))
    ref = patch(copy.deepcopy(hf), sparse="sink_window", sink=sink, window=window)
    model = patch(hf, parallel=state, sparse="sink_window", sink=sink, window=window)
    for a in model.attentions:
        a.interleave = interleave
    script, ends = _dcp_script(vocab, query_len)
    glob = _blocks(ends, seed=23)
    global_plan = lambda d, p, **kw: plan_step(d, p, BS, **kw)  # noqa: E731
    rank_plan = lambda d, p, **kw: plan_dcp_step(d, p, BS, P, rank, interleave=interleave, **kw)  # noqa: E731
    want = _run(ref, script(glob, global_plan))
    planned = script(_own_blocks(ends, P, rank, interleave, 90), rank_plan)

    def localized(fn, dynamic=False):
        def run(input_ids, positions, meta):
            meta = localize(meta, positions, BS, P, rank, interleave)
            if dynamic:
                mark_dynamic(input_ids, positions, meta)
            return fn(input_ids, positions, meta)
        return run

    got = _run(model, planned)
    res = {"type": type(model.attentions[0]).__name__, "sink_window": model.sink_window,
           "attn_sink_window": [a.sink_window for a in model.attentions], "longest": max(ends),
           "finite": all(bool(torch.isfinite(g).all()) for g in got), "err": _max_err(got, want),
           "step_errs": [_max_err([g], [x]) for g, x in zip(got, want)], "rows": [g.shape[0] for g in got],
           "err_localize": _max_err(_run((localized(model), model), script(glob, global_plan)), want),
           "vs_dense": _max_err(_run(dense, script(glob, global_plan)), want)}
    if compile_too:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        seen: set[str] = set()

        def record(gm, example_inputs):  # Dynamo's graph, run as traced (no AOT / Inductor: fast on CPU)
            seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        compiled = torch.compile(model, fullgraph=True, backend=record)
        res["compiled_err"] = _max_err(_run((compiled, model), planned, dynamic=True), want)
        graphs = counters["stats"]["unique_graphs"]
        other, other_ends = _other_batch(vocab, query_len)
        other_want = _run(ref, other(_blocks(other_ends, seed=5), global_plan))
        with torch.compiler.set_stance("fail_on_recompile"):
            got_o = _run((compiled, model), other(_own_blocks(other_ends, P, rank, interleave, 60), rank_plan),
                         dynamic=True)
            got_l = _run((localized(compiled, dynamic=True), model), other(_blocks(other_ends, seed=5), global_plan))
        res["other_err"] = max(_max_err(got_o, other_want), _max_err(got_l, other_want))
        res["recompiled"] = counters["stats"]["unique_graphs"] - graphs
        res["graph_breaks"] = dict(counters["graph_break"])
        res["collectives"] = sorted(t for t in seen if "c10d" in t)
        res["sparse_decode"] = any("sparse_decode" in t for t in seen)
    return res


def dcp_decode_queries(rank, world, interleave, seq_lens, s_q, given_positions, compile_it):
    """Op-level ``dcp_decode`` with ``s_q`` queries per sequence: each rank holds its tokens (block-interleaved) in
    its own NaN-filled paged cache (unused table entries point at NaN blocks). Max errors against a float64
    softmax over each query's causal prefix of the whole sequence (query i sees positions < len - (s_q - 1 - i)),
    and against ``ops.decode`` over one unsplit cache (the unsharded contract); the query rows with no key
    anywhere; (``compile_it``) the ops of the fullgraph-compiled call."""
    from mla_compile import ops
    from mla_compile.parallel import dcp

    state = init(ParallelConfig(tp=world, dcp=world), timeout=30)
    gen = torch.Generator().manual_seed(1000 + s_q)  # the same data on every rank, fresh per s_q
    B, H, Dc, R, bs = len(seq_lens), 4, 32, 16, 4
    D, scale = Dc + R, 0.3
    rows = [torch.randn(n, D, generator=gen) for n in seq_lens]
    q = torch.randn(B, s_q, H, D, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    local = dcp.local_seq_lens(lens, world, rank, interleave)
    max_blocks = max(1, max(-(-int(n) // bs) for n in local)) + 1  # a spare entry per row: a NaN block
    cache = torch.full((B * max_blocks + 2, bs, D), float("nan"))
    perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(rank))
    table = perm[:B * max_blocks].view(B, max_blocks).int()
    for b, r in enumerate(rows):
        pos = torch.arange(r.shape[0])
        slots = dcp.local_slot_mapping(pos, table, torch.full_like(pos, b), bs, world, rank, interleave)
        keep = slots >= 0
        cache.view(-1, D)[slots[keep]] = r[keep]
    positions = None
    if given_positions:
        positions = lens.long()[:, None] - s_q + torch.arange(s_q)[None, :]
    fn = dcp.dcp_decode
    seen: set[str] = set()
    if compile_it:
        def record(gm, example_inputs):
            seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        fn = torch.compile(dcp.dcp_decode, fullgraph=True, backend=record)
    qq = q[:, 0] if s_q == 1 else q
    out, lse = fn(qq, cache, table, local, scale, state.dcp, kv_lora_rank=Dc, interleave=interleave,
                  positions=positions)
    if s_q == 1:
        out, lse = out[:, None], lse[:, None]
    err_out = err_lse = 0.0
    empty, inf_match = [], True
    for b, r in enumerate(rows):
        for i in range(s_q):
            n = r.shape[0] - (s_q - 1 - i)  # keys this query sees
            if n <= 0:
                want_out = torch.zeros(H, Dc, dtype=torch.float64)
                want_lse = torch.full((H,), float("-inf"), dtype=torch.float64)
                empty.append((b, i))
            else:
                s = q[b, i].double() @ r[:n].double().T * scale
                want_lse = torch.logsumexp(s, -1)
                want_out = torch.softmax(s, -1) @ r[:n].double()[:, :Dc]
            inf_match &= bool(torch.equal(torch.isinf(lse[b, i]), torch.isinf(want_lse)))
            fin = torch.isfinite(want_lse)
            if bool(fin.any()):
                err_lse = max(err_lse, float((lse[b, i].double() - want_lse)[fin].abs().max()))
            err_out = max(err_out, float((out[b, i].double() - want_out).abs().max()))
    nb = max(1, max(-(-n // bs) for n in seq_lens))
    whole = torch.full((B * nb, bs, D), float("nan"))
    wtable = torch.arange(B * nb).view(B, nb).int()
    for b, r in enumerate(rows):
        whole.view(-1, D)[b * nb * bs: b * nb * bs + r.shape[0]] = r
    u_out, _ = ops.decode(q, whole, wtable, lens, scale, kv_lora_rank=Dc)
    return {"err_out": err_out, "err_lse": err_lse, "inf_match": inf_match, "empty": empty,
            "local_lens": local.tolist(), "vs_unsplit": float((out - u_out).abs().max()),
            "finite": bool(torch.isfinite(out).all()), "shape": list(out.shape),
            "ops": sorted(t for t in seen if "c10d" in t or "mla" in t)}


def dcp_sink_engine_per_rank(rank, world, sink, window):
    """Every rank runs the same Engine over a sink + window DCP model (tp=2, dcp=2) through the demo's DCP step
    (``localize``), prompts chunked over cached context and sequences longer than ``sink + window``; tokens equal
    the unsharded sink + window engine's (which releases the blocks outside the window; the DCP engine keeps
    them: ``sink_window_of`` is None there)."""
    from mla_compile.app.demo import _dcp_step
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.engine import Engine
    from tests.engine_load import run_workload

    state = init(ParallelConfig(tp=world, dcp=world), timeout=60)
    hf = toy.toy_hf_model("v3", seed=2, num_hidden_layers=2)
    ref = patch(copy.deepcopy(hf), sparse="sink_window", sink=sink, window=window)
    model = patch(hf, parallel=state, sparse="sink_window", sink=sink, window=window)
    load = dict(seed=5, n_requests=5, gap=3, max_new=14, max_prompt=24)

    def engine(m, step):
        m.allocate_cache(64, BS)
        builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=10, max_tokens=12, block_size=BS, device="cpu")
        return Engine(DecodeGraphRunner(step, builder, capture_sizes=[2, 4], enabled=False), num_blocks=64)

    ref_engine = engine(ref, ref)
    want, steps = run_workload(ref_engine, **load)
    dcp_engine = engine(model, _dcp_step(model, BS, state))
    got, got_steps = run_workload(dcp_engine, **load)
    return {"same": got == want, "steps": steps, "got_steps": got_steps, "tokens": sum(len(t) for t in got),
            "ref_windowed": ref_engine.blocks.sink_window, "dcp_windowed": dcp_engine.blocks.sink_window,
            "longest": max(len(t) for t in got)}
