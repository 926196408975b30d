"""Inductor lowering of ``mla::decode_autotune``: Inductor times every decode implementation that can
serve the compiled shapes and emits the fastest.

How (private Inductor API, checked on torch 2.13; see ``shared/notes/torch-compile.md`` section 3):

- Each candidate (our Triton kernel in a few launch configurations through ``mla::decode_triton_config``;
  FlashMLA's ``mla::decode_flashmla`` where the selector says it serves the shapes) becomes an
  ``ExternKernelChoice`` whose benchmark callable returns the attention output. ``ExternKernelChoice``
  and ``autotune_select_algorithm`` handle one output only, so timing runs on ``out`` alone
  (every backend computes the LSE anyway, so the time is the same).
- ``autotune_select_algorithm`` benchmarks them (its in-process cache and logging included) and
  returns the winner (``(node, choice)`` on 2.12+, the node on 2.11: the winner is then read from it).
- The lowering then emits the winner's multi-output op as a fallback kernel, ``(out, lse)``; the
  out-only node made by the selector has no users and is removed by Inductor's dead-code elimination.
- FlashInfer's decode needs a host-side plan per step, which a compiled graph cannot make: left out.
  The Blackwell paths return no LSE: left out (the selector rejects them when the LSE is needed).

On CPU, or when the private API is unusable (a warning says why), the lowering emits a plain
fallback call of ``mla::decode_autotune`` (its eager kernel: the static default backend).
Every autotuned lowering is recorded in :mod:`mla_compile.ops._compile_log` for ``mla-compile inspect``.
The lowering is Python and not part of Inductor's FX-graph-cache key: compile with
``torch._inductor.config.patch(force_disable_caches=True)`` when changing it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from mla_compile.ops import _compile_log
from mla_compile.ops.decode_autotune import mark_lowered
from mla_compile.ops.triton import available as triton_available

log = logging.getLogger(__name__)
OP_NAME = "mla::decode_autotune"
SELECT_NAME = "mla_decode_autotune"


@dataclass(frozen=True)
class Candidate:
    """One autotune choice: ``name`` (a Python identifier, unique), the ``backend`` it belongs to and the
    multi-output op ``op(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, *extra) -> (out, lse)``."""

    name: str
    backend: str
    op: torch._ops.OpOverload
    extra: tuple = ()


# (BLOCK_N, num_warps, num_stages, splits); 0 keeps the heuristic's value (ops/triton/decode.py:_pick)
TRITON_CONFIGS: tuple[tuple[int, int, int, int], ...] = ((0, 0, 0, 0), (32, 0, 3, 0), (64, 0, 3, 0), (0, 0, 0, 1))
# Candidate lengths for benchmarking: None = every sequence as long as the block table allows.
BENCH_SEQ_LEN: list[int | None] = [None]
_CPU_HOOK: list[Callable | None] = [None]  # tests: candidates on CPU (see autotune_on_cpu)
_WARNED: set[str] = set()


def decode_candidates(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int,
                      num_heads: int, head_dims: tuple[int, int], query_len: int) -> list[Candidate]:
    """Every implementation that can serve these static facts on ``device`` (CUDA), fastest-known first."""
    from mla_compile.backends import select_backend

    out: list[Candidate] = []
    for name in ("flashmla", "flashinfer-trtllm", "flashinfer-cutlass"):
        try:
            select_backend("decode", device=device, dtype=dtype, cache_dtype=cache_dtype, block_size=block_size,
                           num_heads=num_heads, head_dims=head_dims, query_len=query_len, requested=name,
                           need_lse=True)
        except ValueError:
            continue  # this backend cannot serve the shapes here (the selector says why in `doctor`)
        op = getattr(torch.ops.mla, "decode_" + name.replace("-", "_")).default
        out.append(Candidate(f"mla_decode_{name.replace('-', '_')}", name, op))
    if triton_available() and device.type == "cuda":
        configs = TRITON_CONFIGS if torch.finfo(cache_dtype).bits <= 16 else TRITON_CONFIGS[:1]
        for bn, nw, ns, sp in configs:
            out.append(Candidate(f"mla_decode_triton_bn{bn}_w{nw}_s{ns}_sp{sp}", "triton",
                                 torch.ops.mla.decode_triton_config.default, (bn, nw, ns, sp)))
    return out


@contextlib.contextmanager
def autotune_on_cpu(candidates: Callable[..., list[Candidate]]) -> Iterator[None]:
    """Tests: autotune CPU graphs too, over ``candidates(...)`` (same arguments as :func:`decode_candidates`)."""
    _CPU_HOOK[0] = candidates
    try:
        yield
    finally:
        _CPU_HOOK[0] = None


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, stacklevel=2)


_BENCH_FNS: dict[str, Callable] = {}
_CHOICES: dict[str, object] = {}


def _extern_choice(cand: Candidate):
    """The ``ExternKernelChoice`` of ``cand`` (one per name per process: Inductor registers it by name)."""
    from torch._inductor.select_algorithm import ExternKernelChoice

    choice = _CHOICES.get(cand.name)
    if choice is None:
        op, extra = cand.op, cand.extra

        def bench(q, kv_cache, block_table, seq_lens, *, scale, kv_lora_rank):
            return op(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, *extra)[0]

        bench.__name__ = cand.name
        lookup = getattr(ExternKernelChoice, "lookup", None)
        choice = lookup(cand.name) if lookup is not None else None
        if choice is None:
            choice = ExternKernelChoice(bench, name=cand.name, has_out_variant=False)
        _CHOICES[cand.name] = choice
    return choice


class _Timings:
    """A feedback saver: keeps the last timings Inductor measured for our select name (signature differs
    across torch versions; the first two arguments, timings and name, are stable)."""

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


def _hints(node) -> list[int]:
    from torch._inductor.virtualized import V

    sv = V.graph.sizevars
    hints = getattr(sv, "optimization_hints", None) or sv.size_hints  # renamed in torch 2.13
    return [int(s) for s in hints(node.get_size())]


def _input_gens(q, kv_cache, block_table) -> dict[int, Callable]:
    """Benchmark inputs: random q, a cache of just the blocks the table can reach, a scattered block
    table and every sequence at the benchmark length (the block table's capacity by default)."""
    B, _, _, D = _hints(q)
    num_blocks, block_size, _ = _hints(kv_cache)
    max_blocks = _hints(block_table)[1]
    blocks = max(1, min(num_blocks, B * max_blocks))
    capacity = max_blocks * block_size
    seq_len = min(capacity, BENCH_SEQ_LEN[0] or capacity)
    dev = q.get_device()

    def gen_q(node):
        return torch.randn(_hints(node), device=dev).to(node.get_dtype())

    def gen_kv(node):
        return torch.randn(blocks, block_size, D, device=dev).to(node.get_dtype())

    def gen_bt(node):
        perm = torch.randperm(B * max_blocks, device=dev) % blocks
        return perm.view(B, max_blocks).to(node.get_dtype())

    def gen_sl(node):
        return torch.full((B,), seq_len, dtype=node.get_dtype(), device=dev)

    return {0: gen_q, 1: gen_kv, 2: gen_bt, 3: gen_sl}


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

    q, kv_cache, block_table, seq_lens, scale, kv_lora_rank = args
    nodes = [ir.ExternKernel.realize_input(x) for x in (q, kv_cache, block_table, seq_lens)]
    B, s_q, H, _ = q.get_size()
    size = [B, s_q, H, kv_lora_rank]
    layout = ir.FixedLayout(q.get_device(), q.get_dtype(), size, ir.FlexibleLayout.contiguous_strides(size))
    choices = []
    for cand in candidates:
        choices.append(_extern_choice(cand).bind(nodes, layout, scale=float(scale), kv_lora_rank=int(kv_lora_rank)))
    _install_saver()
    _SAVER.last = {}
    result = autotune_select_algorithm(SELECT_NAME, choices, nodes, layout,
                                       input_gen_fns=_input_gens(q, kv_cache, block_table))
    name = _winner_name(result, candidates)
    win = next(c for c in candidates if c.name == name)
    timings = {c.name: _SAVER.last.get(c.name) for c in candidates}
    _compile_log.record(_compile_log.AutotuneRecord(
        op=OP_NAME, shapes=f"q={_hints(q)} kv_cache={_hints(kv_cache)} block_table={_hints(block_table)}",
        dtype=str(q.get_dtype()).replace("torch.", ""), device=str(q.get_device()), timings_ms=timings,
        winner=win.name, winner_backend=win.backend,
        note="" if len(candidates) > 1 else "one candidate: nothing to time"))
    torch._dynamo.utils.counters["mla_autotune"][f"{OP_NAME} -> {win.backend}"] += 1
    outs = fallback_handler(win.op, add_to_fallback_set=False)(q, kv_cache, block_table, seq_lens, float(scale),
                                                                int(kv_lora_rank), *win.extra)
    return tuple(outs)


def lower_decode_autotune(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank):
    """The registered lowering: autotune on CUDA (or under :func:`autotune_on_cpu`), else a plain fallback."""
    from torch._inductor.lowering import fallback_handler

    args = (q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    op = torch.ops.mla.decode_autotune.default
    device = q.get_device()
    dev_type = getattr(device, "type", "cpu")
    candidates: list[Candidate] = []
    try:
        B, s_q, H, D = _hints(q)
        num_blocks, block_size, _ = _hints(kv_cache)
        facts = dict(device=device, dtype=q.get_dtype(), cache_dtype=kv_cache.get_dtype(), block_size=block_size,
                     num_heads=H, head_dims=(int(kv_lora_rank), D - int(kv_lora_rank)), query_len=s_q)
        if dev_type == "cuda":
            candidates = decode_candidates(**facts)
        elif _CPU_HOOK[0] is not None:
            candidates = _CPU_HOOK[0](**facts)
        if candidates:
            return _autotuned(args, candidates)
    except Exception as e:  # private API drift or a failed benchmark: stay correct, say why
        if dev_type != "cpu" or _CPU_HOOK[0] is not None:
            _warn_once(f"{type(e).__name__}", f"{OP_NAME}: autotuning failed on torch {torch.__version__} "
                       f"({type(e).__name__}: {e}); using the static default backend instead")
        log.debug("mla decode autotune fell back", exc_info=True)
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
    register_lowering(torch.ops.mla.decode_autotune.default, type_promotion_kind=None)(lower_decode_autotune)
    mark_lowered(OP_NAME)
    return True
