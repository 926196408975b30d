"""FlashMLA (PyPI ``sgl-flash-mla``, import ``flash_mla``) as backend ``"flashmla"`` of ``mla::decode``,
``mla::decode_fp8`` and ``mla::sparse_decode``.

Call contract (the one measured on the H200, see ``shared/device/anchors.py``):
``meta, _ = flash_mla.get_mla_metadata()`` then
``out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta,
softmax_scale=s, causal=..., use_legacy=True)`` with ``q [B, s_q, H, 576]`` bf16, ``k_cache
[blocks, 64, 1, 576]``, int32 ``block_table``/``cache_seqlens``; ``out [B, s_q, H, 512]``,
``lse [B, H, s_q]`` float32, natural log. ``use_legacy=True`` selects the Hopper (sm90) kernels.

Dense bf16, block size 64, kv_lora_rank 512 + rope 64 only. The split-KV schedule depends on the
values of ``cache_seqlens``, so a fresh ``meta`` is made on every call and FlashMLA computes the
schedule on the GPU inside the call: nothing is read on the host, and a captured graph recomputes
it on every replay with the new lengths. A step's layers can share one schedule instead (one scheduler
launch a step, not one a layer): :func:`flashmla_decode_schedule` makes it from the step's lengths
(``get_mla_decoding_metadata(seq_lens, s_q * H, 1, h_q=H, use_legacy=True)``, on the GPU: inside a captured
step it is made again at every replay), and ``ops.decode(..., backend="flashmla", schedule=)`` hands it to the
call (``mla::decode_flashmla_scheduled``; FlashMLA checks its shapes against the call's batch and heads). At our
boundary the LSE goes ``[B, H, s_q] -> [B, s_q, H]`` and queries that see no row get ``out = 0``, ``lse = -inf``.

fp8 (``mla::decode_fp8``, ``mla::sparse_decode`` on a uint8 cache): our 656-byte rows are FlashMLA's
V3.2 sparse layout byte for byte, passed as ``k_cache.view(float8_e4m3fn)`` ``[blocks, 64, 1, 656]`` to the
sparse decode kernel: ``indices [B, s_q, topk]`` int32 slots (-1 = invalid; FlashMLA checks no upper
bound, so out-of-range slots become -1 here), ``block_table``/``cache_seqlens`` None, ``causal=False``,
``is_fp8_kvcache=True``, topk padded with -1 to a multiple of 64. That kernel takes ``h_q`` 64 or 128
only ("Unsupported h_q: 16" on the H200): q's heads are zero-padded to 64 (H <= 64) or 128 and the
results sliced back (H > 128: one call per 128 heads). FlashMLA's *dense* fp8 kernel is another format
(576 e4m3 bytes per token with per-tensor ``descale_q``/``descale_k`` and an fp8 q, its own
``get_mla_decoding_metadata(..., is_fp8_kvcache=True, use_legacy=True)`` schedule), so ``mla::decode_fp8``
runs the sparse kernel over each query's causal slot list built from the block table. Queries whose
list holds no valid slot get ``out = 0``, ``lse = -inf``.

The CPU contract tests (a fake ``flash_mla`` module that asserts the real interface's requirements)
cover the calls; ``tests/ops/adapters`` has the CUDA tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mla_compile.ops.registry import DEEPSEEK_DECODE, LAYOUT_TAGS, SM90, backends_for, declare, declare_kernels
from mla_compile.ops import fp8_cache
from mla_compile.ops.adapters._common import (check_dtype, check_value, finish_decode, importable,
                                              require_capability)
from mla_compile.ops.decode import OP, validate
from mla_compile.ops.decode import fake as decode_fake
from mla_compile.ops.sparse_decode import OP as SPARSE_OP
from mla_compile.ops.sparse_decode import validate as validate_sparse

BACKEND = "flashmla"
MODULE = "flash_mla"
BLOCK_SIZE = 64
DTYPES = (torch.bfloat16,)


class FlashMLASchedule(NamedTuple):
    """FlashMLA's split-KV schedule of one decode step (:func:`flashmla_decode_schedule`): ``tile_scheduler_metadata
    [num_sm_parts, 8]`` and ``num_splits [B + 1]``, int32 on the step's device. It follows the lengths: made once a
    step, it serves every layer's ``ops.decode(..., backend="flashmla", schedule=)`` of that step."""

    tile_scheduler_metadata: Tensor
    num_splits: Tensor


# FlashMLA's dense decode scheduler (legacy sm90) splits the GPU's SMs into parts of ceil(s_q * H / 64) SMs each (one
# part a 64-row head tile): its schedule holds one 8-int row per part. Off CUDA, where FlashMLA runs only as a test
# double, the SM count is taken to be HOST_SM_COUNT.
SCHEDULE_ROW_TILE = 64
HOST_SM_COUNT = 8


def schedule_parts(device: torch.device | str, num_heads: int, query_len: int = 1) -> int:
    """Rows of FlashMLA's dense decode schedule (``tile_scheduler_metadata [parts, 8]``) on ``device`` for calls of
    ``num_heads`` heads and ``query_len`` queries a sequence: the device's SMs over the SMs a head tile takes. A
    host-side shape, so a compiled graph knows it (no data-dependent size)."""
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else HOST_SM_COUNT
    return max(1, sms // -(-query_len * num_heads // SCHEDULE_ROW_TILE))


def _schedule_skipped(seq_lens: Tensor, query_len: int, min_rows: int, max_rows: int) -> bool:
    """Whether a step of these shapes runs no FlashMLA part (its rows outside ``(min_rows, max_rows]``)."""
    rows = seq_lens.shape[0] * query_len
    return rows <= min_rows or 0 <= max_rows < rows


@torch.library.custom_op("mla::flashmla_decode_schedule", mutates_args=(), tags=LAYOUT_TAGS)
def _decode_schedule(seq_lens: Tensor, num_heads: int, query_len: int, min_rows: int = 0,
                     max_rows: int = -1) -> tuple[Tensor, Tensor]:
    """FlashMLA's schedule of a dense decode step of ``num_heads`` query heads and ``query_len`` queries per
    sequence over the lengths ``seq_lens [B]`` (one KV head: MLA). A step of at most ``min_rows`` or more than
    ``max_rows`` (-1: no bound) query rows gets the tensors unwritten and no scheduler launch: a split that runs
    FlashMLA only between those bounds never reads them."""
    parts = schedule_parts(seq_lens.device, num_heads, query_len)
    if _schedule_skipped(seq_lens, query_len, min_rows, max_rows):
        return (seq_lens.new_empty(parts, 8, dtype=torch.int32),
                seq_lens.new_empty(seq_lens.shape[0] + 1, dtype=torch.int32))
    require_capability(OP, BACKEND, seq_lens.device, (9, 0), (9, 0))
    import flash_mla

    tiles, splits = flash_mla.get_mla_decoding_metadata(seq_lens.to(torch.int32), query_len * num_heads, 1,
                                                        h_q=num_heads, use_legacy=True)
    if tuple(tiles.shape) != (parts, 8):
        raise RuntimeError(f"flashmla_decode_schedule: FlashMLA made a schedule of {list(tiles.shape)} rows, "
                           f"schedule_parts expects [{parts}, 8] ({num_heads} heads, query_len {query_len}): this "
                           f"flash_mla sizes its schedule differently; call ops.decode without schedule=")
    return tiles, splits


@_decode_schedule.register_fake
def _(seq_lens, num_heads, query_len, min_rows=0, max_rows=-1):
    parts = schedule_parts(seq_lens.device, num_heads, query_len)
    return (seq_lens.new_empty(parts, 8, dtype=torch.int32),
            seq_lens.new_empty(seq_lens.shape[0] + 1, dtype=torch.int32))


def flashmla_decode_schedule(seq_lens: Tensor, num_heads: int, query_len: int = 1, *, min_rows: int = 0,
                             max_rows: int = -1) -> FlashMLASchedule:
    """The split-KV schedule FlashMLA's decode would make inside each call, made once for a step's ``seq_lens [B]``
    (int, on the GPU) for calls of ``num_heads`` query heads and ``query_len`` queries per sequence: pass it as
    ``ops.decode(..., backend="flashmla", schedule=)`` to every layer of the step. Capturable (a captured step makes
    it again at every replay, from the new lengths); nothing is read on the host. ``min_rows`` / ``max_rows``: a
    step whose ``B * query_len`` rows are outside ``(min_rows, max_rows]`` (-1: unbounded) gets no scheduler launch
    and a schedule that must not be used (what a split serving only those rows through FlashMLA asks)."""
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"flashmla_decode_schedule: seq_lens must be int32/int64 [B], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    return FlashMLASchedule(*torch.ops.mla.flashmla_decode_schedule(seq_lens, num_heads, query_len, min_rows,
                                                                    max_rows))


def _check_schedule(q: Tensor, schedule: FlashMLASchedule) -> None:
    """The schedule's tensors as FlashMLA takes them: int32 on q's device, ``num_splits [B + 1]``."""
    tiles, splits = schedule
    for name, t, shape in (("schedule.tile_scheduler_metadata", tiles, (None, 8)),
                           ("schedule.num_splits", splits, (q.shape[0] + 1,))):
        if t.dtype != torch.int32 or t.device != q.device or t.dim() != len(shape) or any(
                want is not None and got != want for got, want in zip(t.shape, shape)):
            raise ValueError(f"{OP} (flashmla): {name} must be int32 {['*' if w is None else w for w in shape]} on "
                             f"{q.device} (flashmla_decode_schedule of this step's seq_lens), got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")


def flashmla_decode_core(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                         kv_lora_rank: int, schedule: FlashMLASchedule | None = None) -> tuple[Tensor, Tensor]:
    """The adapter on any tensors (CPU with a fake ``flash_mla`` in tests); ``schedule``: the step's
    (:func:`flashmla_decode_schedule`), else FlashMLA schedules inside the call.

    Returns ``(out [B, s_q, H, Dc], lse [B, s_q, H])`` under our contract.
    """
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    check_dtype(OP, BACKEND, "q", q, DTYPES)
    check_dtype(OP, BACKEND, "kv_cache", kv_cache, DTYPES)
    check_value(OP, BACKEND, "block_size (kv_cache.shape[1])", kv_cache.shape[1], (BLOCK_SIZE,))
    check_value(OP, BACKEND, "kv_lora_rank", kv_lora_rank, (512,))
    check_value(OP, BACKEND, "head dim (q.shape[-1])", q.shape[-1], (576,))
    import flash_mla

    s_q = q.shape[1]
    meta, _ = flash_mla.get_mla_metadata()
    if schedule is not None:
        _check_schedule(q, schedule)
        meta.tile_scheduler_metadata, meta.num_splits = schedule
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, kv_cache.unsqueeze(2), block_table.to(torch.int32), seq_lens.to(torch.int32), kv_lora_rank, meta,
        softmax_scale=scale, causal=s_q > 1, use_legacy=True)
    return finish_decode(out, lse.transpose(1, 2), seq_lens)


@torch.library.custom_op("mla::decode_flashmla", mutates_args=(), tags=LAYOUT_TAGS)
def decode_flashmla(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                    kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode`` through FlashMLA's Hopper kernels (same contract as ``mla::decode_ref``)."""
    require_capability(OP, BACKEND, q.device, (9, 0), (9, 0))
    return flashmla_decode_core(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


decode_flashmla.register_fake(decode_fake)


@torch.library.custom_op("mla::decode_flashmla_scheduled", mutates_args=(), tags=LAYOUT_TAGS)
def decode_flashmla_scheduled(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                              kv_lora_rank: int, tile_scheduler_metadata: Tensor,
                              num_splits: Tensor) -> tuple[Tensor, Tensor]:
    """``mla::decode_flashmla`` with the step's schedule (:class:`FlashMLASchedule`'s tensors) instead of one made
    inside the call."""
    require_capability(OP, BACKEND, q.device, (9, 0), (9, 0))
    return flashmla_decode_core(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank,
                                FlashMLASchedule(tile_scheduler_metadata, num_splits))


decode_flashmla_scheduled.register_fake(decode_fake)
declare_kernels(BACKEND, "mla::flashmla_decode_schedule", "mla::decode_flashmla_scheduled")


def available() -> bool:
    """Whether ``flash_mla`` is installed (found without importing it)."""
    return importable(MODULE)


HOPPER = dict(dtypes=DTYPES, block_sizes=(BLOCK_SIZE,), head_dims=DEEPSEEK_DECODE, min_capability=SM90,
              max_capability=SM90, package="sgl-flash-mla", gpu_tested=True)
declare(OP, BACKEND, torch.ops.mla.decode_flashmla, rank=20, available=available, autotune=True, **HOPPER,
        schedule_fn=torch.ops.mla.decode_flashmla_scheduled, make_schedule=torch.ops.mla.flashmla_decode_schedule,
        note="dense bf16, Hopper kernels (use_legacy=True); takes a step schedule (flashmla_decode_schedule)")

# Query rows (B * s_q) at or below which "flashmla-tiered" runs our Triton kernel: at small batches the
# decode is short and FlashMLA's per-call scheduler and combine launches cost more than they save
# (whole captured steps: Triton ahead at B=1 and 8, FlashMLA from B=64; timings in BENCHMARKS.md).
SMALL_ROWS = 16


@torch.library.custom_op("mla::decode_flashmla_tiered", mutates_args=(), tags=LAYOUT_TAGS)
def decode_flashmla_tiered(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                           kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode`` through FlashMLA, except steps of at most ``SMALL_ROWS`` query rows, which our Triton
    kernel serves. The split is on shapes only (no host read), so one compiled graph holds both and each
    CUDA-graph capture size records the kernel of its size."""
    if q.shape[0] * q.shape[1] <= SMALL_ROWS:
        return backends_for(OP)["triton"].fn(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return decode_flashmla(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


decode_flashmla_tiered.register_fake(decode_fake)


@torch.library.custom_op("mla::decode_flashmla_tiered_scheduled", mutates_args=(), tags=LAYOUT_TAGS)
def decode_flashmla_tiered_scheduled(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                                     kv_lora_rank: int, tile_scheduler_metadata: Tensor,
                                     num_splits: Tensor) -> tuple[Tensor, Tensor]:
    """``mla::decode_flashmla_tiered`` with the step's schedule for its FlashMLA part (made for steps of more than
    ``SMALL_ROWS`` query rows: the Triton part never reads it)."""
    if q.shape[0] * q.shape[1] <= SMALL_ROWS:
        return backends_for(OP)["triton"].fn(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return decode_flashmla_scheduled(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank,
                                     tile_scheduler_metadata, num_splits)


decode_flashmla_tiered_scheduled.register_fake(decode_fake)


def _tiered_available() -> bool:
    from mla_compile.ops.triton import available as triton_available
    return available() and triton_available()


declare(OP, "flashmla-tiered", torch.ops.mla.decode_flashmla_tiered, rank=10, available=_tiered_available,
        tiers=((SMALL_ROWS, "triton"), (None, BACKEND)), **HOPPER,
        schedule_fn=torch.ops.mla.decode_flashmla_tiered_scheduled,
        note=f"FlashMLA, with steps of <= {SMALL_ROWS} query rows (B * s_q) on our Triton kernel")
declare_kernels("flashmla-tiered", "mla::decode_flashmla_tiered_scheduled")


# ------------------------------------------------------------------------------------------ fp8 / sparse

FP8_ROW_BYTES = 656
TOPK_TILE = 64  # FlashMLA's sparse kernels walk the index list in tiles of 64
SPARSE_HEADS = (64, 128)  # the h_q FlashMLA's sparse decode accepts


def _fp8_k_cache(op: str, kv_cache: Tensor) -> Tensor:
    """Our uint8 ``[NB, 64, 656]`` fp8 cache as FlashMLA's ``float8_e4m3fn [NB, 64, 1, 656]`` (a view, no copy)."""
    check_value(op, BACKEND, "block_size (kv_cache.shape[1])", kv_cache.shape[1], (BLOCK_SIZE,))
    if kv_cache.stride(-1) != 1 or kv_cache.stride(1) != FP8_ROW_BYTES:
        raise ValueError(f"{op}: backend {BACKEND!r} needs densely packed 656-byte rows, got kv_cache strides "
                         f"{tuple(kv_cache.stride())}; allocate the cache contiguous or use backend='triton'")
    return kv_cache.view(torch.float8_e4m3fn).unsqueeze(2)


# FlashMLA's sparse decode schedule follows the call's shapes only (batch, queries, heads, index-list width: neither
# lengths nor a topk_length enter it here), so the one an eager call made serves every later call of the same shapes
# instead of a scheduler launch a call (a call being captured schedules itself and is not kept: its schedule is
# written only when the graph replays).
REUSE_SPARSE_SCHEDULE = True
_SPARSE_SCHEDULES: dict[tuple, tuple[Tensor, Tensor]] = {}


def _capturing(t: Tensor) -> bool:
    """Whether ``t``'s device stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _head_groups(H: int) -> tuple[int, list[tuple[int, int]]]:
    """FlashMLA's sparse kernels take ``h_q`` 64 or 128 only ("Unsupported h_q" otherwise): the padded
    head count and the ``(start, stop)`` head ranges, one sparse call each (a single call for H <= 128)."""
    width = SPARSE_HEADS[0] if H <= SPARSE_HEADS[0] else SPARSE_HEADS[1]
    return width, [(h, min(h + width, H)) for h in range(0, H, width)]


def _sparse_call(q: Tensor, k_cache: Tensor, idx: Tensor, scale: float, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """FlashMLA sparse decode on ``q [B, s_q, H, 576]`` for any H: heads zero-padded to 64 / 128 (padded
    rows are computed and dropped), ``idx`` int32 with -1 padding. Returns ``out [B, s_q, H, 512]``,
    ``lse [B, s_q, H]`` as FlashMLA gives them (undefined for queries without a valid slot)."""
    import flash_mla

    B, s_q, H, D = q.shape
    width, groups = _head_groups(H)
    key = (q.device, B, s_q, width, idx.shape[-1])
    outs, lses = [], []
    for h0, h1 in groups:
        qg = q[:, :, h0:h1]
        if h1 - h0 != width:
            qg = torch.cat([qg, qg.new_zeros(B, s_q, width - (h1 - h0), D)], dim=2)
        meta, _ = flash_mla.get_mla_metadata()
        kept = _SPARSE_SCHEDULES.get(key) if REUSE_SPARSE_SCHEDULE else None
        if kept is not None:
            meta.tile_scheduler_metadata, meta.num_splits = kept
        out, lse = flash_mla.flash_mla_with_kvcache(
            qg.contiguous(), k_cache, None, None, kv_lora_rank, meta, softmax_scale=scale, causal=False,
            is_fp8_kvcache=True, indices=idx, use_legacy=True)
        if REUSE_SPARSE_SCHEDULE and kept is None and meta.tile_scheduler_metadata is not None and not _capturing(q):
            _SPARSE_SCHEDULES[key] = (meta.tile_scheduler_metadata, meta.num_splits)
        outs.append(out[:, :, :h1 - h0])
        lses.append(lse[:, :h1 - h0].transpose(1, 2))  # [B, h, s_q] -> [B, s_q, h]
    if len(groups) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _sparse_finish(out: Tensor, lse: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Our contract for queries whose list holds no valid slot: ``out = 0``, ``lse = -inf``."""
    live = (idx >= 0).any(dim=-1)  # [B, s_q]
    out = torch.where(live[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    lse = torch.where(live[:, :, None], lse.to(torch.float32), float("-inf"))
    return out.contiguous(), lse.contiguous()


def _pad_topk(idx: Tensor) -> Tensor:
    """-1 padding of the last dim to a positive multiple of FlashMLA's index tile (64)."""
    pad = -idx.shape[-1] % TOPK_TILE
    if pad or idx.shape[-1] == 0:
        idx = torch.nn.functional.pad(idx, (0, pad or TOPK_TILE), value=-1)
    return idx.contiguous()


def dense_indices(block_table: Tensor, seq_lens: Tensor, s_q: int, block_size: int) -> Tensor:
    """``[B, s_q, capacity]`` int32 slot lists of dense causal decode: query i of sequence b lists the slots
    of positions ``< seq_lens[b] - (s_q - 1 - i)`` in order, -1 after (shape-only, capture-safe)."""
    B, nbt = block_table.shape
    pos = torch.arange(nbt * block_size, device=block_table.device)
    slots = block_table.long()[:, pos // block_size] * block_size + pos % block_size  # [B, capacity]
    limit = seq_lens.long()[:, None] - (s_q - 1 - torch.arange(s_q, device=seq_lens.device))  # [B, s_q]
    visible = pos[None, None, :] < limit[:, :, None]
    return torch.where(visible, slots[:, None, :], -1).to(torch.int32)


def flashmla_decode_fp8_core(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                             kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode_fp8`` through FlashMLA on any tensors (CPU with a fake ``flash_mla`` in tests).

    FlashMLA's dense fp8 kernel reads another format (576 e4m3 bytes per token, per-tensor
    ``descale_q``/``descale_k``, fp8 q), not the 656-byte rows: dense decode runs as sparse decode
    (the V3.2 kernel, which reads our rows byte for byte) over each query's causal slot list. That kernel
    refuses ``topk_length`` ("V3.2 does not support dynamic topk length"), so it runs over the block table's
    whole width: its cost follows the table's capacity, not the lengths.
    """
    op = fp8_cache.OP_DECODE
    fp8_cache.validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    check_dtype(op, BACKEND, "q", q, DTYPES)
    check_value(op, BACKEND, "kv_lora_rank", kv_lora_rank, (512,))
    check_value(op, BACKEND, "head dim (q.shape[-1])", q.shape[-1], (576,))
    k_cache = _fp8_k_cache(op, kv_cache)
    idx = _pad_topk(dense_indices(block_table, seq_lens, q.shape[1], BLOCK_SIZE))
    out, lse = _sparse_call(q, k_cache, idx, scale, kv_lora_rank)
    return _sparse_finish(out, lse, idx)


def flashmla_sparse_decode_core(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float,
                                kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::sparse_decode`` through FlashMLA's fp8 sparse kernel on any tensors (fake ``flash_mla`` in tests).

    Any head count (padded to 64 / 128 per call); slots outside ``[0, num_blocks * 64)`` become -1
    (FlashMLA checks no upper bound), matching the Triton kernel.
    """
    op = SPARSE_OP
    validate_sparse(q, kv_cache, indices, kv_lora_rank)
    check_dtype(op, BACKEND, "q", q, DTYPES)
    check_dtype(op, BACKEND, "kv_cache", kv_cache, (torch.uint8,))
    check_value(op, BACKEND, "kv_lora_rank", kv_lora_rank, (512,))
    check_value(op, BACKEND, "head dim (q.shape[-1])", q.shape[-1], (576,))
    k_cache = _fp8_k_cache(op, kv_cache)
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    idx = torch.where((indices >= 0) & (indices < n_slots), indices, -1).to(torch.int32)
    idx = _pad_topk(idx)
    out, lse = _sparse_call(q, k_cache, idx, scale, kv_lora_rank)
    return _sparse_finish(out, lse, idx)


@torch.library.custom_op("mla::decode_fp8_flashmla", mutates_args=(), tags=LAYOUT_TAGS)
def decode_fp8_flashmla(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                        kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::decode_fp8`` through FlashMLA's fp8 kernels (same contract as ``mla::decode_fp8_ref``)."""
    require_capability(fp8_cache.OP_DECODE, BACKEND, q.device, (9, 0), (9, 0))
    return flashmla_decode_fp8_core(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


@decode_fp8_flashmla.register_fake
def _(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank):
    fp8_cache.validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, kv_lora_rank), q.new_empty(B, s_q, H, dtype=torch.float32)


@torch.library.custom_op("mla::sparse_decode_flashmla", mutates_args=(), tags=LAYOUT_TAGS)
def sparse_decode_flashmla(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float,
                           kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """``mla::sparse_decode`` through FlashMLA's fp8 sparse kernel (same contract as ``mla::sparse_decode_ref``)."""
    require_capability(SPARSE_OP, BACKEND, q.device, (9, 0), (9, 0))
    return flashmla_sparse_decode_core(q, kv_cache, indices, scale, kv_lora_rank)


@sparse_decode_flashmla.register_fake
def _(q, kv_cache, indices, scale, kv_lora_rank):
    validate_sparse(q, kv_cache, indices, kv_lora_rank)
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, kv_lora_rank), q.new_empty(B, s_q, H, dtype=torch.float32)


FP8 = dict(HOPPER, cache_dtypes=(torch.uint8,), packed_rows=True)
declare(fp8_cache.OP_DECODE, BACKEND, torch.ops.mla.decode_fp8_flashmla, rank=30, available=available, **FP8,
        cost="capacity", note="FlashMLA's sparse fp8 kernel over each query's causal slot list, the block table's "
                              "whole width (it refuses topk_length): its time follows the table's capacity")
declare(SPARSE_OP, BACKEND, torch.ops.mla.sparse_decode_flashmla, rank=20, available=available, **FP8,
        note="FlashMLA's sparse fp8 kernel (fp8 cache only; heads padded to 64 / 128)")
