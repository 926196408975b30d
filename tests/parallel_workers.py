"""Per-rank bodies of the parallel tests (run by ``tests.dist_helpers.run_ranks`` in spawned processes).

Each returns plain Python data (max errors, shapes, op names) for the parent test to assert on.
"""

from __future__ import annotations

import copy
import os
import time

import torch

from mla_compile import toy
from mla_compile.metadata import SeqChunk, plan_step
from mla_compile.model import patch
from mla_compile.parallel import ParallelConfig, init

BS = 4
NUM_BLOCKS = 48


def _blocks(lens, seed):
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in lens:
        need = -(-n // BS)
        out.append(perm[at:at + need])
        at += need
    return out


def _steps(vocab: int, seed: int):
    """A fixed step script: prefill of a cached prefix, chunked prefill over it mixed with a fresh prompt,
    then decode steps with fixed tokens. Returns ``plan_step`` inputs (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 6, 9)]
    dec_tokens = torch.randint(0, vocab, (3, 3), generator=gen).tolist()
    lens = [len(p) + 3 for p in full]
    blocks = _blocks(lens, seed)
    steps = [
        # prefill: prompt 0's first 8 tokens (a cached prefix next step) and prompt 2 whole
        plan_step([], [SeqChunk(blocks[0], full[0][:8]), SeqChunk(blocks[2], full[2])], BS, logits="all"),
        # chunked prefill over the cached prefix, with a new prompt and one decode (prompt 2)
        plan_step([SeqChunk(blocks[2], [dec_tokens[2][0]], len(full[2]))],
                  [SeqChunk(blocks[0], full[0][8:], 8), SeqChunk(blocks[1], full[1])], BS, logits="all"),
    ]
    for j in range(2):  # decode all three
        pos = [len(full[0]) + j, len(full[1]) + j, len(full[2]) + 1 + j]
        steps.append(plan_step([SeqChunk(b, [t[j]], s) for b, t, s in zip(blocks, dec_tokens, pos)], [], BS))
    return steps


def _run(model, steps):
    model_fn, model_obj = model if isinstance(model, tuple) else (model, model)
    model_obj.allocate_cache(NUM_BLOCKS, BS, fill=float("nan"))
    outs = []
    with torch.no_grad():
        for s in steps:
            outs.append(model_fn(s.input_ids, s.positions, s.meta)[:s.num_rows].clone())
    return outs


def _max_err(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def sharded_equals_single(rank, world, kind, pconf, dispatch, compile_too):
    """Logits of the sharded model vs the single-process patched model over the step script; shard sizes;
    with ``compile_too`` also the fullgraph-compiled sharded model, its graph breaks and its collectives."""
    state = init(ParallelConfig(**pconf), timeout=60)
    hf = toy.toy_hf_model(kind, seed=7)
    ref = patch(copy.deepcopy(hf))
    steps = _steps(hf.config.vocab_size, seed=11)
    want = _run(ref, steps)
    full_params = sum(p.numel() for p in ref.parameters())
    model = patch(hf, parallel=state, ep_dispatch=dispatch)
    got = _run(model, steps)
    res = {"err": _max_err(got, want), "finite": all(bool(torch.isfinite(g).all()) for g in got),
           "params": sum(p.numel() for p in model.parameters()), "full_params": full_params,
           "kv_b": list(model.attentions[0].kv_b_proj.weight.shape),
           "o_proj": list(model.attentions[0].o_proj.weight.shape)}
    moe = model.model.layers[-1].mlp
    res["experts"] = list(moe.experts.gate_up_proj.shape)
    if compile_too:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        seen: set[str] = set()

        def record(gm, example_inputs):
            from torch._functorch.aot_autograd import aot_module_simplified

            def fw(g, _):
                seen.update(str(n.target) for n in g.graph.nodes if n.op == "call_function")
                return g.forward
            return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

        compiled = torch.compile(model, fullgraph=True, backend=record)
        got_c = _run((compiled, model), steps)
        res["compiled_err"] = _max_err(got_c, want)
        res["graph_breaks"] = dict(counters["graph_break"])
        res["collectives"] = sorted(t for t in seen if "c10d" in t)
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


def dead_peer(rank, world, timeout_s):
    """Rank 1 exits after init; rank 0's next collective must raise (seconds it took, error text)."""
    import torch.distributed as dist

    state = init(ParallelConfig(tp=world), timeout=timeout_s)
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 1:
        os._exit(0)
    t0 = time.monotonic()
    try:
        for _ in range(3):
            float(torch.distributed._functional_collectives.all_reduce(x, "sum", state.tp.group).sum())
    except Exception as e:  # noqa: BLE001
        return {"seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"[:300]}
    return None
