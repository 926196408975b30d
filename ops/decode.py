"""``mla::decode``: absorbed MLA decode over the paged latent cache.

Contract: ``q [B, s_q, H, D]`` (D = kv_lora_rank + rope_dim, the absorbed query ``[q_nope @ W_UK | q_pe]``)
attends over the first ``seq_lens[b]`` rows of sequence b, found through ``block_table [B, max_blocks]``
in ``kv_cache [num_blocks, block_size, D]``. The values are the first ``kv_lora_rank`` columns of each
row. With ``s_q > 1`` (speculative / MTP decode) query i of a sequence sees the rows before
``seq_lens[b] - (s_q - 1 - i)``: the new tokens are the last ``s_q`` rows, causally.
Returns ``out [B, s_q, H, kv_lora_rank]`` (q's dtype) and ``lse [B, s_q, H]`` (float32, natural log).
A query that sees no rows gets ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_same_device, check_tensor,
                                     data_checks_enabled)
from mla_compile.ops.registry import (FLOATS, LAYOUT_TAGS, SM90, call_impl, declare, declare_op, declare_split_op,
                                      run_split_part, step_schedule)
from mla_compile.ops.select import resolve
from mla_compile.ops._paged import attend, check_paged_data, decode_shape, sequence_slots

OP = declare_op("decode", "mla.decode", cache=True, env="all")


def validate(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, kv_lora_rank: int) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode."""
    check_tensor(OP, "q", q, ndim=4, dtypes=FLOAT_DTYPES, expected="[B, s_q, H, kv_lora_rank + rope_dim]")
    B, s_q, H, D = q.shape
    check_tensor(OP, "kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES, shape=(None, None, D),
                 expected=f"[num_blocks, block_size, {D}] (the last dim must equal q's)")
    check_tensor(OP, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, shape=(B, None),
                 expected="[B, max_blocks] int32")
    check_tensor(OP, "seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, shape=(B,), expected="[B] int32")
    if not 0 < kv_lora_rank <= D:
        raise ValueError(f"{OP}: kv_lora_rank must be in (0, {D}] (the value width inside a cache row), "
                         f"got {kv_lora_rank}")
    check_same_device(OP, q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    if data_checks_enabled(seq_lens):
        check_paged_data(OP, block_table, seq_lens, kv_cache.shape[1], kv_cache.shape[0])


@torch.library.custom_op("mla::decode_ref", mutates_args=(), tags=LAYOUT_TAGS)
def decode_ref(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
               kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device, float32 or float64 math): gather every row, mask, softmax."""
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s_q = q.shape[1]
    slots, valid, pos = sequence_slots(block_table, seq_lens, kv_cache.shape[1])
    rows = kv_cache[slots // kv_cache.shape[1], slots % kv_cache.shape[1]].to(acc)
    rows = torch.where(valid[..., None], rows, 0)  # unread rows may hold NaN: never let them in
    # query i of s_q sees positions < seq_len - (s_q - 1 - i)
    limit = seq_lens[:, None].long() - (s_q - 1 - torch.arange(s_q, device=q.device))[None, :]
    return attend(q, rows[:, None], pos[None, None, :] < limit[..., None], scale, kv_lora_rank)


def fake(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, *backend_args):
    """Fake outputs shared by every decode implementation: validate, then ``out``, ``lse``."""
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, kv_lora_rank), q.new_empty(B, s_q, H, dtype=torch.float32)


decode_ref.register_fake(fake)


declare(OP, "reference", torch.ops.mla.decode_ref, rank=100, devices=("any",), dtypes=FLOATS, gpu_tested=True,
        note="plain torch, the numerical ground truth")


def decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, *,
           kv_lora_rank: int = 512, backend: str | None = None, plan: object | None = None,
           schedule: tuple[Tensor, ...] | None = None) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode; see the module docstring for the contract.

    ``q`` is ``[B, s_q, H, D]`` or ``[B, H, D]`` (s_q = 1; then ``out`` is ``[B, H, kv_lora_rank]`` and
    ``lse`` is ``[B, H]``). ``backend``: None/"auto" (the selector's choice for these shapes,
    ``mla_compile.ops.select``), or a declared backend name ("reference", "triton", "flashmla", ...).
    ``plan``: the host-side plan of backends that need one (``"flashinfer"``: made by
    ``mla_compile.ops.adapters.flashinfer.plan_flashinfer_decode`` before the step). ``schedule``: a step schedule
    shared by every layer's call of the step, for backends that take one (``"flashmla"``, and the splits and
    tiers that run it: made by :func:`decode_step_schedule` from the step's ``seq_lens``; without it the backend
    schedules inside each call).
    """
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(1) if squeeze else q
    impl = resolve(OP, q.device, backend, dtype=q4.dtype, cache=kv_cache, planned=plan is not None,
                   shape=lambda: decode_shape(q4, kv_cache, block_table, kv_lora_rank))
    out, lse = call_impl(OP, impl, (q4, kv_cache, block_table, seq_lens, scale, kv_lora_rank), plan, schedule)
    return (out.squeeze(1), lse.squeeze(1)) if squeeze else (out, lse)


def decode_step_schedule(seq_lens: Tensor, num_heads: int, backend: str, query_len: int = 1) -> tuple | None:
    """The step schedule ``decode(..., backend=backend, schedule=)`` takes, made once from the step's ``seq_lens``
    for every layer's call of ``num_heads`` heads and ``query_len`` queries a sequence (FlashMLA's split schedule:
    one scheduler launch a step instead of one a layer); None when ``backend`` (a resolved name, not "auto")
    takes none. Capturable: make it inside the compiled or captured step, before its layers."""
    return step_schedule(OP, backend, seq_lens, num_heads, query_len)


@torch.library.custom_op("mla::decode_split", mutates_args=(), tags=LAYOUT_TAGS)
def decode_split(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                 kv_lora_rank: int, tiers: str, plan_id: int, schedule_tiles: Tensor | None = None,
                 schedule_splits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``mla::decode`` through the part of ``tiers`` (``"triton:2/flashinfer"``: see
    :func:`~mla_compile.ops.registry.split_name`) whose row bound covers this call's ``B * s_q`` query rows.
    ``plan_id``: the host plan's static id for a part that needs one (-1: none given); ``schedule_tiles`` /
    ``schedule_splits``: the step schedule (:func:`decode_step_schedule`) for a part that takes one (None: the
    part schedules itself)."""
    return run_split_part(OP, tiers, q.shape[0] * q.shape[1],
                          (q, kv_cache, block_table, seq_lens, scale, kv_lora_rank), plan_id,
                          (schedule_tiles, schedule_splits))


decode_split.register_fake(fake)
declare_split_op(OP, torch.ops.mla.decode_split, "batch", schedule_tensors=2)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
            scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.decode  # noqa: F401  (registers mla::decode_triton)
    return torch.ops.mla.decode_triton(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=FLOATS, package="triton", gpu_tested=True,
        autotune=True, kernels=("decode_triton", "decode_triton_config=triton (autotuned config)",
                                "_decode_split_kernel", "_decode_reduce_kernel"),
        note="ours; portable path for ROCm/XPU")


def _gluon(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
           scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.decode_gluon  # noqa: F401  (registers mla::decode_gluon)
    return torch.ops.mla.decode_gluon(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


def _gluon_ws(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
              scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.decode_gluon  # noqa: F401  (registers mla::decode_gluon_ws)
    return torch.ops.mla.decode_gluon_ws(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


def _gluon_seesaw(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                  scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.decode_gluon  # noqa: F401  (registers mla::decode_gluon_seesaw)
    return torch.ops.mla.decode_gluon_seesaw(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


def _gluon_persist(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                   scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.decode_gluon  # noqa: F401  (registers mla::decode_gluon_persist)
    return torch.ops.mla.decode_gluon_persist(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


def _gluon_seesaw_persist(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                          scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.decode_gluon  # noqa: F401  (registers mla::decode_gluon_seesaw_persist)
    return torch.ops.mla.decode_gluon_seesaw_persist(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


# Gluon sm_90 kernels (ops/triton/decode_gluon.py): ranked after "triton", so without timings "auto" keeps
# the Triton kernel; the measured timings (ops/backend_timings) decide.
_GLUON = dict(available=_triton_available, dtypes=(torch.bfloat16,), cache_dtypes=(torch.bfloat16,), block_multiple=64,
              packed_rows=True, head_dims=((512, 64),), min_capability=SM90, max_capability=SM90, package="triton",
              gpu_tested=True)
declare(OP, "gluon", _gluon, rank=60, **_GLUON,
        kernels=("decode_gluon=gluon (opaque kernel)", "decode_gluon_kernel"),
        note="ours (Gluon, sm_90: TMA tiles, wgmma, 64 query rows a program); bf16, 512 + 64, pages of a "
             "multiple of 64 (a strided cache runs the Triton kernel)")
declare(OP, "gluon-ws", _gluon_ws, rank=61, **_GLUON,
        kernels=("decode_gluon_ws=gluon-ws (opaque kernel)", "decode_gluon_ws_kernel"),
        note="as 'gluon', warp-specialized (a TMA producer, two consumer warpgroups alternating tiles)")
declare(OP, "gluon-seesaw", _gluon_seesaw, rank=62, **_GLUON,
        kernels=("decode_gluon_seesaw=gluon-seesaw (opaque kernel)", "decode_gluon_seesaw_kernel"),
        note="as 'gluon', two warpgroups alternating tiles without a producer (one's softmax under the other's "
             "dots; 64 query rows a program at every size)")
# the persistent forms: GPU-tested, but slower than the kernels they come from at every timed shape (BENCHMARKS.md),
# so "auto" passes over them
_PERSIST = dict(_GLUON, auto_skip="slower than its non-persistent kernel where timed: 'auto' skips it, ask for it by "
                                  "name")
declare(OP, "gluon-persist", _gluon_persist, rank=64, **_PERSIST,
        kernels=("decode_gluon_persist=gluon-persist (opaque kernel)", "decode_gluon_swap_persist_kernel"),
        note="as 'gluon', its swapped kernel (at most 16 query rows a sequence) persistent: one program an SM over "
             "balanced runs of key tiles, then a merge")
declare(OP, "gluon-seesaw-persist", _gluon_seesaw_persist, rank=63, **_PERSIST,
        kernels=("decode_gluon_seesaw_persist=gluon-seesaw-persist (opaque kernel)",
                 "decode_gluon_seesaw_persist_kernel", "_tile_merge_kernel"),
        note="as 'gluon-seesaw', one program an SM over balanced runs of key tiles, then a merge (whole 64-row "
             "blocks of query rows a sequence; other calls run 'gluon-seesaw')")
