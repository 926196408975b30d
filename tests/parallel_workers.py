"""Per-rank bodies of the parallel tests (run by ``tests.dist_helpers.run_ranks`` in spawned processes).

Each returns plain Python data (max errors, shapes, op names) for the parent test to assert on.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import time

import torch

from mla_compile.app import toy
from mla_compile.models.metadata import SeqChunk, plan_step
from mla_compile.models.model import patch
from mla_compile.parallel import ParallelConfig, init

BS = 4
NUM_BLOCKS = 48
# toy overrides for the compiled cases: one MoE layer (attention, routed + shared experts, lm_head). Dynamo's and
# AOTAutograd's tracing time grows with the layers traced; the collectives and graphs are those of any layer count,
# and the two-layer toy (a dense layer first) runs eagerly in every other case.
ONE_MOE_LAYER = dict(num_hidden_layers=1, first_k_dense_replace=0)


def _blocks(lens, seed):
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in lens:
        need = -(-n // BS)
        out.append(perm[at:at + need])
        at += need
    return out


STEP_LENS = (13, 6, 9)  # prompt lengths of _steps; each sequence ends 3 tokens later


def _steps(vocab: int, seed: int, blocks=None, planner=None):
    """A fixed step script: prefill of a cached prefix, chunked prefill over it mixed with a fresh prompt,
    then decode steps with fixed tokens. Returns ``planner(decode, prefill, **kw)`` inputs (CPU; default
    ``plan_step`` with block size ``BS`` over seeded random blocks)."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in STEP_LENS]
    dec_tokens = torch.randint(0, vocab, (3, 3), generator=gen).tolist()
    blocks = _blocks([n + 3 for n in STEP_LENS], seed) if blocks is None else blocks
    plan = planner or (lambda d, p, **kw: plan_step(d, p, BS, **kw))
    steps = [
        # prefill: prompt 0's first 8 tokens (a cached prefix next step) and prompt 2 whole
        plan([], [SeqChunk(blocks[0], full[0][:8]), SeqChunk(blocks[2], full[2])], logits="all"),
        # chunked prefill over the cached prefix, with a new prompt and one decode (prompt 2)
        plan([SeqChunk(blocks[2], [dec_tokens[2][0]], len(full[2]))],
             [SeqChunk(blocks[0], full[0][8:], 8), SeqChunk(blocks[1], full[1])], logits="all"),
    ]
    for j in range(2):  # decode all three
        pos = [len(full[0]) + j, len(full[1]) + j, len(full[2]) + 1 + j]
        steps.append(plan([SeqChunk(b, [t[j]], s) for b, t, s in zip(blocks, dec_tokens, pos)], []))
    return steps


def _other_batch_steps(vocab: int, seed: int):
    """Four prompts of other lengths, prefilled then decoded once: other batch sizes than :func:`_steps`."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 7, 2, 10)]
    nxt = torch.randint(0, vocab, (4,), generator=gen).tolist()
    blocks = _blocks([len(p) + 1 for p in prompts], seed)
    return [plan_step([], [SeqChunk(b, p) for b, p in zip(blocks, prompts)], BS),
            plan_step([SeqChunk(b, [t], len(p)) for b, t, p in zip(blocks, nxt, prompts)], [], BS)]


def _run(model, steps, dynamic=False):
    """Logits of every step (real rows), from a freshly allocated NaN-filled cache. ``model`` may be a pair
    ``(step function, model owning the cache)``; ``dynamic`` marks per-step sizes dynamic."""
    from mla_compile.models.metadata import mark_dynamic

    model_fn, model_obj = model if isinstance(model, tuple) else (model, model)
    model_obj.allocate_cache(NUM_BLOCKS, BS, fill=float("nan"))
    outs = []
    with torch.no_grad():
        for s in steps:
            if dynamic:
                mark_dynamic(s.input_ids, s.positions, s.meta)
            outs.append(model_fn(s.input_ids, s.positions, s.meta)[:s.num_rows].clone())
    return outs


def _max_err(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def sharded_equals_single(rank, world, kind, pconf, dispatch, compile_too, overrides=None, regional=False):
    """Logits of the sharded model vs the single-process patched model over the step script; shard sizes;
    with ``compile_too`` also the fullgraph-compiled sharded model, its graph breaks and its collectives.
    ``overrides``: toy config changes; ``regional``: the sharded model patched with ``regional_compile=True`` (the
    compiled graph's ``invoke_subgraph`` calls counted in ``region_calls``)."""
    state = init(ParallelConfig(**pconf), timeout=60)
    hf = toy.toy_hf_model(kind, seed=7, **(overrides or {}))
    ref = patch(copy.deepcopy(hf))
    steps = _steps(hf.config.vocab_size, seed=11)
    want = _run(ref, steps)
    full_params = sum(p.numel() for p in ref.parameters())
    model = patch(hf, parallel=state, ep_dispatch=dispatch, regional_compile=regional)
    got = _run(model, steps)
    res = {"err": _max_err(got, want), "finite": all(bool(torch.isfinite(g).all()) for g in got),
           "params": sum(p.numel() for p in model.parameters()), "full_params": full_params,
           "kv_b": list(model.attentions[0].kv_b_proj.weight.shape),
           "o_proj": list(model.attentions[0].o_proj.weight.shape)}
    moe = model.model.layers[-1].mlp
    res["experts"] = list(moe.experts.gate_up_proj.shape)
    res["vocab_shard"] = model.lm_head.weight.shape[0]
    res["logits_width"] = got[0].shape[-1]
    if compile_too:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        seen: set[str] = set()

        region_calls = []

        def record(gm, example_inputs):
            from torch._functorch.aot_autograd import aot_module_simplified

            region_calls.extend(str(n.args[1]) for n in gm.graph.nodes if n.op == "call_function"
                                and n.target is torch.ops.higher_order.invoke_subgraph)

            def fw(g, _):  # the collectives, in the graph or inside its regions' subgraphs
                seen.update(str(n.target) for m in g.modules() if isinstance(m, torch.fx.GraphModule)
                            for n in m.graph.nodes if n.op == "call_function")
                return g.forward
            return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

        compiled = torch.compile(model, fullgraph=True, backend=record)
        got_c = _run((compiled, model), steps, dynamic=True)
        res["compiled_err"] = _max_err(got_c, want)
        graphs = counters["stats"]["unique_graphs"]
        other = _other_batch_steps(hf.config.vocab_size, seed=2)
        with torch.compiler.set_stance("fail_on_recompile"):
            got_o = _run((compiled, model), other, dynamic=True)
        res["other_batch_err"] = _max_err(got_o, _run(ref, other))
        res["recompiled"] = counters["stats"]["unique_graphs"] - graphs
        res["graph_breaks"] = dict(counters["graph_break"])
        res["collectives"] = sorted(t for t in seen if "c10d" in t)
        res["region_calls"] = region_calls
    return res


def sharded_from_meta(rank, world, kind, pconf):
    """A model built on the meta device, sharded from a state dict, equals the single-process one."""
    import transformers

    state = init(ParallelConfig(**pconf), timeout=60)
    hf = toy.toy_hf_model(kind, seed=3)
    ref = patch(copy.deepcopy(hf))
    weights = hf.state_dict()
    cfg = toy.toy_hf_config(kind)
    cfg._attn_implementation = "eager"
    cls = {"v2-lite": transformers.DeepseekV2ForCausalLM, "v3": transformers.DeepseekV3ForCausalLM}[kind]
    with torch.device("meta"):
        empty = cls(cfg).eval()
    model = patch(empty, parallel=state, weights=weights)
    steps = _steps(cfg.vocab_size, seed=5)
    meta_left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    return {"err": _max_err(_run(model, steps), _run(ref, steps)), "meta_left": meta_left}


def mismatch(rank, world):
    """init with a config of another world size: the error message."""
    try:
        init(ParallelConfig(tp=world * 2), timeout=10)
    except ValueError as e:
        return str(e)
    return None


def dead_peer(rank, world, timeout_s, how):
    """Rank 1 exits (``how="exit"``) or stops taking part (``"hang"``: sleeps past the timeout, then exits)
    after init; rank 0's next collective must raise (seconds it took, error text)."""
    import torch.distributed as dist

    state = init(ParallelConfig(tp=world), timeout=timeout_s)
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 1:
        if how == "hang":
            time.sleep(timeout_s + 5)
        os._exit(0)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            float(torch.distributed._functional_collectives.all_reduce(x, "sum", state.tp.group).sum())
    except Exception as e:  # noqa: BLE001
        return {"seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"[:300]}
    return None


def lonely(rank, world, timeout_s):
    """Rank 0 of a world of 2 whose peer never comes: init must raise within the timeout."""
    t0 = time.monotonic()
    try:
        init(ParallelConfig(tp=2), rank=0, world_size=2, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001
        return {"seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"[:300]}
    return None


def crash_first(rank, world, marker, always):
    """Rank 0 aborts (SIGABRT, as glibc does on a corrupted heap) unless ``marker`` exists, creating it first
    (``always``: aborts every time); else every rank returns its rank and an all-reduced sum."""
    import torch.distributed as dist

    if rank == 0 and (always or not os.path.exists(marker)):
        open(marker, "w").close()
        os.abort()
    x = torch.full((2,), float(rank + 1))
    dist.all_reduce(x)
    return rank, x.tolist()


def hang_rank0(rank, world, hang):
    """``hang``: rank 0 sleeps far past any test deadline (a hung rank) and the others raise; else the rank."""
    if not hang:
        return rank
    if rank == 0:
        time.sleep(600)
    raise ValueError(f"rank {rank} gave up")


def subgroup_kept(rank, world):
    """A subgroup made and destroyed by ``parallel.init`` / ``destroy`` (single-rank collectives: one group a
    rank) in a pool worker: still registered after ``destroy``; a group of both ranks made here still sums after
    ``torch.distributed.destroy_process_group``, and so does the default group."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from mla_compile.parallel import destroy

    sub = init(ParallelConfig(tp=world), single_rank_collectives=True, timeout=60).dcp.group
    destroy()
    both = dist.new_group(list(range(world)))
    dist.destroy_process_group(both)
    x, y = torch.full((2,), float(rank + 1)), torch.full((2,), float(rank + 3))
    dist.all_reduce(x, group=both)
    dist.all_reduce(y)
    return {"kept": sub in _world.pg_map and both in _world.pg_map, "sums": (x.tolist(), y.tolist())}


def destroy_owns_what_init_made(rank, world, store_path, init_makes_default):
    """``destroy`` ends only what ``init`` made. ``init_makes_default`` False: after ``init`` on a default group the
    caller made (a FileStore at ``store_path``), the subgroups init made (tp=world, dcp=1 with single-rank
    collectives: one real group a rank) are gone, the default group stays and still sums. True: after ``init``
    made the default group itself (env rendezvous), the group sums, then ``destroy`` ends torch.distributed. Every
    rank runs a collective before ``destroy``: a rank that tears its group down at once can close its connections
    while a peer still connects gloo's mesh ("Gloo connectFullMesh failed ... Connection closed by peer")."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from mla_compile.parallel import destroy

    if init_makes_default:
        init(ParallelConfig(tp=world), timeout=60)
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x)
        res = {"made_default": dist.is_initialized(), "sum": x.tolist()}
        destroy()
        res["ended"] = not dist.is_initialized()
        return res
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    state = init(ParallelConfig(tp=world), single_rank_collectives=True, timeout=60)
    sub = state.dcp.group
    res = {"sub_made": sub is not None and sub is not dist.group.WORLD and sub in _world.pg_map}
    destroy()
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)
    res.update(sub_gone=sub not in _world.pg_map, default_kept=dist.is_initialized(), sum=x.tolist())
    dist.destroy_process_group()
    return res


def groups_layout(rank, world, pconf):
    """This rank's groups (ranks, index, whether a process group backs them) and a sum over its attention group."""
    import torch.distributed._functional_collectives as funcol

    state = init(ParallelConfig(**pconf), timeout=30)
    out = {name: (list(getattr(state, name).ranks), getattr(state, name).rank)
           for name in ("tp", "attn", "dcp", "ep", "moe_tp")}
    out["real"] = {name: getattr(state, name).group is not None for name in ("tp", "attn", "dcp", "ep", "moe_tp")}
    out["sum"] = float(funcol.all_reduce(torch.tensor([rank + 1.0]), "sum", state.attn.group)[0])
    return out


def eager_layer_collectives(rank, world):
    """``parallel.layers``' collectives run eagerly over gloo on this rank's seeded inputs (a non-contiguous one
    among them): each result's type name and value."""
    from mla_compile.parallel import layers

    state = init(ParallelConfig(tp=world), timeout=30)
    x = torch.randn(world * 2, 5, 3, generator=torch.Generator().manual_seed(100 + rank)).transpose(1, 2)
    outs = {"reduce": layers.all_reduce(x, state.tp), "gather0": layers.all_gather(x, 0, state.tp),
            "gather_last": layers.all_gather(x, -1, state.tp), "to_all": layers.all_to_all(x.bfloat16(), state.tp)}
    return {k: (type(v).__name__, v.clone()) for k, v in outs.items()}


def split_paged_cache(rows, lens, world, rank, interleave, bs, spare=0):
    """This rank's paged cache of the sequences ``rows`` (``[len_b, D]`` each; ``lens`` their lengths), their
    tokens block-interleaved over ``world`` ranks: ``(cache, table, local_lens)``. The cache is NaN but for this
    rank's tokens, its blocks in a per-rank random order; ``spare`` more table entries a row, pointing at NaN
    blocks."""
    from mla_compile.parallel import dcp

    B, D = len(rows), rows[0].shape[1]
    local = dcp.local_seq_lens(lens, world, rank, interleave)
    max_blocks = max(1, max(-(-int(n) // bs) for n in local)) + spare
    cache = torch.full((B * max_blocks + 2, bs, D), float("nan"))
    perm = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(rank))
    table = perm[:B * max_blocks].view(B, max_blocks).int()
    for b, r in enumerate(rows):
        pos = torch.arange(r.shape[0])
        slots = dcp.local_slot_mapping(pos, table, torch.full_like(pos, b), bs, world, rank, interleave)
        keep = slots >= 0
        cache.view(-1, D)[slots[keep]] = r[keep]
    return cache, table, local


def unsplit_paged_cache(rows, bs):
    """Every token of the sequences ``rows`` in one paged cache (sequence b in its own run of blocks, NaN past its
    length): ``(cache, table)``, what the single-process op reads."""
    B, D = len(rows), rows[0].shape[1]
    nb = max(1, max(-(-r.shape[0] // bs) for r in rows))
    whole = torch.full((B * nb, bs, D), float("nan"))
    table = torch.arange(B * nb).view(B, nb).int()
    for b, r in enumerate(rows):
        whole.view(-1, D)[b * nb * bs: b * nb * bs + r.shape[0]] = r
    return whole, table


def dcp_decode_parts(rank, world, interleave, seq_lens, compile_it):
    """Each rank holds its tokens of every sequence (block-interleaved) in its own NaN-filled paged cache and
    runs ``dcp_decode``; returns the max errors against a float64 softmax over the whole rows and against
    ``ops.decode`` over one unsplit cache, and (compiled) the ops in the graph."""
    from mla_compile import ops
    from mla_compile.parallel import dcp

    state = init(ParallelConfig(tp=world, dcp=world), timeout=30)
    gen = torch.Generator().manual_seed(123)  # the same data on every rank
    B, H, Dc, R, bs = len(seq_lens), 4, 32, 16, 4
    D, scale = Dc + R, 0.3
    rows = [torch.randn(n, D, generator=gen) for n in seq_lens]
    q = torch.randn(B, H, D, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cache, table, local = split_paged_cache(rows, lens, world, rank, interleave, bs)
    fn = dcp.dcp_decode
    seen: set[str] = set()
    if compile_it:
        from torch._functorch.aot_autograd import aot_module_simplified

        def record(gm, example_inputs):
            def fw(g, _):
                seen.update(str(n.target) for n in g.graph.nodes if n.op == "call_function")
                return g.forward
            return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

        fn = torch.compile(dcp.dcp_decode, fullgraph=True, backend=record)
    out, lse = fn(q, cache, table, local, scale, state.dcp, kv_lora_rank=Dc)
    # float64 reference from the math: softmax(q k^T * scale) v over each whole sequence
    err_out = err_lse = 0.0
    for b, r in enumerate(rows):
        if r.shape[0] == 0:
            want_out = torch.zeros(H, Dc, dtype=torch.float64)
            want_lse = torch.full((H,), float("-inf"), dtype=torch.float64)
        else:
            s = q[b].double() @ r.double().T * scale
            want_lse = torch.logsumexp(s, -1)
            want_out = torch.softmax(s, -1) @ r.double()[:, :Dc]
        assert bool(torch.equal(torch.isinf(lse[b]), torch.isinf(want_lse))), (b, lse[b], want_lse)
        fin = torch.isfinite(want_lse)
        err_lse = max(err_lse, float((lse[b].double() - want_lse)[fin].abs().max()) if bool(fin.any()) else 0.0)
        err_out = max(err_out, float((out[b].double() - want_out).abs().max()))
    # and the single-rank op over one unsplit cache
    whole, wtable = unsplit_paged_cache(rows, bs)
    u_out, u_lse = ops.decode(q, whole, wtable, lens, scale, kv_lora_rank=Dc)
    return {"err_out": err_out, "err_lse": err_lse, "local_lens": local.tolist(),
            "vs_unsplit": float((out - u_out).abs().max()),
            "finite": bool(torch.isfinite(out).all()), "ops": sorted(t for t in seen if "c10d" in t or "mla" in t)}


def _dp_steps(vocab: int, group: int):
    """Attention group ``group``'s own requests: other prompts per group, the same token and row counts on
    every group (as data-parallel attention needs): prefill with a cached prefix, chunked prefill over it
    mixed with a decode, two decode steps."""
    gen = torch.Generator().manual_seed(100 + group)
    lens = [(13, 5), (11, 7)][group % 2]  # prefix 8 + 5 and 6 + 7 tokens: 13 either way
    cut = [8, 6][group % 2]
    a, b = (torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens)
    dec = torch.randint(0, vocab, (2, 3), generator=gen).tolist()
    ba, bb = _blocks([len(a) + 3, len(b) + 3], seed=group)
    steps = [plan_step([], [SeqChunk(ba, a[:cut]), SeqChunk(bb, b)], BS, logits="all"),
             plan_step([SeqChunk(bb, [dec[1][0]], len(b))], [SeqChunk(ba, a[cut:cut + 5], cut)], BS, logits="all")]
    for j in range(2):
        steps.append(plan_step([SeqChunk(ba, [dec[0][j]], cut + 5 + j), SeqChunk(bb, [dec[1][j + 1]], len(b) + 1 + j)],
                               [], BS))
    return steps


def dp_attention_equals_single(rank, world, kind, pconf, compile_too, overrides=None, regional=False):
    """Data-parallel attention: each attention group runs its own requests; its logits equal the single-process
    model on those requests. Also the per-rank cache copies and, compiled, breaks and collectives.
    ``overrides``: toy config changes; ``regional``: the sharded model patched with ``regional_compile=True``."""
    from mla_compile.models.cache import CacheLayout

    state = init(ParallelConfig(**pconf), timeout=60)
    hf = toy.toy_hf_model(kind, seed=9, **(overrides or {}))
    ref = patch(copy.deepcopy(hf))
    steps = _dp_steps(hf.config.vocab_size, rank // state.config.attn_tp)
    want = _run(ref, steps)
    model = patch(hf, parallel=state, regional_compile=regional)
    res = {"err": _max_err(_run(model, steps), want), "heads": model.attentions[0].config.num_heads,
           "copies": CacheLayout(model.config, "bf16", model.parallel_state.config).copies}
    if compile_too:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, fullgraph=True, backend="eager")  # Dynamo only: fullgraph, no breaks
        res["compiled_err"] = _max_err(_run((compiled, model), steps, dynamic=True), want)
        res["graph_breaks"] = dict(counters["graph_break"])
    return res


def cuda_graphs(rank, world, pconf):
    """NCCL, one GPU per rank (world size 1: real single-rank process groups): the sharded model's logits equal
    the unsharded model's (eager, fp32), and compiled and replayed in CUDA graphs by DecodeGraphRunner under an
    Engine (the same on every rank) it gives the tokens of the same compiled steps run uncaptured."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.engine import Engine
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from tests.engine_load import run_workload

    state = init(ParallelConfig(**pconf), single_rank_collectives=world == 1, timeout=120)
    dev = state.device
    hf = toy.toy_hf_model("v3", seed=6, device=dev, dtype=torch.float32, num_hidden_layers=2)
    ref = patch(copy.deepcopy(hf), backend="triton")
    model = patch(hf, parallel=state, backend="triton")
    load = dict(seed=3, n_requests=12, gap=8, max_new=40)

    def engine(step_fn, owner, enabled):
        builder = MetadataBuilder(max_batch=8, max_blocks_per_seq=8, max_tokens=256, block_size=16, device=dev)
        owner.allocate_cache(128, 16)
        return Engine(DecodeGraphRunner(step_fn, builder, capture_sizes=[2, 4, 8], enabled=enabled,
                                        strict_sync=enabled), num_blocks=128)

    # eager: the sharded model (collectives over NCCL) against the unsharded one, logits of the step script
    steps_in = [s.to(dev) for s in _steps(hf.config.vocab_size, seed=11)]
    with torch.no_grad():
        ref.allocate_cache(NUM_BLOCKS, BS, fill=float("nan"))
        want_logits = [ref(s.input_ids, s.positions, s.meta)[:s.num_rows].clone() for s in steps_in]
    err = _max_err(_run(model, steps_in), want_logits)
    # compiled and captured: the same tokens as the same compiled steps run uncaptured
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    want, steps = run_workload(engine(compiled, model, False), **load)
    eng = engine(compiled, model, True)
    eng.runner.capture()
    got, got_steps = run_workload(eng, **load)
    return {"backend": dist.get_backend(), "eager_err": err, "same_tokens": got == want, "steps": steps,
            "got_steps": got_steps, "replays": eng.runner.replays, "graph_breaks": dict(counters["graph_break"]),
            "real_group": state.tp.group is not None}


def dcp_model_equals_single(rank, world, kind, interleave, compile_too, kv_cache="bf16", overrides=None):
    """DCP over both ranks (tp=2, dcp=2): each rank caches its tokens of every sequence (block-interleaved); the
    logits of prefill and decode steps equal the single-process model's (with the same ``kv_cache`` format: the
    fp8 rows quantize the same latents alike). Also the per-rank cache rows written (the first layer's).
    ``overrides``: toy config changes."""
    from mla_compile.models.cache import FP8_POISON
    from mla_compile.parallel.dcp import local_seq_lens, plan_dcp_step

    state = init(ParallelConfig(tp=world, dcp=world), timeout=60)
    hf = toy.toy_hf_model(kind, seed=13, **(overrides or {}))
    ref = patch(copy.deepcopy(hf))
    gen = torch.Generator().manual_seed(4)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 13, 6)]  # 3 < one block: rank 1 empty
    dec = torch.randint(0, vocab, (3, 3), generator=gen).tolist()
    ends = [len(p) + 3 for p in prompts]
    glob = _blocks(ends, seed=21)
    own = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(50 + rank)).tolist()
    local, at = [], 0
    for n in ends:
        need = max(1, -(-int(local_seq_lens(torch.tensor([n]), world, rank, interleave)[0]) // BS))
        local.append(own[at:at + need])
        at += need

    def script(blocks, planner):
        steps = [planner([], [SeqChunk(b, p) for b, p in zip(blocks, prompts)], logits="all")]
        for j in range(3):
            steps.append(planner([SeqChunk(b, [t[j]], len(p) + j) for b, t, p in zip(blocks, dec, prompts)], []))
        return steps

    def local_blocks(ends, seed):
        own = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed + rank)).tolist()
        out, at = [], 0
        for n in ends:
            need = max(1, -(-int(local_seq_lens(torch.tensor([n]), world, rank, interleave)[0]) // BS))
            out.append(own[at:at + need])
            at += need
        return out

    dcp_plan = lambda d, p, **kw: plan_dcp_step(d, p, BS, world, rank, interleave=interleave, **kw)  # noqa: E731
    fp8 = kv_cache == "fp8"
    ref.kv_cache_dtype = "fp8" if fp8 else None
    want = _run(ref, script(glob, lambda d, p, **kw: plan_step(d, p, BS, **kw)))
    steps = script(local, dcp_plan)
    model = patch(hf, parallel=state)
    model.kv_cache_dtype = ref.kv_cache_dtype
    got = _run(model, steps)
    cache = model.attentions[0].kv_cache
    # a written row: a finite first value (bf16), or leading bytes other than the NaN fill's (fp8: a quantized
    # finite value is never the 0xFF NaN pattern)
    written = int((cache[:, :, :16] != FP8_POISON).any(-1).sum() if fp8 else (~torch.isnan(cache[:, :, 0])).sum())
    # prefix-cached prefill and chunked prefill over context split across the ranks (the _steps script)
    want_ctx = _run(ref, _steps(vocab, seed=11))
    ctx_steps = _steps(vocab, seed=11, blocks=local_blocks([n + 3 for n in STEP_LENS], 70), planner=dcp_plan)
    res = {"err": _max_err(got, want), "finite": all(bool(torch.isfinite(g).all()) for g in got),
           "rows_written": written, "type": type(model.attentions[0]).__name__,
           "ctx_err": _max_err(_run(model, ctx_steps), want_ctx),
           "ctx_rows": [int(s.meta.prefill.context.rows.sum()) for s in ctx_steps
                        if s.meta.prefill is not None and s.meta.prefill.context is not None]}
    if compile_too:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, fullgraph=True, backend="eager")  # Dynamo only: fullgraph, no breaks
        res["compiled_err"] = _max_err(_run((compiled, model), steps, dynamic=True), want)
        res["compiled_ctx_err"] = _max_err(_run((compiled, model), ctx_steps, dynamic=True), want_ctx)
        res["graph_breaks"] = dict(counters["graph_break"])
    return res


def engine_per_rank(rank, world, pconf):
    """Every rank runs the same Engine (the same deterministic scheduler) over the sharded model, through a
    DecodeGraphRunner (uncaptured on CPU: the same padded steps); tokens equal the unsharded engine's."""
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.engine import Engine
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from tests.engine_load import run_workload

    state = init(ParallelConfig(**pconf), timeout=60)
    hf = toy.toy_hf_model("v3", seed=2, num_hidden_layers=2)
    ref = patch(copy.deepcopy(hf))
    model = patch(hf, parallel=state)
    load = dict(seed=4, n_requests=6, gap=4, max_new=12, max_prompt=12)

    def engine(m):
        m.allocate_cache(64, BS)
        builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=8, max_tokens=96, block_size=BS, device="cpu")
        return Engine(DecodeGraphRunner(m, builder, capture_sizes=[2, 4], enabled=False), num_blocks=64)

    want, steps = run_workload(engine(ref), **load)
    got, got_steps = run_workload(engine(model), **load)
    return {"same": got == want, "steps": steps, "got_steps": got_steps, "tokens": sum(len(t) for t in got)}


def from_pretrained_sharded(rank, world, root, pconf, dp=False):
    """``from_pretrained(dir, parallel=...)`` equals the single-process load of the same checkpoint (float, fp8 or
    fp4 experts): max logits error and greedy tokens (argmax of every row) over the step script (``dp``: each
    data-parallel attention group its own requests); each rank keeps only its shard (parameter counts, the
    shapes and dtypes of every parameter) and nothing is left on the meta device."""
    from mla_compile.models.loader import from_pretrained

    state = init(ParallelConfig(**pconf), timeout=60)
    model = from_pretrained(root, parallel=state, dtype=torch.float32)
    ref = from_pretrained(root, dtype=torch.float32)
    vocab = ref.config.vocab_size
    steps = _dp_steps(vocab, rank // state.config.attn_tp) if dp else _steps(vocab, seed=7)
    got, want = _run(model, steps), _run(ref, steps)
    meta_left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]

    def experts(m):
        return sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)

    return {"err": _max_err(got, want), "meta_left": meta_left,
            "finite": all(bool(torch.isfinite(g).all()) for g in got),
            "same_tokens": all(torch.equal(g.argmax(-1), x.argmax(-1)) for g, x in zip(got, want)),
            "params": sum(p.numel() for p in model.parameters()),
            "full_params": sum(p.numel() for p in ref.parameters()),
            "expert_params": experts(model), "full_expert_params": experts(ref),
            "shapes": {n: (list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()}}


def from_pretrained_error(rank, world, roots, pconf):
    """``from_pretrained(dir, parallel=...)`` of each checkpoint in ``roots`` that cannot be split so: the error
    texts (None where it loaded)."""
    from mla_compile.models.loader import from_pretrained

    state = init(ParallelConfig(**pconf), timeout=60)
    errors = []
    for root in roots:
        try:
            from_pretrained(root, parallel=state, dtype=torch.float32)
            errors.append(None)
        except ValueError as e:
            errors.append(f"{type(e).__name__}: {e}")
    return errors


def quantized_checkpoint_on_device(rank, world, root, pconf):
    """``from_pretrained(dir, parallel=...)`` of an fp8 / fp4-expert checkpoint on this rank's device (NCCL on a
    GPU; world size 1 runs real single-rank groups) against the single-process load there: eager and
    fullgraph-compiled logits errors, greedy tokens, graph breaks. fp32 activations."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from mla_compile.models.loader import from_pretrained

    state = init(ParallelConfig(**pconf), single_rank_collectives=world == 1, timeout=120)
    model = from_pretrained(root, parallel=state, dtype=torch.float32)
    ref = from_pretrained(root, device=state.device, dtype=torch.float32)
    steps = [s.to(state.device) for s in _steps(ref.config.vocab_size, seed=7)]
    want = _run(ref, steps)
    got = _run(model, steps)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    got_c = _run((compiled, model), steps, dynamic=True)
    return {"backend": dist.get_backend(), "device": str(model.lm_head.weight.device),
            "err": _max_err(got, want), "compiled_err": _max_err(got_c, want),
            "same_tokens": all(torch.equal(g.argmax(-1), x.argmax(-1)) for g, x in zip(got, want)),
            "graph_breaks": dict(counters["graph_break"]), "real_group": state.tp.group is not None}


def _dcp_script(vocab: int, q: int):
    """The step script of :func:`dcp_multi_token_equals_single`: ``(script(blocks, planner), ends)``, ``ends`` each
    sequence's final length (``planner(decode, prefill, **kw)`` as ``plan_step`` without its block size)."""
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (19, 6, 11)]
    dec = [torch.randint(0, vocab, (3 * q,), generator=gen).tolist() for _ in prompts]
    ends = [len(p) + 3 * q for p in prompts]

    def script(blocks, planner):
        b0, b1, b2 = blocks
        p0, p1, p2 = prompts
        steps = [
            # the first 9 tokens of prompt 0 (cached context next step), prompt 1 whole
            planner([], [SeqChunk(b0, p0[:9]), SeqChunk(b1, p1)], logits="all"),
            # chunked prefill of prompt 0 over its 9 cached tokens, a fresh prompt 2 and a q-token decode of 1
            planner([SeqChunk(b1, dec[1][:q], len(p1))], [SeqChunk(b0, p0[9:], 9), SeqChunk(b2, p2[:7])],
                    logits="all", query_len=q),
            # prompt 2's last tokens over its 7 cached ones
            planner([], [SeqChunk(b2, p2[7:], 7)], logits="all"),
        ]
        for j in range(2):  # q-token decode of all three
            starts = [len(p0) + j * q, len(p1) + (j + 1) * q, len(p2) + j * q]
            toks = [dec[0][j * q:(j + 1) * q], dec[1][(j + 1) * q:(j + 2) * q], dec[2][j * q:(j + 1) * q]]
            steps.append(planner([SeqChunk(b, t, s) for b, t, s in zip(blocks, toks, starts)], [], logits="all",
                                 query_len=q))
        return steps

    return script, ends


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


def dcp_multi_token_equals_single(rank, world, kind, interleave, query_len, compile_too, sink_window=None,
                                  dcp_size=None, layers=None, other_batch=False, regional=False):
    """DCP over the ranks (tp=world, dcp=``dcp_size``, default world; 1: TP alone, whole cache rows on every rank)
    on steps with cached context and multi-token decode: a prefill of a prefix and a prompt; chunked prefill over
    the cached prefix mixed with a ``query_len``-token decode; two ``query_len``-token decode steps (every token's
    logits). Logits vs the single-process model, planned two ways: :func:`plan_dcp_step` (each rank's own
    blocks) and :func:`localize` of the global plan (what the demo's engine path does). A sparse (V3.2) ``kind``
    picks top-k slots over contexts longer than its ``index_topk``. ``sink_window=(sink, window)``: both models
    patched with sink + window attention (contexts run past it), and how far the dense model is (the window must
    matter). ``layers``: the toy's layer count (default the toy's). (``compile_too``) fullgraph compile: breaks,
    collectives, and (``other_batch``) other batch sizes without a recompile. ``regional``: the sharded model patched
    with ``regional_compile=True`` (its eager run too)."""
    from mla_compile.models.metadata import mark_dynamic
    from mla_compile.parallel.dcp import localize, plan_dcp_step

    state = init(ParallelConfig(tp=world, dcp=dcp_size or world), timeout=60)
    P, rank = state.dcp.size, state.dcp.rank
    hf = toy.toy_hf_model(kind, seed=17, **({} if layers is None else {"num_hidden_layers": layers}))
    vocab = hf.config.vocab_size
    sparse = {} if sink_window is None else dict(sparse="sink_window", sink=sink_window[0], window=sink_window[1])
    dense = patch(copy.deepcopy(hf)) if sink_window is not None else None
    ref = patch(copy.deepcopy(hf), **sparse)
    model = patch(hf, parallel=state, regional_compile=regional, **sparse)
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

    attn = model.attentions[0]
    got = _run(model, planned)
    res = {"type": type(attn).__name__, "indexer": type(attn.indexer).__name__ if attn.indexer is not None else None,
           "topk": getattr(hf.config, "index_topk", None), "longest": max(ends), "sink_window": model.sink_window,
           "attn_sink_window": [a.sink_window for a in model.attentions],
           "finite": all(bool(torch.isfinite(g).all()) for g in got), "err": _max_err(got, want),
           "step_errs": [_max_err([g], [x]) for g, x in zip(got, want)], "rows": [g.shape[0] for g in got],
           "err_localize": _max_err(_run((localized(model), model), script(glob, global_plan)), want)}
    if dense is not None:
        res["vs_dense"] = _max_err(_run(dense, script(glob, global_plan)), want)
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
        if other_batch:
            graphs = counters["stats"]["unique_graphs"]
            other, other_ends = _other_batch(vocab, query_len)
            other_want = _run(ref, other(_blocks(other_ends, seed=5), global_plan))
            with torch.compiler.set_stance("fail_on_recompile"):
                got_o = _run((compiled, model), other(_own_blocks(other_ends, P, rank, interleave, 60), rank_plan),
                             dynamic=True)
                got_l = _run((localized(compiled, dynamic=True), model),
                             other(_blocks(other_ends, seed=5), global_plan))
            res["other_err"] = max(_max_err(got_o, other_want), _max_err(got_l, other_want))
            res["recompiled"] = counters["stats"]["unique_graphs"] - graphs
        res["graph_breaks"] = dict(counters["graph_break"])
        res["collectives"] = sorted(t for t in seen if "c10d" in t)
        res["sparse_decode"] = any("sparse_decode" in t for t in seen)
    return res


def dcp_one_rank(kind, device, query_len, compile_backend=None, sink_window=None, overrides=None):
    """The DCP layers over a group of one rank (no process group: the collectives are skipped) on ``device``,
    through :func:`_dcp_script`: ``DCPAttention`` (and ``DCPIndexer``) built from a patched model's layers, so
    their code paths (per-query causal limits, candidate merge; with ``sink_window=(sink, window)`` the sink +
    window slots of each rank) run with the device's backends. Max logits error against the patched model, eager
    and (``compile_backend``) compiled fullgraph, and the longest sequence of the script. ``overrides``: toy config
    changes."""
    from mla_compile.models.metadata import mark_dynamic
    from mla_compile.parallel.attention import DCPAttention
    from mla_compile.parallel.dcp import plan_dcp_step
    from mla_compile.parallel.groups import Group

    hf = toy.toy_hf_model(kind, seed=17, device=device, **(overrides or {}))
    sparse = {} if sink_window is None else dict(sparse="sink_window", sink=sink_window[0], window=sink_window[1])
    ref = patch(copy.deepcopy(hf), **sparse)
    model = patch(hf, **sparse)
    one = Group(None, (0,), 0)
    for layer in model.model.layers:
        layer.self_attn = DCPAttention(layer.self_attn.config, layer.self_attn, one)
    if sink_window is not None:
        model.set_sink_window(*sink_window)  # onto the DCP layers
    script, ends = _dcp_script(hf.config.vocab_size, query_len)
    blocks = _blocks(ends, seed=23)

    def run(fn, owner, steps, dynamic=False):
        owner.allocate_cache(NUM_BLOCKS, BS, fill=float("nan"), device=device)
        outs = []
        with torch.no_grad():
            for st in steps:
                st = st.to(device)
                if dynamic:
                    mark_dynamic(st.input_ids, st.positions, st.meta)
                outs.append(fn(st.input_ids, st.positions, st.meta)[:st.num_rows].float().cpu())
        return outs

    want = run(ref, ref, script(blocks, lambda d, p, **kw: plan_step(d, p, BS, **kw)))
    steps = script(blocks, lambda d, p, **kw: plan_dcp_step(d, p, BS, 1, 0, **kw))
    res = {"types": sorted({type(a).__name__ for a in model.attentions}),
           "indexers": sorted({type(a.indexer).__name__ for a in model.attentions if a.indexer is not None}),
           "err": _max_err(run(model, model, steps), want), "longest": max(ends)}
    if compile_backend is not None:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
        res["compiled_err"] = _max_err(run(compiled, model, steps, dynamic=True), want)
        res["graph_breaks"] = dict(counters["graph_break"])
    return res


def dcp_engine_per_rank(rank, world, kind):
    """Every rank runs the same Engine over the DCP model (tp=2, dcp=2) through the demo's DCP step
    (:func:`mla_compile.parallel.dcp.localize` of each planned step), with a small token budget so prompts are
    prefilled in chunks over their cached context; tokens equal the unsharded engine's."""
    from mla_compile.app.demo import _dcp_step
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.engine import Engine
    from tests.engine_load import run_workload

    state = init(ParallelConfig(tp=world, dcp=world), timeout=60)
    hf = toy.toy_hf_model(kind, seed=2, num_hidden_layers=2)
    ref = patch(copy.deepcopy(hf))
    model = patch(hf, parallel=state)
    load = dict(seed=5, n_requests=5, gap=3, max_new=8, max_prompt=24)
    chunked = []

    def engine(m, step):
        m.allocate_cache(64, BS)
        builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=10, max_tokens=12, block_size=BS, device="cpu")
        return Engine(DecodeGraphRunner(step, builder, capture_sizes=[2, 4], enabled=False), num_blocks=64)

    def counting(step):
        def run(input_ids, positions, meta):
            chunked.append(meta.prefill is not None and meta.prefill.context is not None)
            return step(input_ids, positions, meta)
        run._orig_mod = model
        return run

    want, steps = run_workload(engine(ref, ref), **load)
    got, got_steps = run_workload(engine(model, counting(_dcp_step(model, BS, state))), **load)
    return {"same": got == want, "steps": steps, "got_steps": got_steps, "tokens": sum(len(t) for t in got),
            "context_steps": sum(chunked)}


def _v4_steps(group: int, vocab: int) -> list[list[list[int]]]:
    """Attention group ``group``'s own V4 requests: a batched prefill of two prompts (19 tokens either group, other
    lengths and tokens per group), then decode steps of one token each (the same token count on every group)."""
    gen = torch.Generator().manual_seed(200 + group)
    lens = [(12, 7), (5, 14)][group % 2]
    prefill = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    return [prefill] + [[[int(t)] for t in torch.randint(0, vocab, (2,), generator=gen)] for _ in range(4)]


def _v4_run(model, run, steps) -> list[torch.Tensor]:
    """Logits of each step through ``run`` over a NaN-filled V4 cache (two sequences)."""
    from mla_compile.models.v4_model import V4Sequences

    seqs = V4Sequences(model, 2, 40, 4, fill=float("nan"))
    with torch.no_grad():
        return [seqs.step(run, [0, 1], chunks).clone() for chunks in steps]


def v4_sharded_equals_single(rank, world, dp, compile_backend=None, regional=False):
    """DeepSeek-V4 as ``ParallelConfig(tp=world, dp_attention=dp, ep=world)``: ``dp`` data-parallel attention groups
    of ``world / dp`` ranks that split the heads, the routed experts over all ranks. The ranks of a group run the
    group's requests and their logits equal the unsharded model's; each rank keeps ``dp / world`` of the heads
    (``q_b_proj`` rows, sinks, ``o_a_proj`` groups, ``o_b_proj`` columns) and ``1 / world`` of the routed experts.
    ``compile_backend``: also the model compiled fullgraph (its breaks)."""
    from mla_compile.app.v4_toy import toy_v4_model
    from mla_compile.parallel.v4 import ParallelV4Attention, ParallelV4MoE

    state = init(ParallelConfig(tp=world, dp_attention=dp, ep=world), timeout=60)
    hf = toy_v4_model(5)
    cfg = hf.config
    ref = patch(copy.deepcopy(hf))
    steps = _v4_steps(rank // (world // dp), cfg.vocab_size)  # the attention group's requests
    want = _v4_run(ref, ref, steps)
    model = patch(hf, parallel=state, regional_compile=regional)
    got = _v4_run(model, model, steps)
    a, full = model.attn[0].hf, ref.attn[0].hf
    shapes = lambda m: [tuple(m.q_b_proj.weight.shape), tuple(m.o_b_proj.weight.shape),  # noqa: E731
                        tuple(m.o_a_proj.weight.shape), tuple(m.sinks.shape)]
    res = {"err": _max_err(got, want), "finite": all(bool(torch.isfinite(g).all()) for g in got),
           "heads": [m.num_heads for m in model.attn], "all_heads": cfg.num_attention_heads,
           "o_groups": [m.o_groups for m in model.attn], "all_groups": cfg.o_groups,
           "shapes": shapes(a), "full_shapes": shapes(full),
           "local_experts": model.moe[-1].hf.experts.num_experts, "experts": cfg.n_routed_experts,
           "split_attention": all(isinstance(m, ParallelV4Attention) for m in model.attn),
           "all_parallel": all(isinstance(m, ParallelV4MoE) for m in model.moe)}
    if compile_backend is not None:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
        res["compiled_err"] = _max_err(_v4_run(model, compiled, steps), want)
        res["graph_breaks"] = dict(counters["graph_break"])
    return res


def v4_sharded_from_meta(rank, world):
    """DeepSeek-V4 built on the meta device and sharded (DP attention + EP) from a state dict: each rank's logits on
    its requests equal the single-process model's; nothing is left on meta; each rank holds half the experts."""
    import transformers

    from mla_compile.app.v4_toy import toy_v4_model

    state = init(ParallelConfig(tp=world, dp_attention=world, ep=world), timeout=60)
    hf = toy_v4_model(5)
    ref = patch(copy.deepcopy(hf))
    steps = _v4_steps(rank, hf.config.vocab_size)
    want = _v4_run(ref, ref, steps)
    with torch.device("meta"):
        empty = transformers.DeepseekV4ForCausalLM(hf.config).eval()
    model = patch(empty, parallel=state, weights=hf.state_dict())
    meta_left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    got = _v4_run(model, model, steps)
    return {"err": _max_err(got, want), "meta_left": meta_left,
            "local_experts": model.moe[0].hf.experts.num_experts, "experts": hf.config.n_routed_experts}


def v4_dp_ep_quantized_equals_single(rank, world, kind, where, attn_tp=False):
    """As :func:`v4_sharded_equals_single` (data-parallel attention) with the model loaded from a V4 checkpoint
    written by rank 0 under ``where`` by ``from_pretrained(parallel=...)``: ``kind`` "fp8" (e4m3 block experts) or
    "fp4" (packed e2m1 + ue8m0; fp8 linears elsewhere: each rank keeps its experts quantized, ``FP8Experts`` /
    ``FP4Experts`` of half the experts),
    "float" (save_pretrained's per-expert keys) or "stacked" (the modules' ``[E, ...]`` expert tensors). Also which
    experts' tensors the rank read (``experts_read``) and how the stacked ones were read (``stacked_reads``).
    ``attn_tp``: the heads split over the ranks instead (``ParallelConfig(tp=world, ep=world)``, the same requests on
    every rank), over a toy whose grouped ``o_a_proj`` is fp8 too (128-row groups): the attention's fp8 weights
    split with their block scales (``q_b``'s and ``o_b``'s halves inside one block here)."""
    from pathlib import Path

    import torch.distributed as dist

    from mla_compile import from_pretrained
    from mla_compile.models.fp4_linear import FP4Experts
    from mla_compile.models.fp8_linear import FP8Experts
    from tests.model.test_v4_checkpoint import _quantized_checkpoint

    state = init(ParallelConfig(tp=world, dp_attention=1 if attn_tp else world, ep=world), timeout=60)
    root = Path(where) / "q"
    overrides = {"moe_intermediate_size": 32} if kind == "fp4" else {}
    if attn_tp:
        overrides["o_lora_rank"] = 128
    if rank == 0:  # one writer (transformers' save_pretrained writes on the main process only)
        if kind in ("float", "stacked"):  # save_pretrained's per-expert keys, or the modules' stacked [E, ...] tensors
            from mla_compile.app.v4_toy import toy_v4_model
            from tests.model.test_v4_checkpoint import _write

            hf = toy_v4_model(22)
            hf.save_pretrained(str(root if kind == "float" else root.parent / "src"), max_shard_size="20KB")
            if kind == "stacked":
                _write(root, {k: v.clone() for k, v in hf.state_dict().items()}, root.parent / "src")
        else:
            _quantized_checkpoint(root, kind, **overrides)
    dist.barrier()
    ref = from_pretrained(root, dtype=torch.float32)
    steps = _v4_steps(0 if attn_tp else rank, ref.config.vocab_size)
    want = _v4_run(ref, ref, steps)
    with _safetensors_reads() as reads:
        model = from_pretrained(root, dtype=torch.float32, parallel=state)
    got = _v4_run(model, model, steps)
    local = model.moe[-1].hf.experts
    picked = {int(m[1]) for key, _ in reads for m in [re.search(r"\.experts\.(\d+)\.", key)] if m}
    stacked = [how for key, how in reads if re.search(r"\.experts\.(gate_up_proj|down_proj)$", key)]
    return {"err": _max_err(got, want), "finite": all(bool(torch.isfinite(g).all()) for g in got),
            "local_type": type(local).__name__, "local_experts": local.num_experts,
            "experts": ref.config.n_routed_experts, "first": model.moe[-1].first, "experts_read": sorted(picked),
            "stacked_reads": stacked,
            "quantized": isinstance(local, {"fp4": FP4Experts, "fp8": FP8Experts}.get(kind, torch.nn.Module)),
            "attn_types": sorted({type(getattr(model.attn[0].hf, p)).__name__ for p in ("q_b_proj", "o_a_proj",
                                                                                     "o_b_proj")}),
            "heads": model.attn[0].num_heads, "all_heads": ref.attn[0].num_heads}


@contextlib.contextmanager
def _safetensors_reads():
    """Record ``(key, "tensor" | "slice")`` for every tensor (or part of one) read through ``safetensors.safe_open``
    inside."""
    import safetensors

    reads, real = [], safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            reads.append((key, "tensor"))
            return self.f.get_tensor(key)

        def get_slice(self, key):  # a read when indexed (its header alone, get_dtype / get_shape, reads no data)
            part = self.f.get_slice(key)

            class Slice:
                def __getattr__(self, name):
                    return getattr(part, name)

                def __getitem__(self, index):
                    reads.append((key, "slice"))
                    return part[index]

            return Slice()

    safetensors.safe_open = Spy
    try:
        yield reads
    finally:
        safetensors.safe_open = real


def v4_dp_ep_on_device(rank, world, attn_tp=False):
    """DeepSeek-V4 sharded (DP attention + EP; ``attn_tp``: the heads split over the ranks instead) over NCCL, one GPU
    per rank (world size 1: real single-rank process groups): each rank's logits equal the unsharded model's on its
    requests eagerly (float32), and the model compiled by Inductor and its decode step captured in a CUDA graph and
    replayed give them again."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from mla_compile.app.v4_toy import toy_v4_model
    from mla_compile.models.v4_model import V4Sequences
    from tests.cuda_capture import capture

    state = init(ParallelConfig(tp=world, dp_attention=1 if attn_tp else world, ep=world),
                 single_rank_collectives=world == 1, timeout=120)
    dev = state.device
    hf = toy_v4_model(5).to(dev)
    ref = patch(copy.deepcopy(hf))
    steps = _v4_steps(0 if attn_tp else rank, hf.config.vocab_size)
    want = _v4_run(ref, ref, steps)
    model = patch(hf, parallel=state)
    res = {"backend": dist.get_backend(), "real_group": model.moe[0].ep.group is not None,
           "eager_err": _max_err(_v4_run(model, model, steps), want)}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    res["compiled_err"] = _max_err(_v4_run(model, compiled, steps), want)
    res["graph_breaks"] = dict(counters["graph_break"])
    # the last decode step captured and replayed: its cache writes repeat the same rows, so the logits repeat
    seqs = V4Sequences(model, 2, 40, 4, fill=float("nan"))
    with torch.no_grad():
        for chunks in steps[:-1]:
            seqs.step(compiled, [0, 1], chunks)
        ids, pos, meta = seqs.metadata([0, 1], steps[-1])
        ids, pos, meta = ids.to(dev), pos.to(dev), meta.to(dev)
        eager_last = compiled(ids, pos, meta).clone()
        graph, out = capture(compiled, ids, pos, meta)
        graph.replay()
        torch.cuda.synchronize()
    res["replay_err"] = float((out - want[-1]).abs().max())
    res["eager_last_err"] = float((eager_last - want[-1]).abs().max())
    return res
