"""The sm_90 (Hopper) Gluon decode over the 656-byte fp8 latent cache: ``wgmma`` with the keys as the M dim.

A key-split ``mma.sync`` kernel (the one ``fp8_decode_gluon`` replaced) was bound by issue and latency at
H = 16, not bytes (it ran nearly as long with its loads removed; BENCHMARKS.md). Here one warpgroup
(4 warps) computes the transposed products, which suit ``wgmma``'s M = 64:

- ``S^T [64 keys, 16 rows] = K Q^T``: A is the dequantized float16 key tile in shared memory, B the query rows;
- the softmax runs down the key dim (the max over the 4 warps' key rows through shared memory);
- ``O^T [512, 16] += V^T P^T``: A is the same tile read transposed (``wgmma`` transposes 16-bit A),
  B the probabilities, written to shared memory.

A 64-key tile needs a 64 KB tile; to keep two programs on an SM (the other program's warps run while one
waits on its ``wgmma``s and barriers) the codes bypass shared memory: each thread loads its 4-code words for
the next tile into registers (``ld.global``) while the current tile is computed, and dequantizes them into
the tile itself in inline PTX on packed words (the layout stores without bank conflicts). The dots run in
float16, which halves the dequantization's instructions against bf16 (no float32 round trip): a code
becomes float16 exactly and is multiplied by its scale rounded to float16 (``mul.f16x2``), one rounding of
relative 2^-11 where a bf16 cache holds 2^-9. Float16's range bounds this: the scale is clamped so that
values saturate at 65504 rather than overflow, and a group whose largest magnitude is below 0.027 has a
subnormal scale, rounded to 2^-25 absolute (relative 2^-25 / scale); DeepSeek's normalized latents sit far
inside both bounds.
The query rows are scaled by a power of two that puts their largest magnitude in [2^13, 2^15) (exact;
undone in the softmax scale) and P is float16. The scales come with the codes; rope rows stream through a
2-deep ``cp.async`` ring; block-table entries are read a tile ahead so no address waits on one.
Same program layout, splits and outputs as ``fp8_decode_gluon`` (workspace rows or the final result); pages
must hold a multiple of 64 rows. Timings against the bf16 decode and the other fp8 kernels: BENCHMARKS.md.
"""

from __future__ import annotations

import triton
from torch import Tensor
from torch.library import wrap_triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from mla_compile.ops.triton._common import last_dim_contiguous, num_sms
from mla_compile.ops.triton._gluon import dequant_pairs, finish_rows, split_range, stage_q, tile_page
from mla_compile.ops.triton._plan import opaque_splits, split_buffers
from mla_compile.ops.triton.decode import _LOG2E, decode_outputs, reduce_splits

GROUP = gl.constexpr(128)  # values per fp32 scale
BLOCK_N = 64  # keys per tile: wgmma's M
BLOCK_H = 16  # query rows per program: wgmma's N
PROGRAMS_PER_SM = 2  # by shared memory (``smem_bytes``) and registers (255 a thread, 4 warps)


@gluon.jit
def _tile_rows(kv_ptr, page, tile, start, stride_kb, stride_kt, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Byte address of a tile's first cache row, and its first position."""
    n0 = start + tile * BLOCK_N
    return kv_ptr + page * stride_kb + (n0 % BLOCK_SIZE).to(gl.int64) * stride_kt, n0


@gluon.jit
def _issue_rope(rope_s, base, n0, tile, n_tiles, end, stride_kt, DC: gl.constexpr, DR: gl.constexpr,
                BLOCK_N: gl.constexpr, rope_l: gl.constexpr):
    """Start the copy of a tile's rope rows into ring slot ``tile % 2`` (rows at or past ``end`` zero-filled)."""
    r = gl.arange(0, BLOCK_N, gl.SliceLayout(1, rope_l))
    ok = (n0 + r < end) & (tile < n_tiles)
    rope = (base + r.to(gl.int64) * stride_kt + DC + 4 * (DC // GROUP)).to(gl.pointer_type(gl.bfloat16))
    cols = gl.arange(0, DR, gl.SliceLayout(0, rope_l))
    cp.async_copy_global_to_shared(rope_s.index(tile % 2), rope[:, None] + cols[None, :], mask=ok[:, None])
    cp.commit_group()


@gluon.jit
def _load_group(base, n0, tile, n_tiles, end, stride_kt, g: gl.constexpr, DC: gl.constexpr, BLOCK_N: gl.constexpr,
                code_l: gl.constexpr):
    """Scale group ``g`` of a tile: its codes, 4 per int32 word, ``[BLOCK_N, 32]``, and its scales
    ``[BLOCK_N, 1]`` (0 past ``end``)."""
    r = gl.arange(0, BLOCK_N, gl.SliceLayout(1, code_l))
    ok = ((n0 + r < end) & (tile < n_tiles))[:, None]
    row = base + r.to(gl.int64)[:, None] * stride_kt
    words = (row + g * GROUP).to(gl.pointer_type(gl.int32))
    codes = gl.load(words + gl.arange(0, GROUP // 4, gl.SliceLayout(0, code_l))[None, :], mask=ok, other=0)
    return codes, gl.load((row + DC).to(gl.pointer_type(gl.float32)) + g, mask=ok, other=0.0)


@gluon.jit
def decode_fp8_wgmma_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_kt,
    stride_bt,
    M, H, S_Q, n_splits, DC: gl.constexpr, DR: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_H), n_splits, B)``, 4 warps; bf16 q ``[B, S_Q, H, DC + DR]``; ``DC = 512``,
    ``DR = 64``; ``BLOCK_N`` divides ``BLOCK_SIZE``."""
    gl.static_assert(DC == 4 * GROUP)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16])
    code_l: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [4, 1], [1, 0])  # 8 codes a thread per row
    tile_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])  # their 8 halves: no bank conflict
    rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    nvmma: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    nvmma_w: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.float16)

    scale_log2 = gl.full([], scale_log2, gl.float32)
    pid_h = gl.program_id(0)
    pid_s, b, seq_len, start, end, n_tiles, bt_row = split_range(seq_lens_ptr, bt_ptr, stride_bt, n_splits, BLOCK_N)

    rope_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, DR], nvmma)
    kv_s = gl.allocate_shared_memory(gl.float16, [BLOCK_N, DC], nvmma)
    kv_w = kv_s._reinterpret(gl.int32, [BLOCK_N, DC // 2], nvmma_w)
    q_s = gl.allocate_shared_memory(gl.float16, [BLOCK_H, DC], nvmma)
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DR], nvmma)
    p_s = gl.allocate_shared_memory(gl.float16, [BLOCK_N, BLOCK_H], p_sl)

    base, n0 = _tile_rows(kv_ptr, tile_page(bt_row, 0, n_tiles, start, BLOCK_SIZE, BLOCK_N), 0, start, stride_kb,
                          stride_kt, BLOCK_SIZE, BLOCK_N)
    page_next = tile_page(bt_row, 1, n_tiles, start, BLOCK_SIZE, BLOCK_N)
    _issue_rope(rope_s, base, n0, 0, n_tiles, end, stride_kt, DC, DR, BLOCK_N, rope_l)
    c0, s0 = _load_group(base, n0, 0, n_tiles, end, stride_kt, 0, DC, BLOCK_N, code_l)
    c1, s1 = _load_group(base, n0, 0, n_tiles, end, stride_kt, 1, DC, BLOCK_N, code_l)
    c2, s2 = _load_group(base, n0, 0, n_tiles, end, stride_kt, 2, DC, BLOCK_N, code_l)
    c3, s3 = _load_group(base, n0, 0, n_tiles, end, stride_kt, 3, DC, BLOCK_N, code_l)

    rows_q = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, rope_l))  # s_q * H folded
    q_row = q_ptr + b * stride_qb + (rows_q // H).to(gl.int64) * stride_qs + (rows_q % H).to(gl.int64) * stride_qh
    scale_log2 = stage_q(q_s, qr_s, q_row, (rows_q < M)[:, None], scale_log2, DC, DR, rope_l)

    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(0, mma))
    row_ok = rows < M
    limit = seq_len - (S_Q - 1 - rows // H)  # causal: a row sees positions < limit
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(1, mma))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
    l_part = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, mma)  # per-key sums, reduced once at the end
    acc = gl.zeros([DC, BLOCK_H], gl.float32, mma)

    for i in range(n_tiles):
        base, n0 = _tile_rows(kv_ptr, page_next, i + 1, start, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)
        page_next = tile_page(bt_row, i + 2, n_tiles, start, BLOCK_SIZE, BLOCK_N)
        _issue_rope(rope_s, base, n0, i + 1, n_tiles, end, stride_kt, DC, DR, BLOCK_N, rope_l)
        gl.thread_barrier()  # every warp's part of the last tile's wgmmas has read kv_s and p_s
        kv_w.slice(0, GROUP // 2, dim=1).store(gl.convert_layout(dequant_pairs(c0, s0), tile_l))
        kv_w.slice(GROUP // 2, GROUP // 2, dim=1).store(gl.convert_layout(dequant_pairs(c1, s1), tile_l))
        kv_w.slice(GROUP, GROUP // 2, dim=1).store(gl.convert_layout(dequant_pairs(c2, s2), tile_l))
        kv_w.slice(3 * (GROUP // 2), GROUP // 2, dim=1).store(gl.convert_layout(dequant_pairs(c3, s3), tile_l))
        c0, s0 = _load_group(base, n0, i + 1, n_tiles, end, stride_kt, 0, DC, BLOCK_N, code_l)
        c1, s1 = _load_group(base, n0, i + 1, n_tiles, end, stride_kt, 1, DC, BLOCK_N, code_l)
        c2, s2 = _load_group(base, n0, i + 1, n_tiles, end, stride_kt, 2, DC, BLOCK_N, code_l)
        c3, s3 = _load_group(base, n0, i + 1, n_tiles, end, stride_kt, 3, DC, BLOCK_N, code_l)
        cp.wait_group(1)  # tile i's rope rows (this thread's copies; the barrier below shows everyone's)
        slot = i % 2
        fence_async_shared()
        gl.thread_barrier()

        s = warpgroup_mma(kv_s, q_s.permute([1, 0]), gl.zeros([BLOCK_N, BLOCK_H], gl.float32, mma))
        s = warpgroup_mma(rope_s.index(slot), qr_s.permute([1, 0]), s)
        pos = start + i * BLOCK_N + offs_n
        visible = (pos < end)[:, None] & (pos[:, None] < limit[None, :])
        s = gl.where(visible, s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing: no NaN
        alpha = gl.exp2(m_i - m_shift)
        p = gl.exp2(s - m_shift[None, :])
        l_part = l_part * alpha[None, :] + p
        m_i = m_new
        p_s.store(p.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(kv_s.permute([1, 0]), p_s, acc * alpha[None, :])
    cp.wait_group(0)

    inv, o_first = finish_rows(gl.sum(l_part, axis=0), m_i, rows, row_ok, b, M, pid_s, n_splits, lse_ptr, DC, DIRECT)
    ty: gl.constexpr = o_ptr.dtype.element_ty
    gl.store(o_ptr + o_first[None, :] + gl.arange(0, DC, gl.SliceLayout(1, mma))[:, None], (acc * inv[None, :]).to(ty),
             mask=row_ok[None, :])


def smem_bytes() -> int:
    """Shared memory of one program (the sm_90 compile's figure, checked by a test): the rope ring, the
    float16 key tile, q, P, and the 4-warp max exchange."""
    return 2 * BLOCK_N * 64 * 2 + BLOCK_N * 1024 + BLOCK_H * 1152 + BLOCK_N * BLOCK_H * 2 + 4 * BLOCK_H * 4


def split_setup(q: Tensor, kv_cache: Tensor, block_table: Tensor, kv_lora_rank: int, block_n: int,
                programs_per_sm: int, config: dict | None):
    """``(q, out, lse, splits, direct, o_buf, l_buf)`` of a split launch of 16-row programs: q with a contiguous
    last dim, the outputs, the split plan (``_plan.opaque_splits``; ``splits`` 0 for an empty call, whose
    result ``out``/``lse`` already are) and the workspaces (``_plan.split_buffers``)."""
    B, s_q, H, _ = q.shape
    out, lse = decode_outputs(q, kv_lora_rank)
    if B == 0 or s_q * H == 0:
        return q, out, lse, 0, True, out, lse
    splits, direct = opaque_splits(config, B * triton.cdiv(s_q * H, BLOCK_H), num_sms(q.device) * programs_per_sm,
                                   block_table.shape[1] * kv_cache.shape[1], block_n)
    o_buf, l_buf = split_buffers(out, lse, B * s_q * H, splits, kv_lora_rank, direct)
    return last_dim_contiguous(q), out, lse, splits, direct, o_buf, l_buf


def launch_split(kernel, block_n: int, programs_per_sm: int, q: Tensor, kv_cache: Tensor, block_table: Tensor,
                 seq_lens: Tensor, scale: float, kv_lora_rank: int, config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Launch a Gluon fp8 decode kernel of this module's signature (16-row programs, ``block_n``-key tiles,
    4 warps) over grid ``(cdiv(s_q * H, 16), splits, B)`` and merge its splits. ``config``: SPLITS (else the
    SMs' ``programs_per_sm`` slots filled in whole waves, ``_plan.opaque_splits``)."""
    B, s_q, H, D = q.shape
    dc = kv_lora_rank
    M = s_q * H
    q, out, lse, splits, direct, o_buf, l_buf = split_setup(q, kv_cache, block_table, dc, block_n, programs_per_sm,
                                                            config)
    if not splits:
        return out, lse
    block_size = kv_cache.shape[1]
    kernel[(triton.cdiv(M, BLOCK_H), splits, B)](
        q, kv_cache, block_table, seq_lens, o_buf, l_buf,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        M, H, s_q, splits, DC=dc, DR=D - dc, BLOCK_SIZE=block_size, BLOCK_H=BLOCK_H, BLOCK_N=block_n,
        DIRECT=direct, num_warps=4,
    )
    reduce_splits(wrap_triton, o_buf, l_buf, out, lse, B * M, splits, splits, dc, dc, direct)
    return out, lse


def launch(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, scale: float, kv_lora_rank: int,
           config: dict | None = None) -> tuple[Tensor, Tensor]:
    """Run the kernel (sm_90; a call ``fp8_cache.gluon_eligible`` accepts, pages of a multiple of 64 rows).
    ``config``: SPLITS (else the SMs' program slots filled in whole waves, ``_plan.opaque_splits``)."""
    return launch_split(decode_fp8_wgmma_kernel, BLOCK_N, PROGRAMS_PER_SM, q, kv_cache, block_table, seq_lens, scale,
                        kv_lora_rank, config)
