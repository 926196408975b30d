"""The DeepSeek fp8 latent cache: quantizing write, dequantizing gather and decode reading it directly.

Format: the cache is ``uint8 [num_blocks, block_size, W]`` with ``W = Dc + 4 * Dc / 128 + 2 * Dr`` bytes
per token (656 for Dc = kv_lora_rank = 512, Dr = rope_dim = 64; see ``mla_compile.models.cache.fp8_row_bytes``):

- bytes ``[0, Dc)``: the latent as float8 e4m3fn, ``round(x / s_g)`` for x in group g of 128 values;
- bytes ``[Dc, Dc + 4 * Dc / 128)``: one float32 scale per group, ``s_g = max(amax_g / 448, 2**-64)``;
- bytes ``[Dc + 4 * Dc / 128, W)``: k_pe as bfloat16 (not quantized).

Multi-byte fields are in the host's byte order (little-endian on every supported machine), as FlashMLA
reads them. 448 is e4m3fn's largest finite value; quotients are clamped to +-448 before the cast, as
float32 rounding of ``x / s_g`` can land a hair above it. The floor 2**-64 (about 5.4e-20) keeps an
all-zero group (padding, zeroed rows) from getting scale 0, which would make ``0 / 0`` NaN; any group
with ``amax_g < 448 * 2**-64`` is stored on the absolute grid of the floor instead of a relative one.
Inputs must be finite. Dequantization is ``float32(e4m3) * s_g``.

Error bounds (per element, against the float32 value written; bf16 inputs are exact in float32):
e4m3 keeps 3 mantissa bits, so a quotient in e4m3's normal range (>= 2**-6) is off by at most 2**-4
of itself, and a subnormal one by at most half the subnormal step 2**-9. Hence
``|dequant(x) - x| <= 2**-4 * |x| + 2**-10 * s_g`` (the second term is ``amax_g * 2.2e-6``), plus float32
rounding. k_pe is rounded to bfloat16 (relative error <= 2**-9; exact for bf16 inputs).

Decode against the bf16 path, measured on the CPU reference (DeepSeek dims 512 + 64, 16 heads, scale
192**-0.5, N(0, 1) bf16 latents, k_pe and queries, 4 sequences of 70-320 tokens, 12 seeds): the fp8
output differs from the bf16 output by 3.9-4.6% normwise (``||out_fp8 - out_bf16|| / ||out_bf16||``),
by at most 2.6-6.6% of ``max |out_bf16|`` elementwise, and the LSEs by at most 0.046. The error is the
value quantization (about 2.6% RMS relative per latent) plus the score shifts from quantized keys; it
does not grow with length (8 sequences of 1024-4096 tokens, 2 seeds: 3.5-3.7% normwise, at most 6.6%
of max |out|, LSE 0.011). ``tests/ops/test_fp8_cache.py``
asserts normwise <= 0.08, elementwise <= 0.15 * max |out_bf16| and LSE <= 0.1. The reference and Triton
fp8 decodes match a float64 decode over the dequantized rows to float32 rounding; the Gluon decodes (the
CUDA default where ``gluon_eligible``) run their dots in float16 with the queries scaled by a power of two:
on sm_90 (pages of 64) the ``wgmma`` kernel rounds each dequantized value once (relative 2**-11),
saturating at float16's 65504 (a group's scale is clamped; scales of groups whose largest magnitude is below
0.027 are float16-subnormal); elsewhere the group-split kernel multiplies exact codes and applies the fp32
scales to the scores and probabilities (scales clamped at 255). Both stay within the sparse fp8 path's
tolerances and tighter on data far from 1 (``tests/ops/triton/test_gluon_fp8_decode.py``). Backend "gluon64"
(sm_90, 64 query rows a program) dequantizes each tile to bf16 (``bf16(float32(code) * scale)``: within
``2**-9 + 2**-24`` relative of the float64 value, float32's exponent range, no clamping) and runs the bf16
decode's ``wgmma`` pipeline (``tests/ops/triton/test_gluon_fp8_decode64.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._fp8_format import FP8_GROUP, fp8_row_bytes
from mla_compile.ops._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_range, check_same_device, check_tensor,
                                     data_checks_enabled)
from mla_compile.ops.registry import (FLOATS, LAYOUT_TAGS, SM89, SM90, backends_for, declare, declare_op,
                                      declare_split_op, run_split_part)
from mla_compile.ops.select import Facts, cache_layout, facts_for, resolve, why_not
from mla_compile.ops._paged import (attend, check_paged_data, decode_shape, ragged_rows, scatter_rows,
                                    sequence_slots)
from mla_compile.ops._ragged import segments

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 2.0 ** -64  # smallest group scale: all-zero groups get this, never 0

OP_WRITE = declare_op("cache_write_fp8", "mla.write_latent_cache_fp8")
OP_GATHER = declare_op("gather_fp8", "mla.gather_latent_cache_fp8")
OP_DECODE = declare_op("decode_fp8", "mla.decode_fp8", cache=True)
FP8_CACHE = (torch.uint8,)


# ------------------------------------------------------------------------------------------- format

def quantize_fp8_rows(latent: Tensor, k_pe: Tensor) -> Tensor:
    """``latent [..., Dc]`` (Dc a multiple of 128) and ``k_pe [..., Dr]``, any float dtype, to fp8 rows
    ``uint8 [..., Dc + Dc / 32 + 2 * Dr]`` in the format of the module docstring."""
    Dc = latent.shape[-1]
    if Dc % FP8_GROUP:
        raise ValueError(f"quantize_fp8_rows: latent's last dim must be a multiple of {FP8_GROUP}, got {Dc}")
    groups = latent.float().unflatten(-1, (Dc // FP8_GROUP, FP8_GROUP))
    amax = groups.abs().amax(dim=-1)
    # a tensor divisor: CUDA torch turns division by a Python scalar into a multiply by its (inexact)
    # reciprocal, which moves some scales by an ulp against the correctly rounded amax / 448
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_FLOOR)
    values = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(-2)
    return torch.cat([values.view(torch.uint8), scale.contiguous().view(torch.uint8),
                      k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)], dim=-1)


def dequantize_fp8_rows(rows: Tensor, kv_lora_rank: int = 512) -> tuple[Tensor, Tensor]:
    """fp8 rows ``uint8 [..., W]`` to ``(latent float32 [..., kv_lora_rank], k_pe float32 [..., Dr])``."""
    G = kv_lora_rank // FP8_GROUP
    rope_bytes = rows.shape[-1] - kv_lora_rank - 4 * G
    if kv_lora_rank <= 0 or kv_lora_rank % FP8_GROUP or rope_bytes < 0 or rope_bytes % 2:
        raise ValueError(f"dequantize_fp8_rows: rows of {rows.shape[-1]} bytes do not hold kv_lora_rank="
                         f"{kv_lora_rank} (a positive multiple of {FP8_GROUP}) plus a bf16 rope part")
    values = rows[..., :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., kv_lora_rank:kv_lora_rank + 4 * G].contiguous().view(torch.float32)
    k_pe = rows[..., kv_lora_rank + 4 * G:].contiguous().view(torch.bfloat16).float()
    latent = (values.unflatten(-1, (G, FP8_GROUP)) * scale[..., None]).flatten(-2)
    return latent, k_pe


def _dequantized(rows: Tensor, kv_lora_rank: int) -> Tensor:
    """fp8 rows ``[..., W]`` to float32 ``[..., Dc + Dr]`` (``[latent | k_pe]``)."""
    return torch.cat(dequantize_fp8_rows(rows, kv_lora_rank), dim=-1)


def _rank_for(op: str, width: int, dim: int) -> int:
    """The kv_lora_rank whose fp8 rows of ``width`` bytes dequantize to ``dim`` values, or a ValueError."""
    # width = Dc + Dc / 32 + 2 * (dim - Dc)  <=>  Dc = 32 * (2 * dim - width) / 31
    num = 32 * (2 * dim - width)
    rank = num // 31
    if num % 31 or rank <= 0 or rank % FP8_GROUP or rank > dim:
        raise ValueError(f"{op}: kv_cache rows of {width} bytes do not match out's {dim} columns in the fp8 format "
                         f"(kv_lora_rank + kv_lora_rank / 32 + 2 * rope_dim bytes, kv_lora_rank a multiple of "
                         f"{FP8_GROUP}; 656 bytes for 512 + 64 columns)")
    return rank


# ------------------------------------------------------------------------------------------- write

def validate_write(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor, op: str = OP_WRITE) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode. Raises before any write.
    ``op`` names the op in the errors (the fused write reuses these checks)."""
    check_tensor(op, "latent", latent, ndim=2, dtypes=FLOAT_DTYPES, expected="[T, kv_lora_rank]")
    T, Dc = latent.shape
    if Dc == 0 or Dc % FP8_GROUP:
        raise ValueError(f"{op}: latent's last dim (kv_lora_rank) must be a positive multiple of {FP8_GROUP} "
                         f"for the fp8 format, got {Dc}")
    check_tensor(op, "k_pe", k_pe, ndim=2, dtypes=FLOAT_DTYPES, shape=(T, None), expected="[T, rope_dim]")
    check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, shape=(T,),
                 expected="[T] int32/int64")
    W = fp8_row_bytes(Dc, k_pe.shape[1])
    check_tensor(op, "kv_cache", kv_cache, ndim=3, dtypes=(torch.uint8,), shape=(None, None, W),
                 expected=f"[num_blocks, block_size, {W}] uint8 fp8 rows for {Dc} + {k_pe.shape[1]}")
    check_same_device(op, latent=latent, k_pe=k_pe, slot_mapping=slot_mapping, kv_cache=kv_cache)
    if data_checks_enabled(slot_mapping):
        check_range(op, "slot_mapping", slot_mapping, 0, kv_cache.shape[0] * kv_cache.shape[1], ignore=-1,
                    what="num_blocks * block_size, or -1 for padding")


@torch.library.custom_op("mla::write_latent_cache_fp8_ref", mutates_args=("kv_cache",), tags=LAYOUT_TAGS)
def write_latent_cache_fp8_ref(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor) -> None:
    """Reference (plain torch, any device, no host sync): quantize every row, scatter the valid ones."""
    validate_write(latent, k_pe, slot_mapping, kv_cache)
    scatter_rows(kv_cache, slot_mapping, quantize_fp8_rows(latent, k_pe))


@write_latent_cache_fp8_ref.register_fake
def _(latent, k_pe, slot_mapping, kv_cache):
    validate_write(latent, k_pe, slot_mapping, kv_cache)
    return None


declare(OP_WRITE, "reference", torch.ops.mla.write_latent_cache_fp8_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch")


def write_latent_cache_fp8(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor, *,
                           backend: str | None = None) -> None:
    """Quantize ``latent [T, Dc]`` and ``k_pe [T, Dr]`` into the fp8 cache ``uint8 [NB, BS, W]`` at
    ``slot_mapping [T]`` (-1 = padding, skipped). Mutates ``kv_cache``; returns None."""
    resolve(OP_WRITE, kv_cache.device, backend, dtype=latent.dtype).fn(latent, k_pe, slot_mapping, kv_cache)


# ------------------------------------------------------------------------------------------- gather

def validate_gather(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor,
                    out: Tensor) -> int:
    """Shape/dtype checks (no sync) and data checks on CPU or in checked mode; returns kv_lora_rank."""
    check_tensor(OP_GATHER, "kv_cache", kv_cache, ndim=3, dtypes=(torch.uint8,),
                 expected="[num_blocks, block_size, W] uint8 fp8 rows")
    check_tensor(OP_GATHER, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, expected="[N, max_blocks] int32")
    N = block_table.shape[0]
    check_tensor(OP_GATHER, "cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES, shape=(N + 1,),
                 expected=f"[{N + 1}] int32")
    check_tensor(OP_GATHER, "seq_starts", seq_starts, ndim=1, dtypes=INDEX_DTYPES, shape=(N,), expected=f"[{N}] int32")
    check_tensor(OP_GATHER, "out", out, ndim=2, dtypes=FLOAT_DTYPES, expected="[S, kv_lora_rank + rope_dim] workspace")
    rank = _rank_for(OP_GATHER, kv_cache.shape[2], out.shape[1])
    check_same_device(OP_GATHER, kv_cache=kv_cache, block_table=block_table, cu_seqlens=cu_seqlens,
                      seq_starts=seq_starts, out=out)
    if data_checks_enabled(cu_seqlens):
        S, bs = out.shape[0], kv_cache.shape[1]
        if int(cu_seqlens[0]) != 0 or bool((cu_seqlens.diff() < 0).any()) or int(cu_seqlens[-1]) > S:
            raise ValueError(f"{OP_GATHER}: cu_seqlens must start at 0, be non-decreasing and end at most at the "
                             f"workspace size {S}, got {cu_seqlens.tolist()}")
        capacity = block_table.shape[1] * bs
        check_range(OP_GATHER, "seq_starts", seq_starts, 0, capacity + 1, what=f"token positions, at most {capacity}")
        check_range(OP_GATHER, "seq_starts + lengths", seq_starts.long() + cu_seqlens.diff().long(), 0, capacity + 1,
                    what=f"token ranges must end within max_blocks * block_size = {capacity}")
        seq, loc = segments(cu_seqlens, S)
        live = seq < N
        pos = seq_starts.long()[seq[live]] + loc[live]
        check_range(OP_GATHER, "block_table", block_table.long()[seq[live], pos // bs], 0, kv_cache.shape[0],
                    what=f"block ids of gathered rows, num_blocks = {kv_cache.shape[0]}")
    return rank


@torch.library.custom_op("mla::gather_latent_cache_fp8_ref", mutates_args=("out",), tags=LAYOUT_TAGS)
def gather_latent_cache_fp8_ref(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor,
                                out: Tensor) -> None:
    """Reference (plain torch, any device, no host sync): gather fp8 rows, dequantize, zero padding rows."""
    rank = validate_gather(kv_cache, block_table, cu_seqlens, seq_starts, out)
    N, bs = block_table.shape[0], kv_cache.shape[1]
    if N == 0:
        out.zero_()
        return
    blocks, offsets, live = ragged_rows(block_table, cu_seqlens, seq_starts, out.shape[0], bs)
    rows = _dequantized(kv_cache[blocks, offsets], rank)
    out.copy_(torch.where(live[:, None], rows.to(out.dtype), 0))


@gather_latent_cache_fp8_ref.register_fake
def _(kv_cache, block_table, cu_seqlens, seq_starts, out):
    validate_gather(kv_cache, block_table, cu_seqlens, seq_starts, out)
    return None


declare(OP_GATHER, "reference", torch.ops.mla.gather_latent_cache_fp8_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch")


def gather_latent_cache_fp8(kv_cache: Tensor, block_table: Tensor, cu_seqlens: Tensor, seq_starts: Tensor,
                            out: Tensor, *, backend: str | None = None) -> None:
    """Dequantizing gather: the contract of ``mla_compile.ops.gather_latent_cache`` with an fp8 cache
    ``uint8 [NB, BS, W]``; ``out [S, Dc + Dr]`` (float dtype, mutated) receives ``[latent | k_pe]`` rows."""
    resolve(OP_GATHER, kv_cache.device, backend, dtype=out.dtype).fn(kv_cache, block_table, cu_seqlens, seq_starts, out)


# ------------------------------------------------------------------------------------------- decode

def validate_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, kv_lora_rank: int) -> None:
    """Shape/dtype checks (no sync); data checks on CPU or in checked mode."""
    check_tensor(OP_DECODE, "q", q, ndim=4, dtypes=FLOAT_DTYPES, expected="[B, s_q, H, kv_lora_rank + rope_dim]")
    B, s_q, H, D = q.shape
    if not 0 < kv_lora_rank <= D or kv_lora_rank % FP8_GROUP:
        raise ValueError(f"{OP_DECODE}: kv_lora_rank must be a multiple of {FP8_GROUP} in (0, {D}] (the fp8 "
                         f"format quantizes groups of {FP8_GROUP} latents), got {kv_lora_rank}")
    W = fp8_row_bytes(kv_lora_rank, D - kv_lora_rank)
    check_tensor(OP_DECODE, "kv_cache", kv_cache, ndim=3, dtypes=(torch.uint8,), shape=(None, None, W),
                 expected=f"[num_blocks, block_size, {W}] uint8 fp8 rows for {kv_lora_rank} + {D - kv_lora_rank}")
    check_tensor(OP_DECODE, "block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, shape=(B, None),
                 expected="[B, max_blocks] int32")
    check_tensor(OP_DECODE, "seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, shape=(B,), expected="[B] int32")
    check_same_device(OP_DECODE, q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    if data_checks_enabled(seq_lens):
        check_paged_data(OP_DECODE, block_table, seq_lens, kv_cache.shape[1], kv_cache.shape[0])


@torch.library.custom_op("mla::decode_fp8_ref", mutates_args=(), tags=LAYOUT_TAGS)
def decode_fp8_ref(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                   kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Reference (plain torch, any device): gather the fp8 rows of every position, dequantize, mask, softmax."""
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, s_q, H, D = q.shape
    slots, valid, pos = sequence_slots(block_table, seq_lens, kv_cache.shape[1])
    rows = _dequantized(kv_cache.reshape(-1, kv_cache.shape[2])[slots], kv_lora_rank).to(acc)
    rows = torch.where(valid[..., None], rows, 0)  # unwritten rows may hold NaN bytes
    # query i of s_q sees positions < seq_len - (s_q - 1 - i), as in mla::decode
    limit = seq_lens[:, None].long() - (s_q - 1 - torch.arange(s_q, device=q.device))[None, :]
    visible = pos[None, None, :] < limit[..., None]
    return attend(q, rows[:, None], visible, scale, kv_lora_rank)


def decode_fake(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, *split_args):
    """Fake of ``mla::decode_fp8_ref`` and ``mla::decode_fp8_split`` (``split_args``: its tiers and plan id)."""
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, kv_lora_rank), q.new_empty(B, s_q, H, dtype=torch.float32)


decode_fp8_ref.register_fake(decode_fake)


@torch.library.custom_op("mla::decode_fp8_split", mutates_args=(), tags=LAYOUT_TAGS)
def decode_fp8_split(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                     kv_lora_rank: int, tiers: str, plan_id: int) -> tuple[Tensor, Tensor]:
    """``mla::decode_fp8`` through the part of ``tiers`` (``"gluon64:16/flashmla"``: see
    :func:`~mla_compile.ops.registry.split_name`) whose row bound covers this call's ``B * s_q`` query rows."""
    return run_split_part(OP_DECODE, tiers, q.shape[0] * q.shape[1],
                          (q, kv_cache, block_table, seq_lens, scale, kv_lora_rank), plan_id)


decode_fp8_split.register_fake(decode_fake)
declare_split_op(OP_DECODE, torch.ops.mla.decode_fp8_split, "batch")


declare(OP_DECODE, "reference", torch.ops.mla.decode_fp8_ref, rank=100, devices=("any",), dtypes=FLOATS,
        cache_dtypes=FP8_CACHE, gpu_tested=True, note="plain torch, the numerical ground truth")


def gluon_eligible(q: Tensor, kv_cache: Tensor, kv_lora_rank: int) -> bool:
    """Whether the Gluon fp8 decodes (backend "gluon", ``ops/triton/fp8_decode_gluon.py``, ``fp8_decode_tma.py``,
    ``fp8_decode_wgmma.py``) serve this call, from its declaration (static properties only, no guard on the
    batch): CUDA sm_89+ with Triton, bf16 q ``[B, s_q, H, 576]`` with any number of query rows, DeepSeek's
    512 + 64 split, pages of a multiple of 32 rows, 16-byte aligned row and page strides."""
    return why_not(backends_for(OP_DECODE)["gluon"], _decode_facts(q, kv_cache, kv_lora_rank)) is None


def _decode_facts(q: Tensor, kv_cache: Tensor, kv_lora_rank: int) -> Facts:
    align, packed = cache_layout(kv_cache.stride(), kv_cache.shape[-1])
    return facts_for(q.device, q.dtype, cache_dtype=kv_cache.dtype, block_size=kv_cache.shape[1], num_heads=q.shape[2],
                     head_dims=(kv_lora_rank, q.shape[-1] - kv_lora_rank), query_len=q.shape[1],
                     cache_align=align, packed_rows=packed)


def decode_fp8(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, *,
               kv_lora_rank: int = 512, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Absorbed MLA decode over the fp8 cache ``uint8 [NB, BS, W]``: the contract of
    ``mla_compile.ops.decode`` (q ``[B, s_q, H, D]`` or ``[B, H, D]``; out in q's dtype, lse float32).
    ``backend``: None/"auto" (the selector's choice), or a declared backend name."""
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(1) if squeeze else q
    impl = resolve(OP_DECODE, q.device, backend, dtype=q4.dtype, cache=kv_cache,
                   shape=lambda: decode_shape(q4, kv_cache, block_table, kv_lora_rank))
    out, lse = impl.fn(q4, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return (out.squeeze(1), lse.squeeze(1)) if squeeze else (out, lse)


# Triton backends: their modules (and Triton) are imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton_write(latent: Tensor, k_pe: Tensor, slot_mapping: Tensor, kv_cache: Tensor) -> None:
    import mla_compile.ops.triton.fp8_cache_write  # noqa: F401  (registers mla::write_latent_cache_fp8_triton)
    torch.ops.mla.write_latent_cache_fp8_triton(latent, k_pe, slot_mapping, kv_cache)


def _triton_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                   kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.fp8_decode  # noqa: F401  (registers mla::decode_fp8_triton)
    return torch.ops.mla.decode_fp8_triton(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


declare(OP_WRITE, "triton", _triton_write, rank=10, available=_triton_available, dtypes=FLOATS, package="triton",
        gpu_tested=True, kernels=("write_latent_cache_fp8_triton", "_fp8_write_kernel"), note="ours")
declare(OP_DECODE, "triton", _triton_decode, rank=20, available=_triton_available, dtypes=FLOATS,
        cache_dtypes=FP8_CACHE, package="triton", gpu_tested=True,
        kernels=("decode_fp8_triton", "_decode_fp8_split_kernel"), note="ours; any shape the format allows")


def _gluon_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                  kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    why = why_not(backends_for(OP_DECODE)["gluon"], _decode_facts(q, kv_cache, kv_lora_rank))
    if why:
        raise ValueError(f"mla.decode_fp8: backend 'gluon' takes bf16 q [B, s_q, H, 576], kv_lora_rank 512, pages "
                         f"of a multiple of 32 rows with 16-byte aligned strides, on sm_89+; got q {q.dtype} "
                         f"{tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)} strides {tuple(kv_cache.stride())} on "
                         f"{q.device} ({why}); use backend='triton'")
    import mla_compile.ops.triton.fp8_decode_gluon  # noqa: F401  (registers mla::decode_fp8_gluon)
    return torch.ops.mla.decode_fp8_gluon(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


declare(OP_DECODE, "gluon", _gluon_decode, rank=10, available=_triton_available, dtypes=(torch.bfloat16,),
        cache_dtypes=FP8_CACHE, block_multiple=32, stride_align=16, head_dims=((512, 64),), min_capability=SM89,
        package="triton", gpu_tested=True, kernels=("decode_fp8_gluon=gluon (opaque kernel)",),
        note="ours (Gluon: sm_90 TMA / wgmma, else mma.sync); bf16 q, 512 + 64, pages of a multiple of 32")


def _gluon64_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                    kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    import mla_compile.ops.triton.fp8_decode_gluon64  # noqa: F401  (registers mla::decode_fp8_gluon64)
    return torch.ops.mla.decode_fp8_gluon64(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


# GPU-tested (BENCHMARKS.md run 128); "auto" takes it where the measured timings (ops/backend_timings) say so.
declare(OP_DECODE, "gluon64", _gluon64_decode, rank=40, available=_triton_available, dtypes=(torch.bfloat16,),
        cache_dtypes=FP8_CACHE, block_multiple=64, stride_align=16, head_dims=((512, 64),), min_capability=SM90,
        max_capability=SM90, package="triton", gpu_tested=True,
        kernels=("decode_fp8_gluon64=gluon64 (opaque kernel)", "decode_fp8_gluon64_kernel"),
        note="ours (Gluon, sm_90: 64 query rows a program, tiles dequantized to bf16 in shared memory, wgmma); "
             "bf16 q, 512 + 64, pages of a multiple of 64")
