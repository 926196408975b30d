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
    ids, steps = _serve_in_lockstep(eng, sync, trace, 400)
    # run() on an engine with nothing anywhere returns at once (one agreement, no model call)
    before = len(calls)
    eng.run()
    got = [eng.requests[i].output for i in ids]
    return {"group": group, "same": got == want, "got": got, "want": want, "steps": steps, "calls": calls,
            "padding": padding, "mixed_padded": mixed_padded, "after_run": len(calls) - before,
            "agreements": sync.steps, "finished": len(eng.finished), "requests": len(trace),
            "replays": eng.runner.replays}


def _serve_in_lockstep(eng, sync, trace, max_steps: int) -> tuple[list[int], int]:
    """Step ``eng`` (a ``dp_sync`` engine), adding ``trace``'s ``(arrival step, prompt, max_new_tokens or
    SamplingParams)`` requests as they arrive, until no group has work; returns (request ids, steps)."""
    pending, ids, steps = list(trace), [], 0
    while True:
        while pending and pending[0][0] <= steps:
            _, prompt, params = pending.pop(0)
            ids.append(eng.add_request(prompt, params))
        eng.step()
        steps += 1
        if not eng.dp_active and not sync.any(bool(pending)):
            return ids, steps
        assert steps < max_steps, "the engines did not finish"


def sync_agreements(rank, world, demands):
    """``DPStepSync.agree`` of this rank's ``demands`` (one per step), ``any`` and ``check_same``."""
    import torch.distributed as dist

    from mla_compile.serving.dp_sync import DPStepFatal, DPStepSync, StepDemand

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=30))
    sync = DPStepSync(timeout=30)
    out = [sync.agree(StepDemand(*d)) for d in demands[rank]]
    anys = [sync.any(rank == 1), sync.any(False)]
    sync.check_same("sizes", [4, 64])
    try:
        sync.check_same("sizes", [4, 64 + rank])
        mismatch = None
    except ValueError as exc:
        mismatch = str(exc)
    stopped = None
    if rank == 0:  # rank 1 stops stepping (returns, so its connections close): rank 0's next agreement fails
        try:
            sync.agree(StepDemand(True, 1, False, 1, 1))
        except DPStepFatal as exc:
            stopped = str(exc)
    return {"agreements": out, "any": anys, "mismatch": mismatch, "stopped": stopped}


# ------------------------------------------------------------------ a step failing on one rank (dp_sync)

class RaiseBeforeModel:
    """A runner that raises ``RuntimeError("injected ...")`` on its calls number ``fail_at`` (0-based, counting
    only calls with some decode or prefill chunk: padding-only steps do not count) before calling the wrapped
    runner, so before its model. Everything else is the wrapped runner's (``model_calls`` included)."""

    def __init__(self, runner, fail_at: set[int]) -> None:
        self.runner, self.fail_at, self.calls = runner, set(fail_at), 0

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _check(self, decode, prefill) -> None:
        if len(decode) or len(prefill):
            self.calls += 1
            if self.calls - 1 in self.fail_at:
                raise RuntimeError(f"injected failure before the model in runner call {self.calls - 1}")

    def run(self, decode, prefill=(), shape=None):
        self._check(decode, prefill)
        return self.runner.run(decode, prefill, shape=shape)

    def decode(self, chunks, shape=None):
        self._check(chunks, ())
        return self.runner.decode(chunks, shape=shape)

    def decode_sampled(self, chunks, params, steps, shape=None):
        self._check(chunks, ())
        return self.runner.decode_sampled(chunks, params, steps, shape=shape)

    def sample_step(self, decode, prefill, params, steps, feed, shape=None):
        self._check(decode, prefill)
        return self.runner.sample_step(decode, prefill, params, steps, feed, shape=shape)


def failing_build(builder, fail_at: int):
    """Make ``builder.build`` raise ``ValueError("injected ...")`` on its build number ``fail_at`` with some chunk
    (0-based; padding-only builds do not count): a builder error inside the runner, before its model."""
    build, seen = builder.build, [0]

    def build_or_fail(decode, prefill=(), **kw):
        if len(decode) or len(prefill):
            seen[0] += 1
            if seen[0] - 1 == fail_at:
                raise ValueError(f"injected builder failure in build {fail_at}")
        return build(decode, prefill, **kw)

    builder.build = build_or_fail


def _drive(eng, trace, sync=None, max_steps: int = 400):
    """Serve ``trace`` (arrivals by step) through ``eng``, catching ``StepFailed``; with ``sync`` (dp) until no rank
    has anything left. Returns the request ids in trace order and the ids of each ``StepFailed``."""
    from mla_compile.serving.engine import StepFailed

    pending, ids, failures, steps = list(trace), [], [], 0
    while True:
        while pending and pending[0][0] <= steps:
            _, prompt, n = pending.pop(0)
            ids.append(eng.add_request(prompt, n))
        try:
            eng.step()
        except StepFailed as exc:
            failures.append(exc.request_ids)
        steps += 1
        if sync is not None:
            if not eng.dp_active and not sync.any(bool(pending)):
                return ids, failures
        elif not pending and not (eng.waiting or eng.running or eng._inflight is not None):
            return ids, failures
        assert steps < max_steps, "the engine did not finish"


def _failing_engine(model, rank_fails: bool, overlap: bool, **kw):
    """An engine whose runner raises before its model at two steps (a runner call and a builder error) when
    ``rank_fails``."""
    eng = _engine(model, overlap=overlap, **kw)
    if rank_fails:
        eng.runner = RaiseBeforeModel(eng.runner, {1})  # a mixed step of requests 0 and 1
        failing_build(eng.runner.builder, 6)  # a later step of requests 2 and 4 (3 and 5 finish)
    return eng


def dp_fail_before_model(rank, world, pconf, overlap):
    """Rank 0's steps fail twice before its model (a runner raising before calling it; a builder error) under
    ``dp_sync``. Returns per request ``(output, finish_reason)`` of the dp engine, of a single-process engine on the
    unsharded model failing the same way (rank 0) and of each request served alone, and the failures."""
    from mla_compile.serving.dp_sync import DPStepSync

    state = init(ParallelConfig(**pconf), timeout=60, device="cpu")
    group = rank // state.config.attn_tp
    hf = toy.toy_hf_model("v3", seed=2, num_hidden_layers=2, dtype=torch.float32)
    ref = patch(copy.deepcopy(hf))
    trace = group_trace(group)
    want = [alone(ref, p, n) for _, p, n in trace]
    fails = rank == 0
    single = _failing_engine(ref, fails, overlap)  # the same trace and failures without dp_sync
    single_ids, single_failures = _drive(single, trace)
    single_out = [(single.requests[i].output, single.requests[i].finish_reason) for i in single_ids]

    model = patch(hf, parallel=state)
    sync = DPStepSync()
    eng = _failing_engine(model, fails, overlap, dp_sync=sync)
    calls_before = eng.runner.model_calls
    ids, failures = _drive(eng, trace, sync)
    eng.run()  # nothing anywhere: returns at once
    got = [(eng.requests[i].output, eng.requests[i].finish_reason) for i in ids]
    return {"group": group, "got": got, "single": single_out, "want": want, "failures": failures,
            "single_failures": single_failures, "agreements": sync.steps,
            "model_calls": eng.runner.model_calls - calls_before, "finished": len(eng.finished),
            "all_free": eng.blocks.num_free == len(eng.blocks.blocks)}


def dp_fail_inside_model(rank, world, pconf, overlap, timeout_s, linger_s=0.0):
    """Rank 0's model raises inside its third step (at layer 1's input norm, after layer 0's collectives) under
    ``dp_sync``, with every process group's timeout ``timeout_s``; rank 0 then keeps its process (and connections)
    ``linger_s`` seconds before it returns, so rank 1 meets the timeout rather than a closed connection. Returns what
    each rank raised (``DPStepFatal`` expected on both), its requests' finish reasons, and what a later ``step()``
    raises."""
    import time

    from mla_compile.serving.dp_sync import DPStepFatal, DPStepSync

    state = init(ParallelConfig(**pconf), timeout=timeout_s, device="cpu")
    group = rank // state.config.attn_tp
    model = patch(toy.toy_hf_model("v3", seed=2, num_hidden_layers=2, dtype=torch.float32), parallel=state)
    seen = [0]

    def fail_third(module, args):
        seen[0] += 1
        if seen[0] == 3:
            raise RuntimeError("injected failure inside the model (layer 1)")

    if rank == 0:
        model.model.layers[1].input_layernorm.register_forward_pre_hook(fail_third)
    sync = DPStepSync()  # init's timeout
    eng = _engine(model, overlap=overlap, dp_sync=sync)
    trace = [(0, p, n) for _, p, n in group_trace(group)]
    out = {"group": group, "error": None, "message": None, "later": None}
    try:
        _drive(eng, trace, sync, max_steps=50)
    except DPStepFatal as exc:
        out["error"], out["message"], out["ids"] = type(exc).__name__, str(exc), exc.request_ids
    try:
        eng.step()
    except DPStepFatal as exc:
        out["later"] = str(exc)
    out["reasons"] = sorted({r.finish_reason for r in eng.requests.values()}, key=str)
    out["unfinished"] = len(eng.waiting) + len(eng.running)
    out["all_free"] = eng.blocks.num_free == len(eng.blocks.blocks)
    if rank == 0:
        time.sleep(linger_s)
    return out


def dp_v4_engine_equals_alone(rank, world, overlap, dp=None):
    """DeepSeek-V4 (the toy, float64) sharded as DP attention + EP over gloo (``dp`` attention groups, default one a
    rank; fewer: each group's ranks split its heads and run the same engine): one Engine per rank with ``dp_sync``,
    each group on its own trace of requests (greedy and seeded sampling, prompts longer than a step's budget, one group
    idle at first): every request's tokens equal those of the unsharded model serving it alone; the ranks' model calls
    match one for one (the MoE's all-gather needs the same token count everywhere)."""
    import random

    from mla_compile.app.v4_toy import toy_v4_model
    from mla_compile.serving.dp_sync import DPStepSync
    from mla_compile.serving.sampling import SamplingParams
    from tests.model.test_v4_engine import alone as v4_alone
    from tests.model.test_v4_engine import v4_engine
    from tests.model.test_v4_model import prompts

    dp = dp or world
    state = init(ParallelConfig(tp=world, dp_attention=dp, ep=world), timeout=60, device="cpu")
    group = rank // (world // dp)
    hf = toy_v4_model(31).double()
    ref = patch(copy.deepcopy(hf))
    rng = random.Random(200 + group)
    n, first = [(5, 0), (3, 6)][group % 2]
    lens = [rng.randint(2, 26 if group % 2 == 0 else 9) for _ in range(n)]
    trace, at = [], first
    for i, p in enumerate(prompts(300 + group, lens)):
        params = SamplingParams(max_new_tokens=rng.randint(2, 8),
                                **(dict(temperature=0.9, seed=rng.randrange(1 << 30)) if i % 3 == 2 else {}))
        trace.append((at, p, params))
        at += rng.randint(0, 3)
    want = [v4_alone(ref, p, params) for _, p, params in trace]

    model = patch(hf, parallel=state)
    calls = []
    model.register_forward_pre_hook(lambda m, args: calls.append(int(args[0].shape[0])))
    sync = DPStepSync()
    eng = v4_engine(model, num_blocks=60, num_entry=30, max_seqs=4, overlap=overlap, dp_sync=sync)
    ids, steps = _serve_in_lockstep(eng, sync, trace, 300)
    got = [eng.requests[i].output for i in ids]
    return {"group": group, "same": got == want, "got": got, "want": want, "steps": steps, "calls": calls,
            "finished": len(eng.finished), "requests": len(trace), "local_experts": model.moe[0].hf.experts.num_experts}
