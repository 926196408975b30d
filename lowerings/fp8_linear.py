"""Inductor lowering of ``mla::fp8_block_linear_autotune``: Inductor times every fp8 block linear implementation
that serves the compiled call and emits the fastest. Same mechanism as :mod:`mla_compile.lowerings.decode`
(private Inductor API, torch 2.11-2.13): one ``ExternKernelChoice`` per candidate (each timed as a CUDA-graph
replay of one call on CUDA), then the winner's op emitted as a fallback kernel; the timing node is dead code.

Candidates, from the registry (:mod:`mla_compile.ops.registry`; ``why_not`` decides what serves, with the
call's form: ``act_quant``, a 3-D weight or sorted groups, K):

- our Triton kernel in each of :data:`TRITON_CONFIGS` (``mla::fp8_block_linear_triton_config``, or
  ``mla::fp8_block_linear_sorted_triton_config`` in :data:`SORTED_CONFIGS` for the sorted-groups form; float32
  activations only in the heuristic's configuration, float64 never: its Triton backend runs the reference);
- the peers the registry declares autotune-eligible that serve the call: torch's blockwise-scaled matmul
  (``"scaled-mm"``) for ``act_quant=True``, a 2-D weight and K a multiple of 128.

The weights are timed on random codes of their compiled shapes (their values are not known at compile time).
A dynamic M (one graph for every token count) is timed at its compile-time hint. On CPU, or when the private
API is unusable (a warning says why), the lowering emits a plain fallback call of the op (its eager kernel: the
static default backend). Every autotuned lowering is recorded in :mod:`mla_compile.ops._compile_log`.
"""

from __future__ import annotations

from typing import Callable

import torch

from mla_compile.lowerings import _autotune
from mla_compile.lowerings._autotune import Candidate, hints

OP_NAME = "mla::fp8_block_linear_autotune"
SELECT_NAME = "mla_fp8_block_linear_autotune"
# (BLOCK_M, BLOCK_N, num_warps, num_stages, split_k); 0 keeps the heuristic's value (ops/triton/fp8_block_linear.py:
# _config: BLOCK_M 16 up to 16 rows else 64, BLOCK_N 64 (32 for up to 16 rows over at most 8192 columns), 4 warps,
# 3 stages for 16-bit activations; split_k: K slices until the launch has a few programs per SM, summed in the
# kernel). BLOCK_N divides 128 (a tile's rows share one weight-scale row).
# Narrow column tiles give few-token calls more programs over N; wide row tiles read each weight tile once for
# more tokens; split_k 1 (no slices) saves the float32 slice round trip where the heuristic would split. Stage memory is
# at most 40 KB (BLOCK_M x 128 activation + BLOCK_N x 128 codes), three stages well inside an sm_90 SM. The sorted
# groups kernel takes the first four fields (it does not split K).
TRITON_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (0, 0, 0, 0, 0), (16, 32, 2, 4, 0), (32, 128, 4, 3, 0), (128, 64, 8, 3, 0), (0, 0, 0, 0, 1))
SORTED_CONFIGS: tuple[tuple[int, int, int, int], ...] = tuple(dict.fromkeys(c[:4] for c in TRITON_CONFIGS))
_CPU_HOOK: list[Callable | None] = [None]  # tests: candidates on CPU (see autotune_on_cpu)
_WARNED: set[str] = set()


def fp8_linear_candidates(device: torch.device, dtype: torch.dtype, act_quant: bool, grouped: bool,
                          sorted_groups: bool, k: int) -> list[Candidate]:
    """Every implementation that serves a call of this form on ``device`` (CUDA): the registry's autotune-eligible
    peers (:func:`mla_compile.lowerings._autotune.peer_candidates`), then our Triton kernel in each of
    :data:`TRITON_CONFIGS` where the registry says "triton" serves.

    A candidate's ``op`` takes ``(x, weight, weight_scale_inv, act_quant, *extra)``, or with sorted groups
    ``(x, weight, weight_scale_inv, offs, act_quant, *extra)``."""
    from mla_compile.ops.registry import backends_for
    from mla_compile.ops.select import facts_for, why_not

    form = dict(act_quant=act_quant, grouped=grouped or sorted_groups, k=k)
    out = _autotune.peer_candidates("fp8_block_linear", dict(device=device, dtype=dtype, **form))
    triton = backends_for("fp8_block_linear")["triton"]
    if device.type == "cuda" and dtype != torch.float64 and why_not(triton, facts_for(device, dtype, **form)) is None:
        configs = SORTED_CONFIGS if sorted_groups else TRITON_CONFIGS
        configs = configs if torch.finfo(dtype).bits <= 16 else configs[:1]
        op = (torch.ops.mla.fp8_block_linear_sorted_triton_config if sorted_groups
              else torch.ops.mla.fp8_block_linear_triton_config).default
        kind = "sorted_triton" if sorted_groups else "triton"
        for cfg in configs:
            label = "_".join(f"{k}{v}" for k, v in zip(("bm", "bn", "w", "s", "sk"), cfg))
            out.append(Candidate(f"mla_fp8_linear_{kind}_{label}", "triton", op, cfg))
    return out


def autotune_on_cpu(candidates: Callable[..., list[Candidate]]):
    """Tests: a context in which CPU graphs are autotuned too, over ``candidates(...)`` (same arguments as
    :func:`fp8_linear_candidates`)."""
    return _autotune.cpu_hook(_CPU_HOOK, candidates)


def _input_gens(x, weight, scale, offs) -> dict[int, Callable]:
    """Benchmark inputs at the nodes' compile-time sizes: random activations, finite random e4m3 codes, positive
    block scales and (sorted groups) the rows split evenly over the groups."""
    dev = x.get_device()

    def gen_x(node):
        return torch.randn(hints(node), device=dev).to(node.get_dtype())

    def gen_codes(node):  # bytes 0..126: the finite non-negative e4m3 codes (127 is NaN); 1 byte per weight
        return torch.randint(0, 127, hints(node), dtype=torch.uint8, device=dev).view(node.get_dtype())

    def gen_scale(node):
        return torch.rand(hints(node), device=dev).mul_(1e-3).add_(1e-4).to(node.get_dtype())

    gens = {0: gen_x, 1: gen_codes, 2: gen_scale}
    if offs is not None:
        rows, groups = hints(x)[0], hints(offs)[0]

        def gen_offs(node):
            return (torch.arange(1, groups + 1, device=dev) * rows // groups).to(node.get_dtype())

        gens[3] = gen_offs
    return gens


def _out_size(x, weight, offs) -> list[int]:
    """The output's compile-time size: ``[M, N]``, ``[E, M, N]`` (3-D weight) or ``[R, N]`` (sorted groups)."""
    w = hints(weight)
    if len(w) == 3 and offs is None:
        return [w[0], hints(x)[-2], w[1]]
    return [hints(x)[0], w[-2]]


def _autotuned(args: tuple, candidates: list[Candidate]):
    x, weight, scale, act_quant, offs = args
    tensors = (x, weight, scale) if offs is None else (x, weight, scale, offs)
    scalars = dict(act_quant=bool(act_quant))
    dynamic = any(getattr(s, "free_symbols", None) for s in x.get_size())
    shapes = (f"x={hints(x)}{' (dynamic, timed at the hint)' if dynamic else ''} weight={hints(weight)} "
              f"act_quant={bool(act_quant)}" + (f" offs=[{hints(offs)[0]}]" if offs is not None else ""))
    win = _autotune.select(OP_NAME, SELECT_NAME, candidates, tensors, scalars, _out_size(x, weight, offs),
                           _input_gens(x, weight, scale, offs), shapes)
    torch._dynamo.utils.counters["mla_autotune"][f"{OP_NAME} -> {win.backend}"] += 1
    return _autotune.emit(win.op, tensors, (*scalars.values(), *win.extra))


def lower_fp8_block_linear_autotune(x, weight, weight_scale_inv, act_quant, offs=None):
    """The registered lowering: autotune on CUDA (or under :func:`autotune_on_cpu`), else a plain fallback."""
    device = x.get_device()

    def find() -> list[Candidate]:
        facts = dict(device=device, dtype=x.get_dtype(), act_quant=bool(act_quant),
                     grouped=len(weight.get_size()) == 3, sorted_groups=offs is not None, k=hints(x)[-1])
        if getattr(device, "type", "cpu") == "cuda":
            return fp8_linear_candidates(**facts)
        return _CPU_HOOK[0](**facts) if _CPU_HOOK[0] is not None else []

    return _autotune.lower(OP_NAME, torch.ops.mla.fp8_block_linear_autotune.default,
                           (x, weight, weight_scale_inv, act_quant, offs), device, find, _autotuned,
                           _CPU_HOOK[0] is not None, _WARNED)


def install() -> bool:
    """Register the lowering (idempotent). False, with a warning, when Inductor's API is unusable here."""
    return _autotune.install(OP_NAME, torch.ops.mla.fp8_block_linear_autotune.default,
                             lower_fp8_block_linear_autotune, _WARNED)
