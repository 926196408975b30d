"""Inductor lowering of ``mla::prefill_autotune``: Inductor times every prefill implementation that can
serve the compiled shapes and emits the fastest. Same mechanism as :mod:`mla_compile.lowerings.decode`
(private Inductor API, torch 2.11-2.13): one ``ExternKernelChoice`` per candidate timed on ``out``
alone, then the winner's ``(out, lse)`` op emitted as a fallback kernel; the timing node is dead code.

Candidates: our Triton kernel in a few launch configurations (``mla::prefill_triton_config``) and the
peer backends :func:`mla_compile.backends.select_backend` says serve the shapes without a plan
(flash-attn, FlashInfer trtllm-gen on sm100). Left out:

- FlashInfer (``"flashinfer"``): needs a host-side plan per step made from the real lengths; a compiled
  graph cannot make one, and a plan made for the benchmark inputs would not fit the real step.
- SDPA cuDNN (``"sdpa-cudnn"``): loops over sequences on the host and reads ``cu_seqlens`` there (a
  device-to-host sync per call); its timing depends on the benchmark lengths, not the real ones, and
  emitting it would put a host sync into the compiled graph. Ask for it by name instead.

On CPU, or when the private API is unusable (a warning says why), the lowering emits a plain fallback
call of ``mla::prefill_autotune`` (its eager kernel: the static default backend). Every autotuned
lowering is recorded in :mod:`mla_compile.ops._compile_log`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Callable, Iterator

import torch

from mla_compile.lowerings.decode import Candidate, _hints
from mla_compile.ops import _compile_log
from mla_compile.ops.decode_autotune import mark_lowered
from mla_compile.ops.triton import available as triton_available

log = logging.getLogger(__name__)
OP_NAME = "mla::prefill_autotune"
SELECT_NAME = "mla_prefill_autotune"
# Peer backends that run from shapes alone (no host plan, no host read of the lengths).
PEERS = ("flashinfer-trtllm", "flash-attn")
# (BLOCK_M, BLOCK_N, num_warps, num_stages); 0 keeps the heuristic's value (ops/triton/prefill.py:_pick).
# Every tile is at most the bf16 default's (128 x 64), so none needs more shared memory than it.
TRITON_CONFIGS: tuple[tuple[int, int, int, int], ...] = ((0, 0, 0, 0), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3))
_CPU_HOOK: list[Callable | None] = [None]  # tests: candidates on CPU (see autotune_on_cpu)
_WARNED: set[str] = set()
_CHOICES: dict[str, object] = {}


def prefill_candidates(device: torch.device, dtype: torch.dtype, num_heads: int, head_dims: tuple[int, int],
                       causal: bool) -> list[Candidate]:
    """Every plan-free implementation that can serve these static facts on ``device`` (CUDA).

    A :class:`~mla_compile.lowerings.decode.Candidate`'s ``op`` here takes
    ``(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, *extra)``."""
    from mla_compile.backends import select_backend

    out: list[Candidate] = []
    for name in PEERS:
        try:
            select_backend("prefill", device=device, dtype=dtype, num_heads=num_heads, head_dims=head_dims,
                           query_len=2, requested=name, need_lse=True)
        except ValueError:
            continue  # this backend cannot serve the shapes here (the selector says why in `doctor`)
        op = getattr(torch.ops.mla, "prefill_" + name.replace("-", "_")).default
        out.append(Candidate(f"mla_prefill_{name.replace('-', '_')}", name, op))
    if triton_available() and device.type == "cuda" and dtype != torch.float64:
        configs = TRITON_CONFIGS if torch.finfo(dtype).bits <= 16 else TRITON_CONFIGS[:1]
        for bm, bn, nw, ns in configs:
            out.append(Candidate(f"mla_prefill_triton_bm{bm}_bn{bn}_w{nw}_s{ns}", "triton",
                                 torch.ops.mla.prefill_triton_config.default, (bm, bn, nw, ns)))
    return out


@contextlib.contextmanager
def autotune_on_cpu(candidates: Callable[..., list[Candidate]]) -> Iterator[None]:
    """Tests: autotune CPU graphs too, over ``candidates(...)`` (same arguments as :func:`prefill_candidates`)."""
    _CPU_HOOK[0] = candidates
    try:
        yield
    finally:
        _CPU_HOOK[0] = None


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, stacklevel=2)


def _extern_choice(cand: Candidate):
    """The ``ExternKernelChoice`` of ``cand`` (one per name per process: Inductor registers it by name)."""
    from torch._inductor.select_algorithm import ExternKernelChoice

    choice = _CHOICES.get(cand.name)
    if choice is None:
        op, extra = cand.op, cand.extra

        def bench(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, causal):
            return op(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, *extra)[0]

        bench.__name__ = cand.name
        lookup = getattr(ExternKernelChoice, "lookup", None)
        choice = lookup(cand.name) if lookup is not None else None
        if choice is None:
            choice = ExternKernelChoice(bench, name=cand.name, has_out_variant=False)
        _CHOICES[cand.name] = choice
    return choice


class _Timings:
    """A feedback saver keeping the last timings Inductor measured for our select name."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def __call__(self, timings, name, *rest) -> None:
        if name == SELECT_NAME:
            self.last = {getattr(c, "name", str(c)): float(t) for c, t in timings.items()}


_SAVER = _Timings()


def _install_saver() -> None:
    from torch._inductor import select_algorithm as sa

    get = getattr(sa, "get_algorithm_selector_cache", None)
    cache = get() if get is not None else getattr(sa, "_ALGORITHM_SELECTOR_CACHE", None)
    fns = getattr(cache, "feedback_saver_fns", None)
    if fns is not None and _SAVER not in fns:
        cache.add_feedback_saver(_SAVER)


def _input_gens(q, k, cu_seqlens_q, causal: bool) -> dict[int, Callable]:
    """Benchmark inputs: random q/k/v and the rows split evenly over the sequences (causal: at least as
    many keys as queries per sequence); the real lengths are unknown at compile time."""
    T = _hints(q)[0]
    S = _hints(k)[0]
    n = _hints(cu_seqlens_q)[0] - 1
    len_q = T // n if n > 0 else 0
    len_k = S // n if n > 0 else 0
    if causal:
        len_q = min(len_q, len_k)
    dev = q.get_device()

    def gen_float(node):
        return torch.randn(_hints(node), device=dev).to(node.get_dtype())

    def gen_cu(step):
        return lambda node: (torch.arange(n + 1, device=dev) * step).to(node.get_dtype())

    return {0: gen_float, 1: gen_float, 2: gen_float, 3: gen_cu(len_q), 4: gen_cu(len_k)}


def _winner_name(result, candidates: list[Candidate]) -> str:
    """The winning choice's name from ``autotune_select_algorithm``'s result (a pair on 2.12+, a node on 2.11)."""
    if isinstance(result, tuple) and len(result) == 2 and getattr(result[1], "name", None):
        return result[1].name
    node = result[0] if isinstance(result, tuple) else result
    text = repr(node)
    for c in sorted(candidates, key=lambda c: -len(c.name)):
        if re.search(rf"\b{re.escape(c.name)}\b", text):
            return c.name
    if _SAVER.last:
        return min(_SAVER.last, key=_SAVER.last.__getitem__)
    return candidates[0].name


def _autotuned(args: tuple, candidates: list[Candidate]):
    from torch._inductor import ir
    from torch._inductor.lowering import fallback_handler
    from torch._inductor.select_algorithm import autotune_select_algorithm

    q, k, v, cu_q, cu_k, scale, causal = args
    nodes = [ir.ExternKernel.realize_input(x) for x in (q, k, v, cu_q, cu_k)]
    T, H, _ = q.get_size()
    size = [T, H, v.get_size()[-1]]
    layout = ir.FixedLayout(q.get_device(), q.get_dtype(), size, ir.FlexibleLayout.contiguous_strides(size))
    choices = [_extern_choice(c).bind(nodes, layout, scale=float(scale), causal=bool(causal)) for c in candidates]
    _install_saver()
    _SAVER.last = {}
    result = autotune_select_algorithm(SELECT_NAME, choices, nodes, layout,
                                       input_gen_fns=_input_gens(q, k, cu_q, bool(causal)))
    name = _winner_name(result, candidates)
    win = next(c for c in candidates if c.name == name)
    timings = {c.name: _SAVER.last.get(c.name) for c in candidates}
    _compile_log.record(_compile_log.AutotuneRecord(
        op=OP_NAME, shapes=f"q={_hints(q)} k={_hints(k)} v={_hints(v)} seqs={_hints(cu_q)[0] - 1} causal={bool(causal)}",
        dtype=str(q.get_dtype()).replace("torch.", ""), device=str(q.get_device()), timings_ms=timings,
        winner=win.name, winner_backend=win.backend,
        note="" if len(candidates) > 1 else "one candidate: nothing to time"))
    torch._dynamo.utils.counters["mla_autotune"][f"{OP_NAME} -> {win.backend}"] += 1
    outs = fallback_handler(win.op, add_to_fallback_set=False)(q, k, v, cu_q, cu_k, float(scale), bool(causal),
                                                                *win.extra)
    return tuple(outs)


def lower_prefill_autotune(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
    """The registered lowering: autotune on CUDA (or under :func:`autotune_on_cpu`), else a plain fallback."""
    from torch._inductor.lowering import fallback_handler

    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    op = torch.ops.mla.prefill_autotune.default
    device = q.get_device()
    dev_type = getattr(device, "type", "cpu")
    candidates: list[Candidate] = []
    try:
        _, H, Dqk = _hints(q)
        facts = dict(device=device, dtype=q.get_dtype(), num_heads=H, head_dims=(Dqk, _hints(v)[-1]),
                     causal=bool(causal))
        if dev_type == "cuda":
            candidates = prefill_candidates(**facts)
        elif _CPU_HOOK[0] is not None:
            candidates = _CPU_HOOK[0](**facts)
        if candidates:
            return _autotuned(args, candidates)
    except Exception as e:  # private API drift or a failed benchmark: stay correct, say why
        if dev_type != "cpu" or _CPU_HOOK[0] is not None:
            _warn_once(f"{type(e).__name__}", f"{OP_NAME}: autotuning failed on torch {torch.__version__} "
                       f"({type(e).__name__}: {e}); using the static default backend instead")
        log.debug("mla prefill autotune fell back", exc_info=True)
    return tuple(fallback_handler(op, add_to_fallback_set=False)(*args))


def install() -> bool:
    """Register the lowering (idempotent). False, with a warning, when Inductor's API is unusable here."""
    try:
        from torch._inductor.lowering import register_lowering
        from torch._inductor.select_algorithm import ExternKernelChoice, autotune_select_algorithm  # noqa: F401
    except Exception as e:
        _warn_once("install", f"{OP_NAME}: Inductor's lowering API is not usable on torch {torch.__version__} "
                   f"({type(e).__name__}: {e}); backend='autotune' runs the static default backend")
        return False
    register_lowering(torch.ops.mla.prefill_autotune.default, type_promotion_kind=None)(lower_prefill_autotune)
    mark_lowered(OP_NAME)
    return True
