"""Inductor lowering of ``mla::prefill_autotune``: Inductor times every prefill implementation that can
serve the compiled shapes and emits the fastest. Same mechanism as :mod:`mla_compile.lowerings.decode`
(private Inductor API, torch 2.11-2.13): one ``ExternKernelChoice`` per candidate timed on ``out``
alone, then the winner's ``(out, lse)`` op emitted as a fallback kernel; the timing node is dead code.

Candidates: our Triton kernel in a few launch configurations (``mla::prefill_triton_config``), on sm_90+
our TMA kernel in :data:`TMA_CONFIGS` (``mla::prefill_triton_tma_config``; once its backend "triton-tma" is
GPU-tested) and the peer backends the
registry declares autotune-eligible (``autotune=True``: flash-attn, FlashInfer trtllm-gen on sm100) where
the selector says they serve the shapes. Left out (not autotune-eligible):

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

from typing import Callable

import torch

from mla_compile.lowerings import _autotune
from mla_compile.lowerings._autotune import Candidate, hints
from mla_compile.ops import select
from mla_compile.ops.registry import backends_for
from mla_compile.ops.triton import available as triton_available

OP_NAME = "mla::prefill_autotune"
SELECT_NAME = "mla_prefill_autotune"
# (BLOCK_M, BLOCK_N, num_warps, num_stages); 0 keeps the heuristic's value (ops/triton/prefill.py:_pick).
# Every tile is at most the bf16 default's (128 x 64), so none needs more shared memory than it.
TRITON_CONFIGS: tuple[tuple[int, int, int, int], ...] = ((0, 0, 0, 0), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3))
# The TMA kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages, heads_first) on sm_90+ (bf16/fp16; heads_first
# 1 / 2: on / off). At qk 192 / v 128 none spills; shared memory 214 KB (128 x 128, 2 stages), 173 KB (128 x 64,
# 3 stages) (sm_90 compile).
TMA_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 128, 8, 2, 2), (128, 64, 8, 3, 2), (128, 128, 8, 2, 1), (128, 64, 8, 3, 1))
_CPU_HOOK: list[Callable | None] = [None]  # tests: candidates on CPU (see autotune_on_cpu)
_WARNED: set[str] = set()


def prefill_candidates(device: torch.device, dtype: torch.dtype, num_heads: int, head_dims: tuple[int, int],
                       causal: bool) -> list[Candidate]:
    """Every plan-free implementation that can serve these static facts on ``device`` (CUDA).

    A :class:`~mla_compile.lowerings._autotune.Candidate`'s ``op`` here takes
    ``(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, *extra)``."""
    facts = dict(device=device, dtype=dtype, num_heads=num_heads, head_dims=head_dims, query_len=2)
    out = _autotune.peer_candidates("prefill", facts)
    if triton_available() and device.type == "cuda" and dtype != torch.float64:
        configs = TRITON_CONFIGS if torch.finfo(dtype).bits <= 16 else TRITON_CONFIGS[:1]
        for bm, bn, nw, ns in configs:
            out.append(Candidate(f"mla_prefill_triton_bm{bm}_bn{bn}_w{nw}_s{ns}", "triton",
                                 torch.ops.mla.prefill_triton_config.default, (bm, bn, nw, ns)))
        tma = backends_for("prefill")["triton-tma"]  # its configs join once its CUDA tests have passed
        if (torch.finfo(dtype).bits == 16 and (select.device_capability(device) or (0, 0))[0] >= 9
                and tma.gpu_tested):
            for bm, bn, nw, ns, hf in TMA_CONFIGS:
                out.append(Candidate(f"mla_prefill_triton_tma_bm{bm}_bn{bn}_w{nw}_s{ns}_hf{hf}", "triton-tma",
                                     torch.ops.mla.prefill_triton_tma_config.default, (bm, bn, nw, ns, hf)))
    return out


def autotune_on_cpu(candidates: Callable[..., list[Candidate]]):
    """Tests: a context in which CPU graphs are autotuned too, over ``candidates(...)`` (same arguments as
    :func:`prefill_candidates`)."""
    return _autotune.cpu_hook(_CPU_HOOK, candidates)


def _input_gens(q, k, cu_seqlens_q, causal: bool) -> dict[int, Callable]:
    """Benchmark inputs: random q/k/v and the rows split evenly over the sequences (causal: at least as
    many keys as queries per sequence); the real lengths are unknown at compile time."""
    T = hints(q)[0]
    S = hints(k)[0]
    n = hints(cu_seqlens_q)[0] - 1
    len_q = T // n if n > 0 else 0
    len_k = S // n if n > 0 else 0
    if causal:
        len_q = min(len_q, len_k)
    dev = q.get_device()

    def gen_float(node):
        return torch.randn(hints(node), device=dev).to(node.get_dtype())

    def gen_cu(step):
        return lambda node: (torch.arange(n + 1, device=dev) * step).to(node.get_dtype())

    return {0: gen_float, 1: gen_float, 2: gen_float, 3: gen_cu(len_q), 4: gen_cu(len_k)}


def _autotuned(args: tuple, candidates: list[Candidate]):
    q, k, v, cu_q, cu_k, scale, causal = args
    T, H, _ = q.get_size()
    return _autotune.select_and_emit(
        OP_NAME, SELECT_NAME, candidates, (q, k, v, cu_q, cu_k), dict(scale=float(scale), causal=bool(causal)),
        [T, H, v.get_size()[-1]], _input_gens(q, k, cu_q, bool(causal)),
        f"q={hints(q)} k={hints(k)} v={hints(v)} seqs={hints(cu_q)[0] - 1} causal={bool(causal)}")


def lower_prefill_autotune(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
    """The registered lowering: autotune on CUDA (or under :func:`autotune_on_cpu`), else a plain fallback."""
    device = q.get_device()

    def find() -> list[Candidate]:
        _, H, Dqk = hints(q)
        facts = dict(device=device, dtype=q.get_dtype(), num_heads=H, head_dims=(Dqk, hints(v)[-1]),
                     causal=bool(causal))
        if getattr(device, "type", "cpu") == "cuda":
            return prefill_candidates(**facts)
        return _CPU_HOOK[0](**facts) if _CPU_HOOK[0] is not None else []

    return _autotune.lower(OP_NAME, torch.ops.mla.prefill_autotune.default,
                           (q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal), device, find, _autotuned,
                           _CPU_HOOK[0] is not None, _WARNED)


def install() -> bool:
    """Register the lowering (idempotent). False, with a warning, when Inductor's API is unusable here."""
    return _autotune.install(OP_NAME, torch.ops.mla.prefill_autotune.default, lower_prefill_autotune, _WARNED)
