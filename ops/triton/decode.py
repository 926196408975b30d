"""Triton split-KV flash-decoding for ``mla::decode`` (absorbed MLA over the paged latent cache).

One program owns ``BLOCK_H`` query rows of one sequence (the ``s_q * H`` rows of a sequence are
folded into one row axis, each row with its own causal limit) and one contiguous range of the
sequence's positions (a split). Each KV tile is gathered through the block table once and used by
all of the program's rows: ``[latent | k_pe]`` rows give the scores through two ``tl.dot`` (512 and
64 wide for DeepSeek) and the latent part is the value of the second ``tl.dot``. Scores are in
log2 units (``scale * log2(e)``) so the softmax uses ``exp2``. With one split the kernel writes the
result; otherwise each split writes a normalized partial and its base-2 LSE to a workspace and a
second kernel merges them. The split count comes from shapes and the multiprocessor count only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from mla_compile.ops.decode import validate
from mla_compile.ops.triton._common import (decode_program, dot_two_part, last_dim_contiguous, num_sms,
                                             online_softmax_step, paged_rows, pow2, split_count)
from mla_compile.ops.triton._pdl import OFF, launch_kwargs, pdl_launch_dependents, pdl_wait
from mla_compile.ops.triton._plan import split_buffers, split_plan
from mla_compile.ops.triton.fp8_decode_kernel import _decode_fp8_split_kernel

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt,
    stride_bt,
    M, H, S_Q, n_splits, split_cap, DC: tl.constexpr, DR: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    PAGE_TILES: tl.constexpr,
):
    scale_log2 = tl.full([], scale_log2, tl.float32)  # Inductor passes Python floats as fp64
    b = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    pid_s, n_used, start, end, rows, row_ok, qi, limit = decode_program(b, seq_len, n_splits, split_cap, M, H, S_Q,
                                                                        BLOCK_H, BLOCK_N)
    if pid_s >= n_used:
        return
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    c_ok = offs_c < DC
    r_ok = offs_r < DR
    if PAGE_TILES:  # no padded columns (``_pick`` checks): the loads' masks are per row only
        c_ok = tl.full([BLOCK_DC], 1, tl.int1)
        r_ok = tl.full([BLOCK_DR], 1, tl.int1)

    q_row = q_ptr + b * stride_qb + qi.to(tl.int64) * stride_qs + (rows % H).to(tl.int64) * stride_qh
    q_c = tl.load(q_row[:, None] + offs_c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_row[:, None] + DC + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    q_c = q_c.to(kv_ptr.dtype.element_ty)  # compute in the cache's dtype
    q_r = q_r.to(kv_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos, pos_ok, kv_row = paged_rows(bt_row, kv_ptr, n0, end, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N,
                                         PAGE_TILES)
        k_c = tl.load(kv_row[:, None] + offs_c[None, :], mask=pos_ok[:, None] & c_ok[None, :], other=0.0)
        k_r = tl.load(kv_row[:, None] + DC + offs_r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0)
        s = dot_two_part(q_c, k_c, q_r, k_r, IEEE)
        visible = pos_ok[None, :] & (pos[None, :] < limit[:, None])
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, k_c, True, IEEE)  # the latent is the value

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]  # acc is 0 where empty
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    row_idx = b * M + rows
    if DIRECT:  # one split: the final result
        o_off = row_idx[:, None] * DC + offs_c[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])
        tl.store(lse_ptr + row_idx, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        ws_row = row_idx * n_splits + pid_s
        tl.store(o_ptr + ws_row[:, None] * DC + offs_c[None, :], out, mask=row_ok[:, None] & c_ok[None, :])
        tl.store(lse_ptr + ws_row, lse2, mask=row_ok)


@triton.jit
def merge_splits(ws_ptr, wl_ptr, row, n_splits, n_used, offs_s, offs_c, c_ok, DC: tl.constexpr,
                 CHUNK_S: tl.constexpr, BLOCK_C: tl.constexpr, ONE_PASS: tl.constexpr):
    """Row ``row``'s first ``n_used`` partial outputs (columns ``offs_c`` of ``ws_ptr``'s row-major ``[rows, n_splits,
    DC]`` float32) weighted by their base-2 LSEs (``wl_ptr``'s ``[rows, n_splits]``): ``(acc [BLOCK_C], tot, m)``, the
    weighted sum, the sum of the weights (0: no key) and the largest LSE (0 where every one is -inf); the merged row
    is ``acc / tot``, its base-2 LSE ``m + log2(tot)``. ``ONE_PASS``: a row of at most ``CHUNK_S`` used splits loads
    its LSEs and partials at once (else, as every longer row, the LSEs first). ``offs_s``: ``tl.arange(0,
    CHUNK_S)``."""
    if ONE_PASS and n_used <= CHUNK_S:
        # one chunk: its LSEs and partials are requested together (one round trip, not two); the same sums
        s_ok = offs_s < n_used
        lse_s = tl.load(wl_ptr + row * n_splits + offs_s, mask=s_ok, other=float("-inf"))
        part = tl.load(ws_ptr + (row * n_splits + offs_s)[:, None] * DC + offs_c[None, :],
                       mask=s_ok[:, None] & c_ok[None, :], other=0.0)
        m = tl.max(lse_s, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.math.exp2(lse_s - m_safe)
        tot = tl.sum(w, axis=0)
        acc = tl.sum(part * w[:, None], axis=0)
    else:
        mx = tl.full([CHUNK_S], float("-inf"), dtype=tl.float32)
        for s0 in range(0, n_used, CHUNK_S):
            s_ok = s0 + offs_s < n_used
            mx = tl.maximum(mx, tl.load(wl_ptr + row * n_splits + s0 + offs_s, mask=s_ok, other=float("-inf")))
        m = tl.max(mx, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([CHUNK_S], dtype=tl.float32)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for s0 in range(0, n_used, CHUNK_S):
            s_ok = s0 + offs_s < n_used
            w = tl.math.exp2(tl.load(wl_ptr + row * n_splits + s0 + offs_s, mask=s_ok, other=float("-inf")) - m_safe)
            part = tl.load(ws_ptr + (row * n_splits + s0 + offs_s)[:, None] * DC + offs_c[None, :],
                           mask=s_ok[:, None] & c_ok[None, :], other=0.0)
            total += w
            acc += tl.sum(part * w[:, None], axis=0)
        tot = tl.sum(total, axis=0)
    return acc, tot, m_safe


@triton.jit
def _decode_reduce_kernel(ws_ptr, wl_ptr, out_ptr, lse_ptr, n_splits, split_cap,
                          DC: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
                          ONE_PASS: tl.constexpr = True):
    """Grid ``(rows, cdiv(DC, BLOCK_C))``: program ``(row, c)`` merges columns ``[c * BLOCK_C, (c + 1) * BLOCK_C)``
    of the row's partial outputs (:func:`merge_splits`; every program recomputes the row's weights from its base-2
    LSEs; the first column program stores the natural-log LSE). ``PDL``: launched with programmatic dependent
    launch (``_pdl.py``): everything it reads is the split kernel's, so it waits first."""
    pdl_wait(PDL)
    pdl_launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    offs_s = tl.arange(0, CHUNK_S)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < DC
    n_used = split_count(n_splits, split_cap)  # the first n_used partials of the row's n_splits slots
    acc, tot, m_safe = merge_splits(ws_ptr, wl_ptr, row, n_splits, n_used, offs_s, offs_c, c_ok, DC, CHUNK_S,
                                    BLOCK_C, ONE_PASS)
    empty = tot == 0.0
    out = acc / tl.where(empty, 1.0, tot)
    lse = tl.where(empty, float("-inf"), (m_safe + tl.math.log2(tl.where(empty, 1.0, tot))) * 0.6931471805599453)
    tl.store(out_ptr + row * DC + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_ok)
    if pid_c == 0:
        tl.store(lse_ptr + row, lse)


# A launch of at most ``max_rows`` rows (a concrete count) merges in programs of ``block_c`` columns (None: the whole
# row in one program, as every larger or traced launch does); ``tile``: elements of a program's partial tile per
# load step (its split chunk is ``tile // columns``, at most 64). A benchmark may swap them; timings in BENCHMARKS.md.
REDUCE = dict(block_c=128, max_rows=128, tile=4096, one_pass=True)


def _pick(M: int, B: int, capacity: int, dc: int, device: torch.device, config: dict | None,
          wide: bool = False, fp8: bool = False, block_size: int | None = None, dr: int = 64) -> dict:
    """Tile sizes, warps, stages, page tiles and split count, from shapes only.

    Defaults from sm_90 compiles (benchmarks/kernel_resources.py; no spills) and GPU timings
    (BENCHMARKS.md): BLOCK_H=64 gets wgmma (a warpgroup per 64 rows, ~255 registers, 216 KB of
    shared memory at BLOCK_N=64); BLOCK_H=16/32 use mma.sync with 8 warps. ``wide`` (4-byte cache
    elements) halves the tiles to stay within shared memory. ``PAGE_TILES`` (tiles inside one page of
    ``block_size`` rows, no padded columns: one block-table entry and affine row addresses per tile) is
    on wherever it applies, except for the wgmma kernels over fp8 or at more than 2 stages (spills).
    """
    cfg = dict(config or {})
    block_h = cfg.setdefault("BLOCK_H", min(32 if wide else 64, pow2(M)))
    wgmma = block_h == 64 and not wide
    # BLOCK_N 64 beats 32 at H=128 and at H=16 (timings in BENCHMARKS.md)
    block_n = cfg.setdefault("BLOCK_N", 16 if wide else 32 if block_h == 32 and pow2(dc) >= 256 else 64)
    cfg.setdefault("num_warps", 8 if block_h * pow2(dc) >= 16 * 512 else 4)
    # page tiles where they apply (tiles inside one page, no padded columns; a request holds only there),
    # by default not for the wgmma kernels at more than 2 stages or over fp8 (they spill)
    page = (block_size is not None and block_size % block_n == 0 and pow2(dr) == dr
            and (fp8 or pow2(dc) == dc))
    wanted = cfg.get("PAGE_TILES", not (wgmma and (fp8 or cfg.get("num_stages", 2) > 2)))
    cfg["PAGE_TILES"] = bool(wanted) and page
    # Page tiles cut the 16-row and the wgmma kernels' time, instructions and registers (BENCHMARKS.md);
    # the wgmma kernel takes them with 2 stages (at 3 it spills). Without them the tile's rows come through a
    # per-row block-table load, so Triton's pipeliner spends one stage on it (sm_90 compiles, DeepSeek
    # dims): at 2 stages the wgmma kernel reads the block table with a synchronous load in the loop (LDG
    # 55; 3 stages: LDG 19, the block table is cp.async too); at 3 stages the 16-row kernel has one KV
    # buffer (95 KB), so a tile's load never overlaps the previous tile's math; 5 stages give two (169 KB,
    # still one CTA per SM; likewise the 32-row kernel). The fp8 path keeps its own measured settings.
    if fp8 or wide:
        stages = 2 if wide or wgmma else 3
    elif wgmma:
        stages = 2 if cfg["PAGE_TILES"] else 3
    else:
        stages = 5 if pow2(dc) >= 512 else 3  # BLOCK_H 32 / BLOCK_N 32: 76 -> 113 KB, 200 -> 218 registers
    cfg.setdefault("num_stages", stages)
    # Every split should get a few tiles of the longest possible sequence (a floor division: see split_plan).
    cap = capacity // (4 * block_n)
    cfg["SPLITS"], cfg["DIRECT"] = split_plan(B * triton.cdiv(M, block_h), num_sms(device), cap, cfg.get("SPLITS"))
    cfg.setdefault("SPLIT_CAP", cfg["SPLITS"] if "SPLITS" in (config or {}) else cap)  # splits used on the device
    return cfg


class Split(NamedTuple):
    """What a split-KV launch leaves: ``out [B, s_q, H, dc]`` / ``lse [B, s_q, H]`` (the result itself when
    ``direct``: one split), else the float32 partials ``o_buf`` (row-major ``[B * s_q * H, splits, dc]``) and their
    base-2 LSEs ``l_buf`` (``[B * s_q * H, splits]``), of which each row's first ``split_count(splits, split_cap)``
    are used (:func:`reduce_splits` or ``ops/triton/decode_absorb.py`` merge them); ``rows``: ``B * s_q * H``."""

    out: Tensor
    lse: Tensor
    o_buf: Tensor
    l_buf: Tensor
    splits: int
    split_cap: int
    direct: bool
    rows: int


def _launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
            kv_lora_rank: int, config: dict | None = None, fp8: bool = False) -> tuple[Tensor, Tensor]:
    """Kernel path (any device the Triton runtime accepts; the interpreter on CPU tensors): :func:`split_launch`, then
    :func:`reduce_splits`."""
    part = split_launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, config, fp8)
    reduce_splits(wrap_triton, part.o_buf, part.l_buf, part.out, part.lse, part.rows, part.splits, part.split_cap,
                  kv_lora_rank, pow2(kv_lora_rank, 128 if fp8 else 16), part.direct)
    return part.out, part.lse


def split_launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                 kv_lora_rank: int, config: dict | None = None, fp8: bool = False) -> Split:
    """The split kernel of :func:`_launch` alone: its :class:`Split` (nothing merged).

    ``config`` overrides the heuristics: BLOCK_H, BLOCK_N, num_warps, num_stages, SPLITS. The split
    count is a runtime kernel argument, so batch sizes that change it reuse the compiled kernels.
    ``fp8``: ``kv_cache`` is the uint8 DeepSeek fp8 format (``mla::decode_fp8``), dequantized per tile
    to q's dtype (float32 q: float32 math).
    """
    B, s_q, H, D = q.shape
    dc, dr = kv_lora_rank, D - kv_lora_rank
    M = s_q * H
    out, lse = decode_outputs(q, dc)
    if B == 0 or M == 0:
        return Split(out, lse, out, lse, 1, 1, True, B * M)
    q = last_dim_contiguous(q)
    kv_cache = last_dim_contiguous(kv_cache)
    block_size = kv_cache.shape[1]
    compute = q if fp8 else kv_cache  # the dtype of the tiles in the dots
    cfg = _pick(M, B, block_table.shape[1] * block_size, dc, q.device, config, compute.element_size() > 2, fp8,
                block_size=block_size, dr=dr)
    splits, direct = cfg["SPLITS"], cfg["DIRECT"]
    block_dc = pow2(dc, 128 if fp8 else 16)
    o_buf, l_buf = split_buffers(out, lse, B * M, splits, dc, direct)
    grid = (triton.cdiv(M, cfg["BLOCK_H"]), splits, B)
    if fp8:  # its own kernel (ops/triton/fp8_decode_kernel.py): codes by scale group, scales out of the tile
        kernel, tile = _decode_fp8_split_kernel, {"G": dc // 128}
    else:
        kernel, tile = _decode_split_kernel, {"BLOCK_DC": block_dc}
    wrap_triton(kernel)[grid](
        q, kv_cache, block_table, seq_lens, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        M, H, s_q, splits, cfg["SPLIT_CAP"], DC=dc, DR=dr,
        BLOCK_SIZE=block_size, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_DR=pow2(dr), DIRECT=direct, IEEE=compute.dtype == torch.float32, PAGE_TILES=cfg["PAGE_TILES"],
        **tile,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return Split(out, lse, o_buf, l_buf, splits, cfg["SPLIT_CAP"], direct, B * M)


def decode_outputs(q: Tensor, dc: int) -> tuple[Tensor, Tensor]:
    """Uninitialized ``out [B, s_q, H, dc]`` (q's dtype) and ``lse [B, s_q, H]`` (float32) for q ``[B, s_q, H, D]``."""
    B, s_q, H, _ = q.shape
    return (torch.empty(B, s_q, H, dc, dtype=q.dtype, device=q.device),
            torch.empty(B, s_q, H, dtype=torch.float32, device=q.device))


def reduce_splits(wrap, o_buf: Tensor, l_buf: Tensor, out: Tensor, lse: Tensor, rows: int, splits, split_cap,
                  dc: int, block_dc: int, direct: bool, pdl: bool = False) -> None:
    """Merge the splits' partial outputs and base-2 LSEs into ``out``/``lse`` (nothing to do when ``direct``):
    the first ``min(splits, max(split_cap, 1))`` of each row's ``splits`` slots, the ones the split kernel
    used, in programs of ``REDUCE["block_c"]`` columns when there are few rows. ``wrap`` is the caller module's
    ``wrap_triton`` (tests record launches through it). ``pdl``: the caller is a custom op's body (not a
    ``triton_op``, whose launches Inductor regenerates), so the launch may take PDL (``_pdl.py``)."""
    if not direct:
        few = isinstance(rows, int) and rows <= REDUCE["max_rows"]  # a symbolic count is never compared (no guard)
        block_c = min(block_dc, REDUCE["block_c"] or block_dc) if few else block_dc
        wrap(_decode_reduce_kernel)[(rows, triton.cdiv(dc, block_c))](
            o_buf, l_buf, out, lse, splits, split_cap, DC=dc, CHUNK_S=max(1, min(64, REDUCE["tile"] // block_c)),
            BLOCK_C=block_c, ONE_PASS=REDUCE["one_pass"], num_warps=4,
            **(launch_kwargs(out.device) if pdl else dict(OFF)),
        )


@triton_op("mla::decode_triton", mutates_args=())
def decode_triton(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                  kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Triton ``mla::decode`` (same contract as ``mla::decode_ref``); non-CUDA or float64 runs the reference."""
    if q.device.type != "cuda" or torch.float64 in (q.dtype, kv_cache.dtype):
        return torch.ops.mla.decode_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    validate(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    return _launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
