"""Per-rank bodies of the data-parallel attention serving tests (run by ``tests.dist_helpers.run_ranks``).

Each returns plain Python data for the parent test to assert on.
"""

from __future__ import annotations

import copy

import torch

from mla_compile.app import toy
from mla_compile.models.model import patch
from mla_compile.parallel import ParallelConfig, init

BS = 4
NUM_BLOCKS = 64


def group_trace(group: int) -> list[tuple[int, list[int], object]]:
    """Attention group ``group``'s seeded requests ``(arrival step, prompt, max_new_tokens or SamplingParams)``:
    other counts, lengths and arrivals per group; group 1 stays idle for the first steps, group 0 has prompts
    longer than the step budget (chunked prefill); every third request samples (seeded, temperature, top-k)."""
    from mla_compile.serving.sampling import SamplingParams

    gen = torch.Generator().manual_seed(100 + group)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    n, first, gap, max_prompt = [(6, 0, 3, 19), (3, 7, 5, 11)][group % 2]
    trace, at = [], first
    for _ in range(n):
        prompt = torch.randint(0, 1024, (randint(2, max_prompt),), generator=gen).tolist()
        n = randint(2, 10)
        if len(trace) % 3 == 2:
            n = SamplingParams(temperature=0.9, top_k=8, seed=randint(0, 1 << 30), max_new_tokens=n)
        trace.append((at, prompt, n))
        at += randint(0, gap)
    return trace


def _engine(model, step_fn=None, captured=False, **kw):
    from mla_compile.graphs.cuda_graph import DecodeGraphRunner
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.serving.engine import Engine

    device = next(model.parameters()).device
    model.allocate_cache(NUM_BLOCKS, BS, fill=float("nan"))
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=8, max_tokens=64, block_size=BS, device=device)
    runner = DecodeGraphRunner(model if step_fn is None else step_fn, builder, capture_sizes=[2, 4], enabled=captured)
    return Engine(runner, num_blocks=NUM_BLOCKS, max_tokens_per_step=12, **kw)


def alone(model, prompt: list[int], max_new: int) -> list[int]:
    """The greedy tokens of one request served alone by the single-process model (uncaptured)."""
    eng = _engine(model)
    eng.add_request(prompt, max_new)
    return eng.run()[0].output


def dp_engine_equals_alone(rank, world, pconf, overlap, cuda=False):
    """One Engine per attention group (``dp_sync``), each on its own trace; every request's tokens must equal
    those of the unsharded model serving it alone. Also what each rank ran: steps, model calls (CPU), padding-only
    and padded mixed steps. ``cuda``: NCCL, one GPU per rank, the sharded model compiled and its decode steps
    replayed in CUDA graphs (float32)."""
    from mla_compile.serving.dp_sync import DPStepSync

    state = init(ParallelConfig(**pconf), timeout=120 if cuda else 60, device=None if cuda else "cpu")
    group = rank // state.config.attn_tp
    hf = toy.toy_hf_model("v3", seed=2, num_hidden_layers=2, device=state.device, dtype=torch.float32)
    backend = "triton" if cuda else None  # one decode backend for the captured and the uncaptured model
    ref = patch(copy.deepcopy(hf), backend=backend)
    trace = group_trace(group)
    want = [alone(ref, p, n) for _, p, n in trace]

    model = patch(hf, parallel=state, backend=backend)
    calls = []
    if not cuda:  # replayed graphs run no Python: count model calls on CPU only
        model.register_forward_pre_hook(lambda m, args: calls.append(int(args[0].shape[0])))
    sync = DPStepSync()
    step_fn = torch.compile(model, fullgraph=True) if cuda else None
    eng = _engine(model, step_fn, captured=cuda, overlap=overlap, dp_sync=sync)
    padding, mixed_padded = [], []
    build = eng.runner.builder.build

    def counted(decode, prefill=(), **kw):  # what each step planned: padding-only, or decode padded with tokens
        if not decode and not prefill:
            padding.append(len(calls))
        elif kw.get("tokens") is not None and not prefill:
            mixed_padded.append(len(calls))  # decode rows only, padded with an empty prefill part
        return build(decode, prefill, **kw)

    eng.runner.builder.build = counted
    pending, ids, steps = list(trace), [], 0
    while True:
        while pending and pending[0][0] <= steps:
            _, prompt, n = pending.pop(0)
            ids.append(eng.add_request(prompt, n))
        eng.step()
        steps += 1
        if not eng.dp_active and not sync.any(bool(pending)):
            break
        assert steps < 400, "the engines did not finish"
    # run() on an engine with nothing anywhere returns at once (one agreement, no model call)
    before = len(calls)
    eng.run()
    got = [eng.requests[i].output for i in ids]
    return {"group": group, "same": got == want, "got": got, "want": want, "steps": steps, "calls": calls,
            "padding": padding, "mixed_padded": mixed_padded, "after_run": len(calls) - before,
            "agreements": sync.steps, "finished": len(eng.finished), "requests": len(trace),
            "replays": eng.runner.replays}


def sync_agreements(rank, world, demands):
    """``DPStepSync.agree`` of this rank's ``demands`` (one per step), ``any`` and ``check_same``."""
    import torch.distributed as dist

    from mla_compile.serving.dp_sync import DPStepSync, StepDemand

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=30))
    sync = DPStepSync()
    out = [sync.agree(StepDemand(*d)) for d in demands[rank]]
    anys = [sync.any(rank == 1), sync.any(False)]
    sync.check_same("sizes", [4, 64])
    try:
        sync.check_same("sizes", [4, 64 + rank])
        mismatch = None
    except ValueError as exc:
        mismatch = str(exc)
    return {"agreements": out, "any": anys, "mismatch": mismatch}
