"""A seeded serving load for engine tests: requests arrive while others run and finish, so batch sizes,
lengths and block tables change from step to step."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mla_compile.serving.admission import RequestRejected
from mla_compile.serving.engine import StepFailed
from mla_compile.serving.sampling import SamplingParams


def run_workload(engine, seed: int, n_requests: int = 12, gap: int = 8, max_new: int = 60, max_prompt: int = 20):
    """Drive ``engine`` through ``n_requests`` seeded requests (arrival gaps < ``gap`` steps, prompts of
    1..``max_prompt - 1`` tokens, 1..``max_new - 1`` new tokens); returns (outputs by request id, steps)."""
    gen = torch.Generator().manual_seed(seed)
    at, pending = 0, []
    for _ in range(n_requests):
        at += int(torch.randint(0, gap, (1,), generator=gen))
        prompt = torch.randint(0, 1024, (int(torch.randint(1, max_prompt, (1,), generator=gen)),), generator=gen).tolist()
        pending.append((at, prompt, int(torch.randint(1, max_new, (1,), generator=gen))))
    steps = 0
    while pending or engine.waiting or engine.running:
        while pending and pending[0][0] <= steps:
            _, prompt, n = pending.pop(0)
            engine.add_request(prompt, n)
        if pending and not (engine.waiting or engine.running):
            pending[0] = (steps, *pending[0][1:])
            continue
        engine.step(keep_logits=True)
        steps += 1
    return [r.output for r in sorted(engine.finished, key=lambda r: r.id)], steps


# ------------------------------------------------- a faulty trace: aborts, bad requests, a failing step

# a toy V3 small enough for thousands of CPU steps a second (float64: tokens never flip on rounding)
TINY_V3 = dict(vocab_size=97, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
               n_group=2, topk_group=1, first_k_dense_replace=0, max_position_embeddings=64,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                    mscale_all_dim=1.0, original_max_position_embeddings=16, beta_fast=32,
                                    beta_slow=1))


@dataclass
class TraceRequest:
    """One client of a trace: arrives at step ``at``; ``abort_at``: the step its client aborts it (or None)."""

    at: int
    prompt: Any
    max_new_tokens: Any
    valid: bool
    abort_at: int | None = None


def _invalid(kind: int, prompt: list[int], n: int, vocab_size: int, max_total: int, pos: int) -> tuple[Any, Any]:
    """The ``kind``-th way a client gets a request wrong (prompt position ``pos`` where it is a token)."""
    bad = list(prompt)
    if kind == 0:
        bad[pos] = vocab_size  # one past the vocabulary: a device-side assert in a GPU embedding
    elif kind == 1:
        bad[pos] = -1
    elif kind == 2:
        bad[pos] = 1.5
    elif kind == 3:
        bad[pos] = True
    elif kind == 4:
        return [], n
    elif kind == 5:
        return prompt, 0
    elif kind == 6:
        return prompt, float(n)
    else:
        return prompt + [1] * max_total, n  # longer than the model's positions / the block table
    return bad, n


def make_trace(seed: int, n_requests: int, *, vocab_size: int, max_total: int, gap: int = 3, max_prompt: int = 16,
               max_new: int = 12, n_prefixes: int = 6, block_size: int = 4, abort_rate: float = 0.1,
               invalid_rate: float = 0.05) -> list[TraceRequest]:
    """Seeded clients arriving over time (arrival gaps < ``gap`` steps). Most prompts start with one of
    ``n_prefixes`` shared prefixes (1-3 blocks), then 1..``max_prompt - 1`` own tokens;
    1..``max_new - 1`` new tokens. ``abort_rate`` of the clients abort 0-11 steps after arriving;
    ``invalid_rate`` send a bad request (bad token id, type, length or max_new_tokens, see ``_invalid``).
    Some valid prompts are numpy ints or arrays. ``max_total``: the most tokens a request may hold."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    prefixes = [torch.randint(0, vocab_size, (block_size * randint(1, 4),), generator=gen).tolist()
                for _ in range(n_prefixes)]
    trace, at = [], 0
    for _ in range(n_requests):
        at += randint(0, gap)
        own = torch.randint(0, vocab_size, (randint(1, max_prompt),), generator=gen).tolist()
        prompt = (prefixes[randint(0, n_prefixes)] if randint(0, 10) < 7 else []) + own
        n = randint(1, max_new)
        req = TraceRequest(at, prompt, n, valid=len(prompt) + n <= max_total)
        assert req.valid, "make_trace: raise max_total or lower max_prompt / max_new"
        draw = float(torch.rand((), generator=gen))
        if draw < invalid_rate:
            req.prompt, req.max_new_tokens = _invalid(randint(0, 8), prompt, n, vocab_size, max_total,
                                                      randint(0, len(prompt)))
            req.valid = False
        elif draw < invalid_rate + abort_rate:
            req.abort_at = at + randint(0, 12)
        if req.valid and randint(0, 10) == 0:
            req.prompt = np.asarray(prompt) if randint(0, 2) else [np.int64(t) for t in prompt]
        trace.append(req)
    return trace


def with_sampling(trace: list[TraceRequest], seed: int, vocab_size: int, stops: bool = False) -> list[TraceRequest]:
    """``trace`` with two thirds of its valid requests given :class:`SamplingParams` in place of their int
    ``max_new_tokens`` (temperature, top-k, top-p; most seeded, some left to the engine's seed) and, with
    ``stops``, two or three stop tokens each; the rest stay greedy. Changes ``trace`` in place; returns it."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=gen))

    settings = [dict(temperature=1.0), dict(temperature=0.8, top_k=6), dict(temperature=1.2, top_p=0.85), {}]
    for r in trace:
        if r.valid and randint(0, 3):
            stop = tuple(torch.randint(0, vocab_size, (randint(2, 4),), generator=gen).tolist()) if stops else ()
            request_seed = randint(0, 2**40) if randint(0, 4) else None  # None: the engine draws one
            r.max_new_tokens = SamplingParams(**settings[randint(0, 4)], seed=request_seed, stop_token_ids=stop,
                                              max_new_tokens=r.max_new_tokens)
    return trace


@dataclass
class TraceRun:
    """What :func:`run_trace` saw: request ids by trace index, rejections, output lengths at abort and
    the states aborts found, the :class:`StepFailed` errors, and the steps run."""

    ids: dict[int, int] = field(default_factory=dict)
    rejected: dict[int, RequestRejected] = field(default_factory=dict)
    aborted: dict[int, int] = field(default_factory=dict)
    abort_states: Counter = field(default_factory=Counter)  # aborted while "waiting", in "prefill", "decode"
    failures: list[StepFailed] = field(default_factory=list)
    steps: int = 0


def run_trace(engine, trace: list[TraceRequest]) -> TraceRun:
    """Drive ``engine`` through ``trace``: arrivals, then aborts, then one step, per step; a
    :class:`StepFailed` is recorded and serving goes on. Aborts due after the last step run at the end."""
    seen = TraceRun()
    arrivals = deque(range(len(trace)))
    aborts = deque(sorted((r.abort_at, i) for i, r in enumerate(trace) if r.abort_at is not None))

    def abort_due(until: float) -> None:
        while aborts and aborts[0][0] <= until:
            _, i = aborts.popleft()
            if i not in seen.ids:
                continue  # rejected at admission
            req = engine.requests[seen.ids[i]]
            state = "waiting" if req in engine.waiting else "prefill" if req.prefilling else "decode"
            req = engine.abort(req.id)
            assert req not in engine.running and req not in engine.waiting
            if req.finish_reason == "abort":
                seen.aborted[i] = len(req.output)
                seen.abort_states[state] += 1

    while arrivals or engine.waiting or engine.running:
        while arrivals and trace[arrivals[0]].at <= seen.steps:
            i = arrivals.popleft()
            try:
                seen.ids[i] = engine.add_request(trace[i].prompt, trace[i].max_new_tokens)
            except RequestRejected as exc:
                seen.rejected[i] = exc
        abort_due(seen.steps)
        if not (engine.waiting or engine.running):
            if arrivals:
                seen.steps = trace[arrivals[0]].at  # idle until the next arrival
            continue
        try:
            engine.step()
        except StepFailed as exc:
            seen.failures.append(exc)
        seen.steps += 1
    abort_due(float("inf"))
    return seen


class FailingRunner:
    """A runner that raises ``RuntimeError("injected ...")`` once: on the first call from call number
    ``fail_from`` on (0-based) whose step has exactly the parts in ``parts`` ("decode", "prefill"; a
    pure decode step is the one a graph runner replays). It raises after the wrapped runner ran the
    step, so the cache slots are written, as in a failure late in a step. Everything else is the
    wrapped runner's."""

    def __init__(self, runner, fail_from: int, parts: tuple[str, ...] = ("decode", "prefill")) -> None:
        self.runner, self.fail_from, self.parts = runner, fail_from, set(parts)
        self.calls, self.failed_at = 0, None

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _after(self, decode, prefill) -> None:
        self.calls += 1
        parts = {name for name, chunks in (("decode", decode), ("prefill", prefill)) if chunks}
        if self.failed_at is None and self.calls > self.fail_from and parts == self.parts:
            self.failed_at = self.calls - 1
            raise RuntimeError(f"injected failure in runner call {self.failed_at}")

    def run(self, decode, prefill=()):
        logits = self.runner.run(decode, prefill)
        self._after(decode, prefill)
        return logits

    def decode(self, chunks):
        logits = self.runner.decode(chunks)
        self._after(chunks, ())
        return logits

    def decode_sampled(self, chunks, params, steps):
        out = self.runner.decode_sampled(chunks, params, steps)
        self._after(chunks, ())
        return out

    def sample_step(self, decode, prefill, params, steps, feed):
        out = self.runner.sample_step(decode, prefill, params, steps, feed)
        self._after(decode, prefill)
        return out


def alone_outputs(engine, trace: list[TraceRequest]) -> dict[int, list[int]]:
    """The tokens each valid request of ``trace`` gets alone: run one at a time through ``engine`` (built
    without prefix caching), by trace index. Equal prompts run once, for the most new tokens asked."""
    longest: dict[tuple, int] = {}
    for r in trace:
        if r.valid:
            key = tuple(int(t) for t in r.prompt)
            longest[key] = max(longest.get(key, 0), r.max_new_tokens)
    tokens = {}
    for prompt, n in longest.items():
        rid = engine.add_request(list(prompt), n)
        engine.run()
        tokens[prompt] = engine.requests[rid].output
    return {i: tokens[tuple(int(t) for t in r.prompt)][:r.max_new_tokens] for i, r in enumerate(trace) if r.valid}


def check_trace(engine, trace: list[TraceRequest], seen: TraceRun,
                alone: dict[int, list[int]] | None = None) -> dict:
    """Assert the trace's rules on a drained ``engine``; returns counts for a report. Valid requests are
    admitted and invalid ones rejected; a request of a failed step is finished with "error"; an aborted
    one stopped at once; every other valid one finished with "length". Outputs are prefixes of (for
    "length": equal to) the ``alone`` tokens when given. Every block is free again, none is referenced."""
    assert not engine.waiting and not engine.running
    assert set(seen.rejected) == {i for i, r in enumerate(trace) if not r.valid}
    assert all(e.request_id == i for i, e in seen.rejected.items())  # ids follow the order of calls
    failed = {rid for exc in seen.failures for rid in exc.request_ids}
    counts = dict(requests=len(trace), steps=seen.steps, rejected=len(seen.rejected), aborted=0, failed=0,
                  finished=0, tokens=0)
    for i, rid in seen.ids.items():
        req = engine.requests[rid]
        if rid in failed:
            assert req.finish_reason == "error"
        elif i in seen.aborted:
            assert req.finish_reason == "abort" and len(req.output) == seen.aborted[i]  # nothing after the abort
        else:
            assert req.finish_reason == "length" and len(req.output) == req.max_new_tokens
        counts[{"error": "failed", "abort": "aborted", "length": "finished"}[req.finish_reason]] += 1
        counts["tokens"] += len(req.output)
        if alone is not None:
            want = alone[i]
            why = f"request {rid} ({req.finish_reason}): {req.output}, alone {want}"
            assert req.output == want[:len(req.output)], why
    assert len(engine.finished) == len(seen.ids) == len(engine.requests)
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    assert all(b.ref == 0 for b in engine.blocks.blocks)
    assert all(engine.blocks.blocks[bid].key[0] == h for h, bid in engine.blocks.cached.items())
    return counts
