"""A Gluon (Triton's tile-level dialect) split-KV decode over the 656-byte fp8 latent cache, sm_89+
(``mma.sync`` and ``cp.async`` from sm_80, hardware e4m3 conversions from sm_89: ``fp8_cache.gluon_eligible``).

Why not plain Triton: the value dot needs the e4m3 codes with the keys along its reduction dim, and
Triton 3.6 reads an 8-bit tile in that order from shared memory a byte at a time (``fp8_decode_kernel``
pays ~2x the bf16 kernel's instructions for it). Here the kernel owns shared memory:

1. ``cp.async`` streams each tile's codes, scales and rope rows into a ``STAGES``-deep ring (the copies
   of the next tiles are in flight while one is computed);
2. all warps dequantize the tile once, ``f16(code) * f16(scale)``, into one float16 ``[BLOCK_N, DC]`` tile;
3. the score dot reads that tile transposed and the value dot reads it as is, both through ``ldmatrix``
   (16-bit, so the transposed read is one instruction per 8x8 block).

The warps split the keys of the score tile and the columns of the accumulator (``mma.sync`` m16n8k16,
``BLOCK_H = 16`` query rows per program). The dots run in float16 as in ``fp8_decode_wgmma`` (the same
``_gluon.dequant_pairs`` and ``stage_q``; the float16 range limits are in its docstring): step 2 rounds
each value once, relative 2**-11 (far below e4m3's own 2**-4). H200, B=128 x 8192 keys, H=16, page 64: 390 us
(406 with the bf16 tile; BENCHMARKS.md, sixth session). Same program layout, splits and outputs as
``decode._decode_split_kernel`` (workspace rows or the final result).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from mla_compile.ops._dispatch import LAYOUT_TAGS
from mla_compile.ops.fp8_cache import validate_decode
from mla_compile.ops.triton._common import last_dim_contiguous, num_sms
from mla_compile.ops.triton import fp8_decode_wgmma
from mla_compile.ops.triton._gluon import dequant_pairs, finish_rows, split_range, stage_q
from mla_compile.ops.triton._plan import opaque_splits, split_buffers
from mla_compile.ops.triton.decode import _LOG2E, decode_outputs, reduce_splits
from mla_compile.ops.triton.fp8_decode import launch_fp8

GROUP = gl.constexpr(128)  # values per fp32 scale


@gluon.jit
def _issue(codes_s, scales_s, rope_s, kv_ptr, bt_row, tile, n_tiles, start, end, stride_kb, stride_kt,
           DC: gl.constexpr, DR: gl.constexpr, G: gl.constexpr, BLOCK_SIZE: gl.constexpr,
           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, code_l: gl.constexpr, scale_l: gl.constexpr,
           rope_l: gl.constexpr):
    """Start the copies of tile ``tile`` (positions ``start + tile * BLOCK_N + [0, BLOCK_N)``) into ring slot
    ``tile % STAGES``; rows at or past ``end`` and tiles past ``n_tiles`` are zero-filled, never read."""
    slot = tile % STAGES
    n0 = start + tile * BLOCK_N
    live = tile < n_tiles
    page = gl.load(bt_row + n0 // BLOCK_SIZE, mask=live, other=0).to(gl.int64)
    base = kv_ptr + page * stride_kb + (n0 % BLOCK_SIZE).to(gl.int64) * stride_kt

    r_c = gl.arange(0, BLOCK_N, gl.SliceLayout(1, code_l))
    c_c = gl.arange(0, DC, gl.SliceLayout(0, code_l))
    ok_c = (n0 + r_c < end) & live
    cp.async_copy_global_to_shared(codes_s.index(slot), base + r_c.to(gl.int64)[:, None] * stride_kt + c_c[None, :],
                                   mask=ok_c[:, None])

    r_s = gl.arange(0, BLOCK_N, gl.SliceLayout(1, scale_l))
    c_s = gl.arange(0, G, gl.SliceLayout(0, scale_l))
    ok_s = (n0 + r_s < end) & live
    s_ptr = (base + r_s.to(gl.int64) * stride_kt + DC).to(gl.pointer_type(gl.float32))
    cp.async_copy_global_to_shared(scales_s.index(slot), s_ptr[:, None] + c_s[None, :], mask=ok_s[:, None])

    r_r = gl.arange(0, BLOCK_N, gl.SliceLayout(1, rope_l))
    c_r = gl.arange(0, DR, gl.SliceLayout(0, rope_l))
    ok_r = (n0 + r_r < end) & live
    r_ptr = (base + r_r.to(gl.int64) * stride_kt + DC + 4 * G).to(gl.pointer_type(gl.bfloat16))
    cp.async_copy_global_to_shared(rope_s.index(slot), r_ptr[:, None] + c_r[None, :], mask=ok_r[:, None])
    cp.commit_group()


@gluon.jit
def decode_fp8_gluon_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt,
    stride_bt,
    M, H, S_Q, n_splits, DC: gl.constexpr, DR: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, DIRECT: gl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_H), n_splits, B)``; bf16 q ``[B, S_Q, H, DC + DR]``; ``DC = 512``, ``DR = 64``,
    ``BLOCK_N`` divides ``BLOCK_SIZE`` (every tile lies in one page)."""
    NW: gl.constexpr = gl.num_warps()
    G: gl.constexpr = DC // GROUP
    KC: gl.constexpr = 64  # score dot: reduction chunk
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    code_l: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [NW, 1], [1, 0])  # 16 bytes per thread
    word_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])  # [BLOCK_N, 32] code words
    scale_l: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [NW, 1], [1, 0])
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    swz: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    swz_w: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])  # swz's int32 view

    scale_log2 = gl.full([], scale_log2, gl.float32)
    pid_h = gl.program_id(0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, BLOCK_N)

    codes_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, DC], flat)
    scales_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, G], flat)
    rope_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DR], swz)
    codes_w = codes_s._reinterpret(gl.int32, [STAGES, BLOCK_N, DC // 4], flat)
    kv_s = gl.allocate_shared_memory(gl.float16, [BLOCK_N, DC], swz)
    kv_w = kv_s._reinterpret(gl.int32, [BLOCK_N, DC // 2], swz_w)
    q_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, DC], swz)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DR], swz)

    for t in gl.static_range(STAGES - 1):
        _issue(codes_s, scales_s, rope_s, kv_ptr, bt_row, t, n_tiles, start, end, stride_kb, stride_kt,
               DC, DR, G, BLOCK_SIZE, BLOCK_N, STAGES, code_l, scale_l, rope_l)

    # the program's query rows (s_q * H folded), staged once in shared memory
    rows_q = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, q_l))
    ok_q = rows_q < M
    q_row = q_ptr + b * stride_qb + (rows_q // H).to(gl.int64) * stride_qs + (rows_q % H).to(gl.int64) * stride_qh
    scale_log2 = stage_q(q_s, qr_s, q_row, ok_q[:, None], scale_log2, DC, DR, q_l)

    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, mma))
    row_ok = rows < M
    limit = seq_len - (S_Q - 1 - rows // H)  # causal: row sees positions < limit
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, mma))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, mma)  # per-column sums, reduced once at the end
    acc0 = gl.zeros([BLOCK_H, GROUP], gl.float32, mma)
    acc1 = gl.zeros([BLOCK_H, GROUP], gl.float32, mma)
    acc2 = gl.zeros([BLOCK_H, GROUP], gl.float32, mma)
    acc3 = gl.zeros([BLOCK_H, GROUP], gl.float32, mma)

    for i in range(n_tiles):
        _issue(codes_s, scales_s, rope_s, kv_ptr, bt_row, i + STAGES - 1, n_tiles, start, end, stride_kb,
               stride_kt, DC, DR, G, BLOCK_SIZE, BLOCK_N, STAGES, code_l, scale_l, rope_l)
        cp.wait_group(STAGES - 1)
        gl.thread_barrier()  # tile i's copies (made by every thread) are visible; kv_s is free
        slot = i % STAGES
        for g in gl.static_range(G):
            words = codes_w.index(slot).slice(g * (GROUP // 4), GROUP // 4, dim=1).load(word_l)
            sc = scales_s.index(slot).slice(g, 1, dim=1).load(word_l)
            kv_w.slice(g * (GROUP // 2), GROUP // 2, dim=1).store(dequant_pairs(words, sc))
        gl.thread_barrier()

        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, mma)
        for c in gl.static_range(DC // KC):
            a = q_s.slice(c * KC, KC, dim=1).load(dot_a)
            k_t = kv_s.slice(c * KC, KC, dim=1).permute([1, 0]).load(dot_b)
            s = mma_v2(a, k_t, s)
        s = mma_v2(qr_s.load(dot_a), rope_s.index(slot).permute([1, 0]).load(dot_b), s)

        pos = start + i * BLOCK_N + offs_n
        visible = (pos < end)[None, :] & (pos[None, :] < limit[:, None])
        s = gl.where(visible, s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
        alpha = gl.exp2(m_i - m_shift)
        p = gl.exp2(s - m_shift[:, None])
        l_part = l_part * alpha[:, None] + p
        m_i = m_new
        p_a = gl.convert_layout(p.to(gl.float16), dot_a)
        acc0 = mma_v2(p_a, kv_s.slice(0, GROUP, dim=1).load(dot_b), acc0 * alpha[:, None])
        acc1 = mma_v2(p_a, kv_s.slice(GROUP, GROUP, dim=1).load(dot_b), acc1 * alpha[:, None])
        acc2 = mma_v2(p_a, kv_s.slice(2 * GROUP, GROUP, dim=1).load(dot_b), acc2 * alpha[:, None])
        acc3 = mma_v2(p_a, kv_s.slice(3 * GROUP, GROUP, dim=1).load(dot_b), acc3 * alpha[:, None])
    cp.wait_group(0)

    inv, o_first = finish_rows(gl.sum(l_part, axis=1), m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT)
    o_row = o_ptr + o_first[:, None] + gl.arange(0, GROUP, gl.SliceLayout(0, mma))[None, :]
    ty: gl.constexpr = o_ptr.dtype.element_ty
    gl.store(o_row, (acc0 * inv[:, None]).to(ty), mask=row_ok[:, None])
    gl.store(o_row + GROUP, (acc1 * inv[:, None]).to(ty), mask=row_ok[:, None])
    gl.store(o_row + 2 * GROUP, (acc2 * inv[:, None]).to(ty), mask=row_ok[:, None])
    gl.store(o_row + 3 * GROUP, (acc3 * inv[:, None]).to(ty), mask=row_ok[:, None])


def smem_bytes(block_n: int, stages: int) -> int:
    """Shared memory of one program (the sm_90 compile's figure, checked by a test): the copy ring
    (656 bytes a row), the float16 tile, q, and the 2-byte-per-score scratch of P's layout change."""
    return stages * block_n * 656 + block_n * 1024 + 16 * 1152 + 32 * block_n


def programs_per_sm(block_n: int, stages: int, num_warps: int, smem_per_sm: int = 233472) -> int:
    """Programs one SM holds at once: shared memory (1 KB reserved per program) and registers (at most
    255 per thread in a 64K file)."""
    return max(1, min(smem_per_sm // (smem_bytes(block_n, stages) + 1024), 65536 // (255 * 32 * num_warps)))


def launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
           config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Run the kernel (a call ``mla_compile.ops.fp8_cache.gluon_eligible`` accepts). ``config``: BLOCK_N
    (32 or 64), STAGES, num_warps, SPLITS. The split count fills the SMs' program slots in whole waves
    (``_plan.opaque_splits``); the Triton reduce kernel merges the splits."""
    B, s_q, H, D = q.shape
    dc, dr = kv_lora_rank, D - kv_lora_rank
    M = s_q * H
    out, lse = decode_outputs(q, dc)
    if B == 0 or M == 0:
        return out, lse
    q = last_dim_contiguous(q)
    cfg = {"BLOCK_N": 32, "STAGES": 3, "num_warps": 4, **(config or {})}
    block_n, stages, warps = cfg["BLOCK_N"], cfg["STAGES"], cfg["num_warps"]
    block_size = kv_cache.shape[1]
    slots = num_sms(q.device) * programs_per_sm(block_n, stages, warps)
    splits, direct = opaque_splits(cfg, B * triton.cdiv(M, 16), slots, block_table.shape[1] * block_size, block_n)
    o_buf, l_buf = split_buffers(out, lse, B * M, splits, dc, direct)
    decode_fp8_gluon_kernel[(triton.cdiv(M, 16), splits, B)](
        q, kv_cache, block_table, seq_lens, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        M, H, s_q, splits, DC=dc, DR=dr, BLOCK_SIZE=block_size, BLOCK_H=16, BLOCK_N=block_n,
        STAGES=stages, DIRECT=direct, num_warps=warps,
    )
    reduce_splits(wrap_triton, o_buf, l_buf, out, lse, B * M, splits, splits, dc, dc, direct)
    return out, lse


@torch.library.custom_op("mla::decode_fp8_gluon", mutates_args=(), tags=LAYOUT_TAGS)
def decode_fp8_gluon(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float,
                     kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    """Gluon ``mla::decode_fp8`` (same contract as ``mla::decode_fp8_ref``; an opaque call to Inductor): the
    ``wgmma`` kernel where ``wgmma_serves``, else this module's. A cache whose base is not 16-byte aligned (a
    view at an odd offset) runs the Triton kernel instead."""
    validate_decode(q, kv_cache, block_table, seq_lens, kv_lora_rank)
    if kv_cache.data_ptr() % 16:
        return launch_fp8(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    if wgmma_serves(q, kv_cache):
        return fp8_decode_wgmma.launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return launch(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)


def wgmma_serves(q: Tensor, kv_cache: Tensor) -> bool:
    """Whether ``mla::decode_fp8_gluon`` runs the sm_90 ``wgmma`` kernel (``fp8_decode_wgmma``: an sm_90 GPU,
    pages of a multiple of 64 rows) rather than this module's ``mma.sync`` one."""
    return torch.cuda.get_device_capability(q.device) == (9, 0) and kv_cache.shape[1] % fp8_decode_wgmma.BLOCK_N == 0


@decode_fp8_gluon.register_fake
def _(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank):
    return decode_outputs(q, kv_lora_rank)
