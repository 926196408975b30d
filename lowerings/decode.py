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
  On CUDA each choice's benchmark call replays one captured call (``_autotune.GRAPH_TIMING``), so the
  time is the GPU time a captured decode step pays, not the peer's per-call host work.
- A dynamic batch (one graph for every batch size) is timed at ``BATCH_CLASSES`` sequences; when the
  winners differ, the graph gets ``mla::decode_by_rows``: each class's winner serves the batches above
  the previous class up to its own (the last class's winner everything above), else the one winner.
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

from typing import Callable

import torch

from mla_compile.lowerings import _autotune
from mla_compile.lowerings._autotune import Candidate, hints
from mla_compile.ops.triton import available as triton_available

OP_NAME = "mla::decode_autotune"
SELECT_NAME = "mla_decode_autotune"
# (BLOCK_N, num_warps, num_stages, splits); 0 keeps the heuristic's value (ops/triton/decode.py:_pick).
# No fixed split count: a class winner serves a range of batches, and a count timed at one batch does not
# carry over (a count that wins at 128 sequences can leave most SMs idle at 64, see BENCHMARKS.md); the
# heuristic's count adapts to the batch.
TRITON_CONFIGS: tuple[tuple[int, int, int, int], ...] = ((0, 0, 0, 0), (32, 0, 3, 0), (64, 0, 3, 0))
# Batch sizes a dynamic batch is timed at (smallest: the builder's padded minimum; largest: a serving
# batch); the graph splits where the winner changes (mla::decode_by_rows), else emits the one winner.
BATCH_CLASSES: tuple[int, ...] = (2, 16, 128)
# Candidate lengths for benchmarking: None = every sequence as long as the block table allows.
BENCH_SEQ_LEN: list[int | None] = [None]
_CPU_HOOK: list[Callable | None] = [None]  # tests: candidates on CPU (see autotune_on_cpu)
_WARNED: set[str] = set()


def decode_candidates(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int,
                      num_heads: int, head_dims: tuple[int, int], query_len: int) -> list[Candidate]:
    """Every implementation that can serve these static facts on ``device`` (CUDA): the registry's
    autotune-eligible peers (:func:`mla_compile.lowerings._autotune.peer_candidates`), then our Triton
    kernel in each of :data:`TRITON_CONFIGS`."""
    facts = dict(device=device, dtype=dtype, cache_dtype=cache_dtype, block_size=block_size, num_heads=num_heads,
                 head_dims=head_dims, query_len=query_len)
    out = _autotune.peer_candidates("decode", facts)
    if triton_available() and device.type == "cuda":
        configs = TRITON_CONFIGS if torch.finfo(cache_dtype).bits <= 16 else TRITON_CONFIGS[:1]
        for bn, nw, ns, sp in configs:
            out.append(Candidate(f"mla_decode_triton_bn{bn}_w{nw}_s{ns}_sp{sp}", "triton",
                                 torch.ops.mla.decode_triton_config.default, (bn, nw, ns, sp)))
    return out


def autotune_on_cpu(candidates: Callable[..., list[Candidate]]):
    """Tests: a context in which CPU graphs are autotuned too, over ``candidates(...)`` (same arguments as
    :func:`decode_candidates`)."""
    return _autotune.cpu_hook(_CPU_HOOK, candidates)


def _input_gens(q, kv_cache, block_table, batch: int | None = None) -> dict[int, Callable]:
    """Benchmark inputs: random q, a cache of just the blocks the table can reach, a scattered block
    table and every sequence at the benchmark length (the block table's capacity by default); ``batch``
    sequences instead of q's hint when given."""
    B, s_q, H, D = hints(q)
    B = B if batch is None else batch
    num_blocks, block_size, _ = hints(kv_cache)
    max_blocks = hints(block_table)[1]
    blocks = max(1, min(num_blocks, B * max_blocks))
    capacity = max_blocks * block_size
    seq_len = min(capacity, BENCH_SEQ_LEN[0] or capacity)
    dev = q.get_device()

    def gen_q(node):
        return torch.randn(B, s_q, H, D, device=dev).to(node.get_dtype())

    def gen_kv(node):
        return torch.randn(blocks, block_size, D, device=dev).to(node.get_dtype())

    def gen_bt(node):
        perm = torch.randperm(B * max_blocks, device=dev) % blocks
        return perm.view(B, max_blocks).to(node.get_dtype())

    def gen_sl(node):
        return torch.full((B,), seq_len, dtype=node.get_dtype(), device=dev)

    return {0: gen_q, 1: gen_kv, 2: gen_bt, 3: gen_sl}


def _autotuned(args: tuple, candidates: list[Candidate]):
    q, kv_cache, block_table, seq_lens, scale, kv_lora_rank = args
    B, s_q, H, _ = q.get_size()
    tensors, scalars = (q, kv_cache, block_table, seq_lens), dict(scale=float(scale), kv_lora_rank=int(kv_lora_rank))
    if isinstance(B, int) or not getattr(B, "free_symbols", None) or len(candidates) < 2:
        return _autotune.select_and_emit(
            OP_NAME, SELECT_NAME, candidates, tensors, scalars, [B, s_q, H, kv_lora_rank],
            _input_gens(q, kv_cache, block_table),
            f"q={hints(q)} kv_cache={hints(kv_cache)} block_table={hints(block_table)}")
    # a dynamic batch: one graph serves every batch size, so time a few and split where the winner changes
    wins = {}
    for b in BATCH_CLASSES:
        shape = [b, *hints(q)[1:]]
        wins[b] = _autotune.select(
            OP_NAME, f"{SELECT_NAME}_b{b}", candidates, tensors, scalars, [b, s_q, H, int(kv_lora_rank)],
            _input_gens(q, kv_cache, block_table, batch=b),
            f"q={shape} (dynamic batch, timed at {b}) kv_cache={hints(kv_cache)} block_table=[{b}, {hints(block_table)[1]}]")
    # class i's winner serves (class i-1, class i] sequences; the last one everything above
    regions = []  # [upper class, winner]; neighbours with one winner merged
    for b in BATCH_CLASSES:
        if regions and regions[-1][1].name == wins[b].name:
            regions[-1][0] = b
        else:
            regions.append([b, wins[b]])
    counters = torch._dynamo.utils.counters["mla_autotune"]
    if len(regions) == 1:
        counters[f"{OP_NAME} -> {regions[0][1].backend}"] += 1
        return _autotune.emit(regions[0][1].op, tensors, (*scalars.values(), *regions[0][1].extra))
    bounds = [b * int(s_q) for b, _ in regions[:-1]]
    counters[f"{OP_NAME} -> " + " / ".join(
        f"{w.backend} (<= {b} rows)" for b, (_, w) in zip(bounds, regions)) + f" / {regions[-1][1].backend}"] += 1
    chosen = [w for _, w in regions]
    return _autotune.emit(torch.ops.mla.decode_by_rows.default, tensors,
                          (*scalars.values(), bounds, ",".join(w.op.name() for w in chosen),
                           [int(x) for w in chosen for x in w.extra], [len(w.extra) for w in chosen]))


def lower_decode_autotune(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank):
    """The registered lowering: autotune on CUDA (or under :func:`autotune_on_cpu`), else a plain fallback."""
    device = q.get_device()

    def find() -> list[Candidate]:
        B, s_q, H, D = hints(q)
        num_blocks, block_size, _ = hints(kv_cache)
        facts = dict(device=device, dtype=q.get_dtype(), cache_dtype=kv_cache.get_dtype(), block_size=block_size,
                     num_heads=H, head_dims=(int(kv_lora_rank), D - int(kv_lora_rank)), query_len=s_q)
        if getattr(device, "type", "cpu") == "cuda":
            return decode_candidates(**facts)
        return _CPU_HOOK[0](**facts) if _CPU_HOOK[0] is not None else []

    return _autotune.lower(OP_NAME, torch.ops.mla.decode_autotune.default,
                           (q, kv_cache, block_table, seq_lens, scale, kv_lora_rank), device, find, _autotuned,
                           _CPU_HOOK[0] is not None, _WARNED)


def install() -> bool:
    """Register the lowering (idempotent). False, with a warning, when Inductor's API is unusable here."""
    return _autotune.install(OP_NAME, torch.ops.mla.decode_autotune.default, lower_decode_autotune, _WARNED)
