"""Per-rank bodies of the DCP tests of sink + window serving and of multi-token op-level ``dcp_decode`` (the
sink + window model's logits go through ``tests.parallel_workers.dcp_multi_token_equals_single``), run by
``tests.dist_helpers.run_ranks`` in spawned processes; plain Python data back to the parent test."""

from __future__ import annotations

import copy

import torch

from mla_compile.app import toy
from mla_compile.models.model import patch
from mla_compile.parallel import ParallelConfig, init
from tests.parallel_workers import BS, split_paged_cache, unsplit_paged_cache


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
    # a spare table entry per row: a NaN block
    cache, table, local = split_paged_cache(rows, lens, world, rank, interleave, bs, spare=1)
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
    whole, wtable = unsplit_paged_cache(rows, bs)
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
