"""What the decode and prefill autotune lowerings share: the candidate record, Inductor size hints, the
``ExternKernelChoice`` per candidate, the timings saver, reading the winner across torch versions, and
"time, record, emit the winner's (out, lse) op" (private Inductor API, torch 2.11-2.13; see
:mod:`mla_compile.lowerings.decode` for how it works)."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from mla_compile.ops import _compile_log

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One autotune choice: ``name`` (a Python identifier, unique), the ``backend`` it belongs to and the
    op ``op(*tensors, *scalars, *extra) -> (out, lse)`` (decode: ``q, kv_cache, block_table, seq_lens, scale,
    kv_lora_rank``; prefill: ``q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal``), or ``-> out`` (the fp8
    linear: ``x, weight, weight_scale_inv[, offs], act_quant``)."""

    name: str
    backend: str
    op: torch._ops.OpOverload
    extra: tuple = ()


def peer_candidates(op: str, facts: dict) -> list[Candidate]:
    """A candidate for every backend of ``op`` the registry declares autotune-eligible, other than our Triton
    kernel (its launch configurations are the lowering's own), that serves ``facts`` with the LSE, in the
    registry's static order."""
    from mla_compile.ops.registry import backends_for, priority
    from mla_compile.ops.select import facts_for, why_not

    f = facts_for(facts.pop("device"), facts.pop("dtype"), need_lse=True, **facts)
    out = []
    for name in priority(op):
        spec = backends_for(op)[name]
        if name == "triton" or not spec.autotune or why_not(spec, f) is not None:
            continue  # not a peer candidate, or it cannot serve the shapes here (`doctor` says why)
        out.append(Candidate(f"mla_{op}_{name.replace('-', '_')}", name, spec.fn.default))
    return out


def hints(node) -> list[int]:
    """Concrete sizes of an Inductor IR node (the compile-time hints of symbolic sizes)."""
    from torch._inductor.virtualized import V

    sv = V.graph.sizevars
    get = getattr(sv, "optimization_hints", None) or sv.size_hints  # renamed in torch 2.13
    return [int(s) for s in get(node.get_size())]


def warn_once(warned: set[str], key: str, msg: str) -> None:
    """``warnings.warn(msg)`` the first time ``key`` is seen in ``warned``."""
    if key not in warned:
        warned.add(key)
        warnings.warn(msg, stacklevel=3)


@contextlib.contextmanager
def cpu_hook(hook: list, candidates: Callable[..., list[Candidate]]) -> Iterator[None]:
    """Within the block, ``hook[0]`` holds ``candidates`` (a lowering's test hook: autotune CPU graphs too)."""
    hook[0] = candidates
    try:
        yield
    finally:
        hook[0] = None


_CHOICES: dict[str, object] = {}
# CUDA: each candidate is timed as a CUDA-graph replay of one call, the way a captured decode step runs
# it. Inductor times extern choices as eager calls, where a peer's per-call host work (FlashMLA's Python
# wrapper and scheduler launch, our boundary) outweighs its GPU time at serving sizes: eager timing can
# rank FlashMLA behind Triton where FlashMLA is ahead in replay (BENCHMARKS.md).
GRAPH_TIMING = [True]
_GRAPHS: dict[tuple, tuple] = {}  # (choice, inputs) -> (graph, static outputs); emptied after each select()


def _replayed(name: str, op, args: tuple):
    """``op(*args)`` captured once into a CUDA graph for these inputs (after one warm-up call), then replayed."""
    key = (name,) + tuple((a.data_ptr(), tuple(a.shape), tuple(a.stride())) if isinstance(a, torch.Tensor) else a
                          for a in args)
    hit = _GRAPHS.get(key)
    if hit is None:
        op(*args)  # compiles / JITs outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = op(*args)
        hit = _GRAPHS[key] = (graph, outs)
    hit[0].replay()
    return hit[1]


def extern_choice(cand: Candidate, scalar_names: tuple[str, ...]):
    """The ``ExternKernelChoice`` of ``cand`` (one per name per process: Inductor registers it by name);
    its benchmark callable returns ``out`` only (``ExternKernelChoice`` times one output; an op with one
    output returns it), from a CUDA-graph replay on CUDA (``GRAPH_TIMING``)."""
    from torch._inductor.select_algorithm import ExternKernelChoice

    choice = _CHOICES.get(cand.name)
    if choice is None:
        op, extra, name = cand.op, cand.extra, cand.name

        def bench(*tensors, **scalars):
            args = (*tensors, *(scalars[k] for k in scalar_names), *extra)
            outs = _replayed(name, op, args) if GRAPH_TIMING[0] and tensors and tensors[0].is_cuda else op(*args)
            return outs[0] if isinstance(outs, (tuple, list)) else outs

        bench.__name__ = cand.name
        lookup = getattr(ExternKernelChoice, "lookup", None)
        choice = lookup(cand.name) if lookup is not None else None
        if choice is None:
            choice = ExternKernelChoice(bench, name=cand.name, has_out_variant=False)
        _CHOICES[cand.name] = choice
    return choice


class _Timings:
    """A feedback saver: the last timings Inductor measured per select name (its signature differs across
    torch versions; the first two arguments, timings and name, are stable)."""

    def __init__(self) -> None:
        self.last: dict[str, dict[str, float]] = {}

    def __call__(self, timings, name, *rest) -> None:
        self.last[name] = {getattr(c, "name", str(c)): float(t) for c, t in timings.items()}


SAVER = _Timings()


def _install_saver() -> None:
    from torch._inductor import select_algorithm as sa

    get = getattr(sa, "get_algorithm_selector_cache", None)
    cache = get() if get is not None else getattr(sa, "_ALGORITHM_SELECTOR_CACHE", None)
    fns = getattr(cache, "feedback_saver_fns", None)
    if fns is not None and SAVER not in fns:
        cache.add_feedback_saver(SAVER)


def winner_name(result, candidates: list[Candidate], timings: dict[str, float]) -> str:
    """The winning choice's name from ``autotune_select_algorithm``'s result (a pair on 2.12+, a node on 2.11)."""
    if isinstance(result, tuple) and len(result) == 2 and getattr(result[1], "name", None):
        return result[1].name
    node = result[0] if isinstance(result, tuple) else result
    text = repr(node)
    for c in sorted(candidates, key=lambda c: -len(c.name)):
        if re.search(rf"\b{re.escape(c.name)}\b", text):
            return c.name
    if timings:
        return min(timings, key=timings.__getitem__)
    return candidates[0].name


def select(op_name: str, select_name: str, candidates: list[Candidate], tensors: tuple, scalars: dict,
           out_size: list, input_gens: dict[int, Callable], shapes: str, note: str = "") -> Candidate:
    """Time ``candidates`` on ``tensors`` (IR nodes; the benchmark inputs come from ``input_gens``, so they
    may be of another batch than the nodes' hints when ``out_size`` says so) with Inductor and record the
    decision; returns the winner. The out-only timing node is left unused (dead code)."""
    from torch._inductor import ir
    from torch._inductor.select_algorithm import autotune_select_algorithm

    nodes = [ir.ExternKernel.realize_input(x) for x in tensors]
    q = tensors[0]
    layout = ir.FixedLayout(q.get_device(), q.get_dtype(), out_size, ir.FlexibleLayout.contiguous_strides(out_size))
    names = tuple(scalars)
    choices = [extern_choice(c, names).bind(nodes, layout, **scalars) for c in candidates]
    _install_saver()
    SAVER.last.pop(select_name, None)
    try:
        result = autotune_select_algorithm(select_name, choices, nodes, layout, input_gen_fns=input_gens)
    finally:
        _GRAPHS.clear()  # the graphs hold their memory pools
    measured = SAVER.last.get(select_name, {})
    win = next(c for c in candidates if c.name == winner_name(result, candidates, measured))
    _compile_log.record(_compile_log.AutotuneRecord(
        op=op_name, shapes=shapes, dtype=str(q.get_dtype()).replace("torch.", ""), device=str(q.get_device()),
        timings_ms={c.name: measured.get(c.name) for c in candidates}, winner=win.name, winner_backend=win.backend,
        note=note or ("" if len(candidates) > 1 else "one candidate: nothing to time")))
    return win


def _outputs(result):
    """A fallback kernel's outputs: a tuple for a multi-output op, the one node for a single-output op."""
    return tuple(result) if isinstance(result, (tuple, list)) else result


def emit(op, tensors: tuple, scalars: tuple):
    """``op(*tensors, *scalars)`` as a fallback kernel of the graph (its ``(out, lse)``, or its one output)."""
    from torch._inductor.lowering import fallback_handler

    return _outputs(fallback_handler(op, add_to_fallback_set=False)(*tensors, *scalars))


def select_and_emit(op_name: str, select_name: str, candidates: list[Candidate], tensors: tuple, scalars: dict,
                    out_size: list, input_gens: dict[int, Callable], shapes: str) -> tuple:
    """:func:`select` at the nodes' own sizes, then :func:`emit` the winner's ``(out, lse)`` op."""
    win = select(op_name, select_name, candidates, tensors, scalars, out_size, input_gens, shapes)
    torch._dynamo.utils.counters["mla_autotune"][f"{op_name} -> {win.backend}"] += 1
    return emit(win.op, tensors, (*scalars.values(), *win.extra))


def lower(op_name: str, op, args: tuple, device, find: Callable[[], list[Candidate]],
          autotuned: Callable[[tuple, list[Candidate]], tuple], hooked: bool, warned: set[str]) -> tuple:
    """A registered lowering's body: autotune when ``find()`` gives candidates (CUDA, or a CPU test hook:
    ``hooked``), else a plain fallback call of ``op``; any failure warns once and falls back."""
    from torch._inductor.lowering import fallback_handler

    dev_type = getattr(device, "type", "cpu")
    try:
        candidates = find()
        if candidates:
            return autotuned(args, candidates)
    except Exception as e:  # private API drift or a failed benchmark: stay correct, say why
        if dev_type != "cpu" or hooked:
            warn_once(warned, f"{type(e).__name__}", f"{op_name}: autotuning failed on torch {torch.__version__} "
                      f"({type(e).__name__}: {e}); using the static default backend instead")
        log.debug("%s autotune fell back", op_name, exc_info=True)
    return _outputs(fallback_handler(op, add_to_fallback_set=False)(*args))


def install(op_name: str, op, lowering: Callable, warned: set[str]) -> bool:
    """Register ``lowering`` for ``op`` (idempotent). False, with a warning, when Inductor's API is unusable."""
    from mla_compile.ops.decode_autotune import mark_lowered

    try:
        from torch._inductor.lowering import register_lowering
        from torch._inductor.select_algorithm import ExternKernelChoice, autotune_select_algorithm  # noqa: F401
    except Exception as e:
        warn_once(warned, "install", f"{op_name}: Inductor's lowering API is not usable on torch {torch.__version__} "
                  f"({type(e).__name__}: {e}); backend='autotune' runs the static default backend")
        return False
    register_lowering(op, type_promotion_kind=None)(lowering)
    mark_lowered(op_name)
    return True
